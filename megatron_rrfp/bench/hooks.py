"""Wrapping the runtime from outside: task and message hooks for benchmarks and tests.

Nothing here is part of the shipped runtime. Each installer patches one process:

* ``wrap_tasks(on_task)`` — every F / B / W that megatron-core's own schedules *or* RRFP
  run goes through ``on_task(task, run)``: megatron-core's ``schedules.forward_step`` /
  ``backward_step`` (module attributes, looked up at call time by its schedules and by
  ``mcore.compat``) and the W of a split backward (``MegatronStageWork.weight``, the
  executor's W task). The emulator sleeps the modeled device time there; tests inject
  random delays or a hang.
* ``delay_tasks(delay)`` — sleep ``delay(task)`` seconds before each task (on top of
  ``wrap_tasks``): drifting stages, a hung rank.
* ``delay_messages(delay, fifo_per_sender=...)`` — every message the executor's inbox receives
  is held back ``delay(message)`` seconds: emulated link latency (the emulator asks for FIFO
  links: no message overtakes an earlier one from its sender).
* ``count_in_flight()`` — a counter of forwards whose backward has not run, fed by
  ``wrap_tasks``: the peak in flight of Megatron's own schedules, measured like RRFP's.
* ``count_received(meter)`` — every tensor Megatron's own schedules receive
  (``P2PCommunicator._communicate``) is counted by ``meter`` until its last reference goes, as
  RRFP's meter counts the messages waiting in its executor: both schedules' receive buffers.
* ``force_whole_stage_agreement()`` — the whole-stage agreement on CPU too (its cost, measured).
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


def wrap_tasks(on_task: OnTask) -> None:
    """Route every task of this process through ``on_task(task, run)``; ``run()`` computes it."""
    from megatron.core.pipeline_parallel import schedules

    from ..mcore.stage_work import MegatronStageWork

    # W is hooked where the executor runs it (not at the store: the split's own self-check
    # runs the store once when it installs, and that is no task of the schedule)
    forward_step, backward_step, run_weight = schedules.forward_step, schedules.backward_step, \
        MegatronStageWork.weight
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

    @functools.wraps(run_weight)
    def hooked_weight(work, task: Task):
        return on_task(task, lambda: run_weight(work, task))

    schedules.forward_step, schedules.backward_step = hooked_forward_step, hooked_backward_step
    MegatronStageWork.weight = hooked_weight


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


def count_in_flight() -> InFlightCounter:
    """Install a new ``InFlightCounter`` on every task of this process (``wrap_tasks``)."""
    counter = InFlightCounter()
    wrap_tasks(counter.on_task)
    return counter


_task_delay: list = []  # [current delay function or None] once installed


def delay_tasks(delay: Optional[Callable[[Task], float]]) -> None:
    """From now on, sleep ``delay(task)`` seconds before each task of this process
    (None: no delay). Installs its ``wrap_tasks`` hook on first use."""
    if not _task_delay:
        def on_task(task: Task, run):
            if _task_delay[0] is not None:
                time.sleep(max(0.0, _task_delay[0](task)))
            return run()

        wrap_tasks(on_task)
        _task_delay.append(None)
    _task_delay[0] = delay


class _Delivery:
    """One thread delivering held-back messages to their inbox in order of due time. While any
    is undelivered, a message due at once joins the queue too, behind those due before it:
    put directly, it overtook a message whose time had come but which the thread had not yet
    handed over (a loaded host runs it late), reordering a FIFO link."""

    def __init__(self, put: Callable) -> None:
        self.put = put
        self.delay: Optional[Callable[[Any], float]] = None
        self._cv = threading.Condition()
        self._heap: list = []
        self._undelivered = 0  # held, or popped and not yet put
        self.fifo_per_sender = False
        self._last_due: dict = {}  # (inbox, sender) -> due time of its last held message: FIFO per link
        self._seq = itertools.count()
        threading.Thread(target=self._loop, daemon=True, name="rrfp-bench-delivery").start()

    def deliver(self, inbox, message, seconds: float) -> None:
        with self._cv:
            if seconds <= 0 and not self._undelivered:
                direct = True
            else:
                direct = False
                self._undelivered += 1
                due = time.monotonic() + max(0.0, seconds)
                if self.fifo_per_sender:  # never before the link's previous message, whatever the delays
                    link = (id(inbox), getattr(message, "src", None))
                    due = self._last_due[link] = max(due, self._last_due.get(link, 0.0))
                heapq.heappush(self._heap, (due, next(self._seq), inbox, message))
                self._cv.notify()
        if direct:
            self.put(inbox, message)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cv.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                _, _, inbox, message = heapq.heappop(self._heap)
            self.put(inbox, message)
            with self._cv:
                self._undelivered -= 1


_delivery: Optional[_Delivery] = None


def delay_messages(delay: Optional[Callable[[Any], float]], *, fifo_per_sender: bool = False) -> None:
    """From now on, hold each message back ``delay(message)`` seconds before the executor
    sees it (None: deliver at once again); with ``fifo_per_sender`` no message overtakes an
    earlier one from the same sender (a FIFO link, as the transports are), whatever the
    delays. Process-wide; installs itself on first use."""
    global _delivery
    from ..runtime.inbox import Inbox

    if _delivery is None:
        _delivery = _Delivery(Inbox.put)
        delivery = _delivery

        @functools.wraps(Inbox.put)
        def put(inbox, message) -> None:
            delivery.deliver(inbox, message, 0.0 if delivery.delay is None else delivery.delay(message))

        Inbox.put = put
    _delivery.delay, _delivery.fifo_per_sender = delay, fifo_per_sender


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


def force_whole_stage_agreement() -> None:
    """From now on this process's RRFP calls apply the whole-stage agreement (lock-step) wherever
    CUDA could (interleaving, DP > 1, an overlap flag: ``mcore/dp_overlap.py``), on any device
    and at any depth: its host-side cost, measured on CPU. Patches the name ``mcore.schedule`` calls."""
    from ..mcore import dp_overlap, schedule

    def lockstep_on_any_device(models, *, device_type: str, choice: str = "auto", **kwargs) -> str:
        return dp_overlap.dp_communication(models, device_type="cuda", choice=dp_overlap.LOCKSTEP, **kwargs)

    schedule.dp_communication = lockstep_on_any_device


__all__ = ["InFlightCounter", "count_in_flight", "count_received", "delay_messages", "delay_tasks",
           "force_whole_stage_agreement", "wrap_tasks"]
