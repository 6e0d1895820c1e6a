"""What the bench puts around both schedules, from outside: their tasks and their received messages.

Megatron's own schedules run every F and B through megatron-core's ``schedules.forward_step`` /
``backward_step`` (module attributes its schedules look up at call time, as ``mcore.compat`` does
for RRFP's F and B) and receive through ``P2PCommunicator._communicate``; the bench wraps those
megatron-core functions. RRFP's own tasks and inbox are reached through the runtime's extension
points, ``RRFPConfig.around_task`` and ``RRFPConfig.deliver_message``; nothing here replaces a
name of this package.

* ``wrap_megatron_tasks(on_task, on_pair)`` — every F / B that megatron-core's ``forward_step`` /
  ``backward_step`` run (Megatron's schedules and RRFP's alike) goes through ``on_task(task, run)``;
  a step of megatron-core's ``combined_1f1b.combined_forward_backward_step``
  (``--overlap-moe-expert-parallel-comm``: Megatron's combined-1F1B schedule and RRFP's pairs) through
  ``on_pair(forward, backward, run)`` when it holds both halves, else ``on_task`` of its one half;
* ``weight_tasks(on_task)`` — an ``around_task`` that routes RRFP's W (its own task, no
  megatron-core function) through ``on_task`` too: with both, every task of both schedules;
* ``sleep_before_tasks(delay)`` — an ``around_task`` sleeping ``delay(task)`` seconds before each
  of RRFP's tasks: drifting stages, so that readiness really reorders;
* ``HeldMessages(delay, fifo_per_sender=...)`` — a ``deliver_message`` holding each message back
  ``delay(message)`` seconds: emulated link latency;
* ``count_in_flight()`` — forwards whose backward has not run, fed by ``wrap_megatron_tasks``: the
  peak in flight of Megatron's own schedules, measured like RRFP's;
* ``count_received(meter)`` — every tensor Megatron's own schedules receive is counted by
  ``meter`` until its last reference goes, as RRFP's meter counts the messages waiting in its
  executor: both schedules' receive buffers.
"""
from __future__ import annotations

import functools
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

from ..policy.actions import Kind, Task

OnTask = Callable[[Task, Callable[[], Any]], Any]
OnPair = Callable[[Task, Task, Callable[[], Any]], Any]


def wrap_megatron_tasks(on_task: OnTask, on_pair: Optional[OnPair] = None) -> None:
    """Route every F and B that megatron-core's ``forward_step`` / ``backward_step`` run in this
    process through ``on_task(task, run)``; ``run()`` computes it. A combined step (megatron-core's
    ``combined_forward_backward_step``, looked up at call time by its schedules and by
    ``mcore.compat``) holding a forward and a backward goes through ``on_pair(forward, backward,
    run)`` (without ``on_pair``: ``on_task`` of the forward around ``on_task`` of the backward)."""
    from megatron.core.pipeline_parallel import combined_1f1b, schedules

    forward_step, backward_step = schedules.forward_step, schedules.backward_step
    forward_of: dict[int, Task] = {}  # id(output tensor) -> its forward: B learns its microbatch

    @functools.wraps(forward_step)  # compat reads the real signature through __wrapped__
    def hooked_forward_step(*args, **kwargs):
        task = Task(Kind.F, kwargs.get("current_microbatch"), kwargs.get("vp_stage") or 0)
        output, num_tokens = on_task(task, lambda: forward_step(*args, **kwargs))
        forward_of[id(output[0] if isinstance(output, list) else output)] = task
        return output, num_tokens

    @functools.wraps(backward_step)
    def hooked_backward_step(input_tensor, output_tensor, *args, **kwargs):
        forward = forward_of.pop(id(output_tensor[0] if isinstance(output_tensor, list) else output_tensor))
        return on_task(Task(Kind.B, forward.microbatch, forward.chunk),
                       lambda: backward_step(input_tensor, output_tensor, *args, **kwargs))

    schedules.forward_step, schedules.backward_step = hooked_forward_step, hooked_backward_step
    combined = combined_1f1b.combined_forward_backward_step

    @functools.wraps(combined)
    def hooked_combined_step(forward_step_func, data_iterator, f_model, num_microbatches, input_tensor,
                             forward_data_store, b_model, b_input_tensor, b_output_tensor, b_output_tensor_grad,
                             config, *args, **kwargs):
        def run():
            return combined(forward_step_func, data_iterator, f_model, num_microbatches, input_tensor,
                            forward_data_store, b_model, b_input_tensor, b_output_tensor, b_output_tensor_grad,
                            config, *args, **kwargs)

        forward = None if f_model is None else \
            Task(Kind.F, kwargs.get("current_microbatch"), kwargs.get("f_model_chunk_id") or 0)
        backward = None
        if b_model is not None:
            key = b_output_tensor[0] if isinstance(b_output_tensor, list) else b_output_tensor
            ran = forward_of.pop(id(key))
            backward = Task(Kind.B, ran.microbatch, ran.chunk)
        if forward is not None and backward is not None:
            result = on_pair(forward, backward, run) if on_pair is not None else \
                on_task(forward, lambda: on_task(backward, run))
        else:
            result = on_task(forward or backward, run)
        if forward is not None:
            output = result[0]
            forward_of[id(output[0] if isinstance(output, list) else output)] = forward
        return result

    combined_1f1b.combined_forward_backward_step = hooked_combined_step


