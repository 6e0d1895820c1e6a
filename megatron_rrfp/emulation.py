"""Emulated device time and message latency, applied identically to every schedule.

A 2-core CPU machine cannot run PP=8 of real GPU-sized work, but it can *sleep*: each
task sleeps for its modeled duration (from ``simulator.sample_realization``, the same
draw the simulator uses) on top of the real, small compute of the tiny model. Sleeping
ranks use no CPU, so eight of them share two cores without disturbing each other.

Hooks sit where *both* Megatron-core's own schedules and RRFP pass:
* ``schedules.forward_step`` / ``schedules.backward_step`` (module attributes, looked up at
  call time by Megatron's schedules and by ``adapter``): sleep F / B of (stage, microbatch);
* message latency — a message becomes usable at (its send time + modeled latency):
  Megatron's receives wait inside ``P2PCommunicator._communicate``; RRFP's transport holds
  the message back through its ``delay_fn``. Send times go through a small table in shared
  memory (one machine), written by the sender right after the task that produced it.
"""
from __future__ import annotations

import functools
import os
import time
from typing import Optional

import numpy as np

from .actions import Kind, Task
from .simulator import Realization
from .trace import Span

_F, _B = 0, 1


class SendTimeTable:
    """[stage, direction, microbatch] -> send time (time.time()), shared by local ranks."""

    def __init__(self, path: str, num_stages: int, num_microbatches: int, *, create: bool) -> None:
        shape = (num_stages, 2, num_microbatches)
        if create:
            np.lib.format.open_memmap(path, mode="w+", dtype=np.float64, shape=shape)[:] = np.nan
        self.path = path
        self.table = np.lib.format.open_memmap(path, mode="r+")
        if self.table.shape != shape:
            raise ValueError(f"send-time table {path} has shape {self.table.shape}, expected {shape}")


class DeviceTimeEmulator:
    """Install once per process; call ``begin_iteration`` with each iteration's draw."""

    def __init__(self, *, stage: int, num_stages: int, table: Optional[SendTimeTable],
                 split_backward: bool = False) -> None:
        self.stage, self.num_stages, self.table, self.split_backward = stage, num_stages, table, split_backward
        self.realization: Optional[Realization] = None
        self.spans: list[Span] = []
        self.rank = 0
        self._t0 = 0.0
        self._output_microbatch: dict[int, int] = {}
        self._received = [0, 0]  # activations, gradients received this iteration (Megatron path)
        self._link_clear = [0.0, 0.0]  # per direction: links are FIFO, like the simulator's
        self._installed = False

    # -- set-up ----------------------------------------------------------------------

    def install(self) -> "DeviceTimeEmulator":
        import torch.distributed as dist
        from megatron.core.pipeline_parallel import p2p_communication, schedules

        if self._installed:
            return self
        self.rank = dist.get_rank()
        forward_step, backward_step = schedules.forward_step, schedules.backward_step
        communicate = p2p_communication.P2PCommunicator._communicate
        emulator = self

        @functools.wraps(forward_step)  # adapter reads the real signature through __wrapped__
        def emulated_forward_step(*args, **kwargs):
            mb = kwargs.get("current_microbatch")
            start = time.time()
            emulator._sleep(Task(Kind.F, mb))
            output, num_tokens = forward_step(*args, **kwargs)
            end = time.time()
            first = output[0] if isinstance(output, list) else output
            emulator._output_microbatch[id(first)] = mb
            emulator._sent(_F, mb, end)
            emulator._span(Task(Kind.F, mb), start, end)
            return output, num_tokens

        @functools.wraps(backward_step)
        def emulated_backward_step(input_tensor, output_tensor, *args, **kwargs):
            first = output_tensor[0] if isinstance(output_tensor, list) else output_tensor
            mb = emulator._output_microbatch.pop(id(first))
            start = time.time()
            emulator._sleep(Task(Kind.B, mb))
            grads = backward_step(input_tensor, output_tensor, *args, **kwargs)
            end = time.time()
            emulator._sent(_B, mb, end)
            emulator._span(Task(Kind.B, mb), start, end)
            return grads

        @functools.wraps(communicate)
        def emulated_communicate(self_, *args, **kwargs):
            recv_prev, recv_next = kwargs.get("recv_prev", False), kwargs.get("recv_next", False)
            result = communicate(self_, *args, **kwargs)
            # Megatron receives in microbatch order (1F1B): the k-th receive is microbatch k
            if recv_prev:
                emulator._await_latency(_F, emulator.stage - 1, emulator._received[0])
                emulator._received[0] += 1
            if recv_next:
                emulator._await_latency(_B, emulator.stage + 1, emulator._received[1])
                emulator._received[1] += 1
            return result

        from . import wgrad

        run_weight = wgrad.WeightGradStore.run

        @functools.wraps(run_weight)
        def emulated_weight(store, key):  # W of a split backward (BFW): the other half of B's time
            start = time.time()
            emulator._sleep(Task(Kind.W, key[0], key[1]))
            run_weight(store, key)
            emulator._span(Task(Kind.W, key[0], key[1]), start, time.time())

        wgrad.WeightGradStore.run = emulated_weight
        schedules.forward_step = emulated_forward_step
        schedules.backward_step = emulated_backward_step
        p2p_communication.P2PCommunicator._communicate = emulated_communicate
        self._installed = True
        return self

    def begin_iteration(self, realization: Realization) -> None:
        self.realization = realization
        self.spans = []
        self._received = [0, 0]
        self._link_clear = [0.0, 0.0]
        self._output_microbatch.clear()
        self._t0 = time.time()

    # -- RRFP's transport hook -------------------------------------------------------

    def message_delay(self, message) -> float:
        """Seconds the transport holds ``message`` back: until send time + latency."""
        direction = _F if message.kind == "activation" else _B
        src_stage = self.stage - 1 if direction == _F else self.stage + 1
        return max(0.0, self._usable_at(direction, src_stage, message.microbatch) - time.time())

    # -- internals -------------------------------------------------------------------

    def _sleep(self, task: Task) -> None:
        if self.realization is not None:
            time.sleep(self.realization.duration(self.stage, task, self.split_backward))

    def _sent(self, direction: int, mb: int, when: float) -> None:
        if self.table is not None:
            self.table.table[self.stage, direction, mb] = when

    def _usable_at(self, direction: int, src_stage: int, mb: int) -> float:
        if self.table is None or self.realization is None:
            return 0.0
        sent = float(self.table.table[src_stage, direction, mb])
        if sent != sent:  # NaN: not recorded
            return 0.0
        latencies = self.realization.activation_latency if direction == _F else self.realization.gradient_latency
        # messages arrive in the order sent (FIFO link): never before the previous one
        usable = max(sent + latencies[src_stage][0][mb], self._link_clear[direction])
        self._link_clear[direction] = usable
        return usable

    def _await_latency(self, direction: int, src_stage: int, mb: int) -> None:
        delay = self._usable_at(direction, src_stage, mb) - time.time()
        if delay > 0:
            time.sleep(delay)

    def _span(self, task: Task, start: float, end: float) -> None:
        self.spans.append(Span(self.rank, str(task), task.kind.value, start - self._t0, end - self._t0))


def shared_table_path(tag: str) -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")
    return os.path.join(base, f"rrfp-sendtimes-{tag}.npy")