def weight_tasks(on_task: OnTask) -> Callable[[Task, Callable[[], None]], None]:
    """An ``RRFPConfig.around_task`` passing RRFP's W through ``on_task`` (its F and B reach
    ``wrap_megatron_tasks``'s wrapper inside megatron-core)."""

    def around_task(task: Task, run: Callable[[], None]) -> None:
        if task.kind is Kind.W:
            on_task(task, run)
        else:
            run()

    return around_task


def sleep_before_tasks(delay: Callable[[Task], float]) -> Callable[[Task, Callable[[], None]], None]:
    """An ``RRFPConfig.around_task`` that sleeps ``delay(task)`` seconds before each task."""

    def around_task(task: Task, run: Callable[[], None]) -> None:
        time.sleep(max(0.0, delay(task)))
        run()

    return around_task


class InFlightCounter:
    """(microbatch, chunk) forwards run minus backwards run, while ``active``; ``peak``
    since the last ``reset``. Counts F and B only: for schedules without a split backward."""

    def __init__(self) -> None:
        self.active = False
        self.level = self.peak = 0

    def reset(self) -> None:
        self.level = self.peak = 0

    def on_task(self, task: Task, run):
        result = run()
        if self.active and task.kind is not Kind.W:
            self.level += 1 if task.kind is Kind.F else -1
            self.peak = max(self.peak, self.level)
        return result

    def on_pair(self, forward: Task, backward: Task, run):
        """A combined step: its backward's release, then its forward (as the simulator counts a pair)."""
        return self.on_task(forward, lambda: self.on_task(backward, run))


def count_in_flight() -> InFlightCounter:
    """Install a new ``InFlightCounter`` on megatron-core's F and B of this process."""
    counter = InFlightCounter()
    wrap_megatron_tasks(counter.on_task, counter.on_pair)
    return counter


class HeldMessages:
    """An ``RRFPConfig.deliver_message`` holding each message ``delay(message)`` seconds; one thread
    hands held messages over in order of due time. With ``fifo_per_sender`` no message overtakes
    an earlier one from the same sender (a FIFO link, as the transports are), whatever the delays.
    While any is undelivered, a message due at once joins the queue too, behind those due before
    it: put directly, it overtook a message whose time had come but which the thread had not yet
    handed over (a loaded host runs it late), reordering a FIFO link."""

    def __init__(self, delay: Callable[[Any], float], *, fifo_per_sender: bool = False) -> None:
        self.delay, self.fifo_per_sender = delay, fifo_per_sender
        self._cv = threading.Condition()
        self._heap: list = []
        self._undelivered = 0  # held, or popped and not yet put
        self._last_due: dict = {}  # (inbox, sender) -> due time of its last held message: FIFO per link
        self._seq = itertools.count()
        self._thread: Optional[threading.Thread] = None

    def __call__(self, message, put: Callable[[Any], None]) -> None:
        seconds = self.delay(message)
        with self._cv:
            direct = seconds <= 0 and not self._undelivered
            if not direct:
                self._undelivered += 1
                due = time.monotonic() + max(0.0, seconds)
                if self.fifo_per_sender:  # never before the link's previous message, whatever the delays
                    link = (id(getattr(put, "__self__", put)), getattr(message, "src", None))
                    due = self._last_due[link] = max(due, self._last_due.get(link, 0.0))
                heapq.heappush(self._heap, (due, next(self._seq), put, message))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, daemon=True, name="rrfp-bench-delivery")
                    self._thread.start()
                self._cv.notify()
        if direct:
            put(message)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cv.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                _, _, put, message = heapq.heappop(self._heap)
            put(message)
            with self._cv:
                self._undelivered -= 1


def count_received(meter) -> None:
    """From now on, Megatron's received tensors are held by ``meter`` (a
    ``runtime.memory.ActivationMeter``) until freed; None stops. Installs itself on first use."""
    from megatron.core.pipeline_parallel import p2p_communication

    if not _received_meter:
        communicate = p2p_communication.P2PCommunicator._communicate

        @functools.wraps(communicate)
        def counted_communicate(self_, *args, **kwargs):
            result = communicate(self_, *args, **kwargs)
            if _received_meter[0] is not None:
                for tensor in result[:2]:
                    if tensor is not None:
                        _received_meter[0].hold_until_freed(tensor)
            return result

        p2p_communication.P2PCommunicator._communicate = counted_communicate
        _received_meter.append(None)
    _received_meter[0] = meter


_received_meter: list = []  # [the meter counting Megatron's receives, or None] once installed


__all__ = ["HeldMessages", "InFlightCounter", "count_in_flight", "count_received", "sleep_before_tasks",
           "weight_tasks", "wrap_megatron_tasks"]
