"""Emulated device time and message latency, applied identically to every schedule.

A 2-core CPU machine cannot run PP=8 of real GPU-sized work, but it can *sleep*: each
task sleeps for its modeled duration (from ``simulator.sample_realization``, the same
draw the simulator uses) on top of the real, small compute of the tiny model. Sleeping
ranks use no CPU, so eight of them share two cores without disturbing each other.
On CUDA (``bench --device cuda``) the modeled time is a sleep kernel on the rank's compute
stream ahead of the task's real kernels, and the task ends when the stream has drained (a
sync point), so spans and send times are the device's, for every schedule alike.

Hooks sit where *both* Megatron-core's own schedules and RRFP pass (``around_schedules.py``):
* every task: sleep F / B / W of (stage, chunk, microbatch) — F and B inside megatron-core's
  ``forward_step`` / ``backward_step`` (``wrap_megatron_tasks``), RRFP's W through
  ``RRFPConfig.around_task`` (``rrfp_options``);
* a combined step holding a forward and a backward (``--overlap-moe-expert-parallel-comm``:
  Megatron's combined 1F1B and RRFP's pairs alike) takes what the simulator gives a pair
  (``Realization.pair_duration``): max(compute F + compute B, all-to-all F + all-to-all B), the
  all-to-alls being the draw's and those ``--a2a-ms`` emulates inside the step (B without its W
  where the pair's backward defers it);
* message latency — a message becomes usable at (its send time + modeled latency):
  Megatron's receives wait inside ``P2PCommunicator._communicate``; RRFP's inbox is handed the
  message then (``RRFPConfig.deliver_message``: ``around_schedules.HeldMessages``). Send times go
  through a small table in shared memory (one machine), written by the sender right after the
  task that produced it.
"""
from __future__ import annotations

import functools
import os
import re
import time
from typing import Optional

import numpy as np

from ..policy.actions import Kind, Task
from ..policy.hints import megatron_1f1b_order
from ..policy.topology import Topology
from ..sim.variability import Realization
from ..trace.chrome import Span
from .around_schedules import HeldMessages, weight_tasks, wrap_megatron_tasks

_F, _B = 0, 1


class SendTimeTable:
    """[stage, chunk, direction, microbatch] -> send time (time.time()) of one DP replica's
    pipeline, shared by local ranks (one slice per replica: each pipeline its own messages)."""

    def __init__(self, path: str, num_stages: int, num_chunks: int, num_microbatches: int, *,
                 create: bool, replicas: int = 1, replica: int = 0) -> None:
        shape = (replicas, num_stages, num_chunks, 2, num_microbatches)
        if create:
            np.lib.format.open_memmap(path, mode="w+", dtype=np.float64, shape=shape)[:] = np.nan
        self.path = path
        whole = np.lib.format.open_memmap(path, mode="r+")
        if whole.shape != shape:
            raise ValueError(f"send-time table {path} has shape {whole.shape}, expected {shape}")
        self.table = whole[replica]


def draw_seed(seed: int, iteration: int, replica: int = 0) -> int:
    """The seed of one iteration's draw for one DP replica: replicas draw apart, as pipelines on
    separate devices jitter apart (replica 0 keeps the single pipeline's draw)."""
    return seed * 100_003 + iteration + 1_000_003 * replica


class TaskTally:
    """Where one rank's task time went in one iteration, per kind (F / B / W), as the hook
    around megatron-core's task functions sees it — the same for Megatron's schedules and
    RRFP's executor: ``device`` the modeled (emulated) device time, ``overrun`` how much longer
    the sleep took than modeled (the OS waking the rank late: host noise), ``host`` the wall
    time of the real computation (megatron-core's code, incl. its TP / EP collectives) and
    ``host_cpu`` the CPU time this thread spent in it (what preemption by other processes
    does not inflate)."""

    FIELDS = ("count", "device", "overrun", "host", "host_cpu")

    def __init__(self) -> None:
        self.by_kind: dict[str, list[float]] = {}

    def add(self, kind: Kind, device: float, overrun: float, host: float, host_cpu: float) -> None:
        row = self.by_kind.setdefault(kind.value, [0.0] * len(self.FIELDS))
        for i, value in enumerate((1.0, device, overrun, host, host_cpu)):
            row[i] += value

    def as_dict(self) -> dict[str, dict[str, float]]:
        """{kind: {count, device, overrun, host, host_cpu}} (seconds; count of tasks)."""
        return {kind: dict(zip(self.FIELDS, row)) for kind, row in sorted(self.by_kind.items())}


class DeviceTimeEmulator:
    """Install once per process; call ``begin_iteration`` with each iteration's draw."""

    def __init__(self, *, stage: int, topology: Topology, num_microbatches: int, table: Optional[SendTimeTable],
                 split_backward: bool = False, device=None) -> None:
        self.stage, self.topology, self.table, self.split_backward = stage, topology, table, split_backward
        self._device_sleep = DeviceSleep(device) if device is not None and device.type == "cuda" else None
        # Megatron receives in its own schedule's order: the k-th forward (backward) receive
        # feeds the k-th forward (backward) of megatron_1f1b_order that has a sender.
        order = megatron_1f1b_order(stage, topology, num_microbatches)
        self._receive_order = (
            [t for t in order if t.kind is Kind.F and topology.upstream(stage, t.chunk) is not None],
            [t for t in order if t.kind is Kind.B and topology.downstream(stage, t.chunk) is not None])
        self.realization: Optional[Realization] = None
        self.spans: list[Span] = []
        self.tally = TaskTally()
        self._unsplit: set[tuple[int, int]] = set()
        self.rank = 0
        self._t0 = 0.0
        self._received = [0, 0]  # activations, gradients received this iteration (Megatron path)
        # per sending stage: a link is FIFO across both directions (at PP=2 interleaved one peer sends
        # activations and gradients), as the host transport is; replicas following one link rely on it
        self._link_clear: dict[int, float] = {}
        self._installed = False
        self.comm = None  # comm_emulation.CommEmulator when DP / expert communication is emulated
        self._around_weight = weight_tasks(self._run_task)  # RRFP's W: its own task, not megatron-core's
        self._held = HeldMessages(self.held_for, fifo_per_sender=True)
        self._hold_rrfp_messages = False

    # -- set-up ----------------------------------------------------------------------

    def install(self) -> DeviceTimeEmulator:
        import torch.distributed as dist
        from megatron.core.pipeline_parallel import p2p_communication

        if self._installed:
            return self
        self.rank = dist.get_rank()
        wrap_megatron_tasks(self._run_task, self._run_pair)
        communicate = p2p_communication.P2PCommunicator._communicate
        emulator = self

        @functools.wraps(communicate)
        def emulated_communicate(self_, *args, **kwargs):
            recv_prev, recv_next = kwargs.get("recv_prev", False), kwargs.get("recv_next", False)
            result = communicate(self_, *args, **kwargs)
            for direction, wanted in ((_F, recv_prev), (_B, recv_next)):
                if wanted:
                    task = emulator._receive_order[direction][emulator._received[direction]]
                    emulator._received[direction] += 1
                    delay = emulator._usable_at(direction, task) - time.time()
                    if delay > 0:
                        time.sleep(delay)
            return result

        p2p_communication.P2PCommunicator._communicate = emulated_communicate
        self._installed = True
        return self

    def delay_rrfp_messages(self, enabled: bool) -> None:
        """Hold RRFP's received messages until their modeled arrival (on) or not (off), from the
        next ``rrfp_options()`` on."""
        self._hold_rrfp_messages = enabled

    def rrfp_options(self) -> dict:
        """``RRFPConfig`` keywords that put RRFP's W and its received messages under the emulation."""
        return {"around_task": self._around_weight,
                "deliver_message": self._held if self._hold_rrfp_messages else None}

    def _run_task(self, task: Task, run):
        """Sleep the task's modeled device time, compute it, note when its output left."""
        start = time.time()
        # device-side waits, counted as device time: a chunk's first forward on its all-gathered
        # parameters, and the all-to-alls slept inside the task (comm_emulation.py)
        waited = self.comm.before_task(task) if self.comm is not None else 0.0
        modeled = self._sleep(task)
        slept = time.time()
        cpu = time.thread_time()
        result = run()
        if self._device_sleep is not None:
            self._device_sleep.drain()
        end = time.time()
        inside = self.comm.take_task_device() if self.comm is not None else 0.0
        self.tally.add(task.kind, modeled + waited + inside, slept - start - modeled - waited, end - slept - inside,
                       time.thread_time() - cpu)
        if task.kind is not Kind.W:
            self._sent(_F if task.kind is Kind.F else _B, task, end)
        self._span(task, start, end)
        return result

    def _run_pair(self, forward: Task, backward: Task, run):
        """A combined step of ``forward`` and ``backward``: sleep their compute, run them with the
        emulated all-to-alls counted rather than slept, then sleep what the all-to-alls take beyond
        the compute (each half's all-to-alls hidden behind the other's compute)."""
        start = time.time()
        waited = self.comm.before_task(forward) if self.comm is not None else 0.0
        compute, drawn_comm, forward_share = self._pair_parts(forward, backward)
        self._device_seconds(compute)
        slept = time.time()
        cpu = time.thread_time()
        if self.comm is not None:
            self.comm.counting_all_to_alls = True
        try:
            result = run()
        finally:
            if self.comm is not None:
                self.comm.counting_all_to_alls = False
        all_to_all = drawn_comm + (self.comm.take_task_device() if self.comm is not None else 0.0)
        beyond = max(0.0, all_to_all - compute)
        before_rest = time.time()
        self._device_seconds(beyond)
        if self._device_sleep is not None:
            self._device_sleep.drain()
        end = time.time()
        device, host, host_cpu = max(compute, all_to_all) + waited, before_rest - slept, time.thread_time() - cpu
        overrun = slept - start - compute - waited
        self.tally.add(Kind.F, device * forward_share, overrun, host * forward_share, host_cpu * forward_share)
        self.tally.add(Kind.B, device * (1 - forward_share), 0.0, host * (1 - forward_share),
                       host_cpu * (1 - forward_share))
        self._sent(_F, forward, end)
        self._sent(_B, backward, end)
        # the runtime's category for a pair (runtime/executor.py): one span, counted busy once
        self.spans.append(Span(self.rank, f"{forward}+{backward}", "F+B", start - self._t0, end - self._t0))
        return result

    def _pair_parts(self, forward: Task, backward: Task) -> tuple[float, float, float]:
        """(compute of both halves, their drawn all-to-all time, the forward's share of the two)."""
        if self.realization is None:
            return 0.0, 0.0, 0.5
        r = self.realization
        split = self.split_backward and self._deferred(backward)  # inside the step's deferral, as a lone B
        f, b = r.duration(self.stage, forward, False), r.duration(self.stage, backward, split)
        compute, comm = r.pair_parts(self.stage, forward, backward, split)  # the simulator's own split
        return compute, comm, f / (f + b) if f + b > 0 else 0.5

    def _device_seconds(self, seconds: float) -> None:
        if self._device_sleep is not None:
            self._device_sleep.sleep(seconds)
        elif seconds > 0:
            time.sleep(seconds)

    def begin_iteration(self, realization: Realization) -> None:
        self.realization = realization
        self.spans = []
        self.tally = TaskTally()
        self._unsplit: set[tuple[int, int]] = set()
        self._received = [0, 0]
        self._link_clear = {}
        self._t0 = time.time()

    # -- RRFP's inbox hook -----------------------------------------------------------

    def held_for(self, message) -> float:
        """Seconds ``message`` is held back before RRFP's loop sees it: until send time + latency."""
        direction = _F if message.kind == "activation" else _B
        task = Task(Kind.F if direction == _F else Kind.B, message.microbatch, message.chunk)
        return max(0.0, self._usable_at(direction, task) - time.time())

    # -- internals -------------------------------------------------------------------

    def _sleep(self, task: Task) -> float:
        """Sleep the modeled device time of ``task``; returns it (0 without a draw)."""
        if self.realization is None:
            return 0.0
        seconds = self.realization.duration(self.stage, task, self.split_backward)
        if self.split_backward and not self._deferred(task):  # the byte budget ran its B unsplit
            seconds = 0.0 if task.kind is Kind.W else self.realization.duration(self.stage, task, False)
        self._device_seconds(seconds)
        return seconds

    def _deferred(self, task: Task) -> bool:
        """A split B defers inside the store's ``deferring``; an unsplit one (policy/membytes.py) does not."""
        if task.kind is Kind.F:
            return True
        key = (task.microbatch, task.chunk)
        if task.kind is Kind.W:
            return key not in self._unsplit
        from ..split import store as wgrad_store

        if wgrad_store._active is None:
            self._unsplit.add(key)
            return False
        return True

    def _sent(self, direction: int, task: Task, when: float) -> None:
        if self.table is not None:
            self.table.table[self.stage, task.chunk, direction, task.microbatch] = when

    def _usable_at(self, direction: int, receiver: Task) -> float:
        """When the input of ``receiver`` (this stage's task) may be used: its sender's
        send time + that message's latency, and never before the previous message."""
        if self.table is None or self.realization is None:
            return 0.0
        locate = self.topology.upstream if direction == _F else self.topology.downstream
        src_stage, src_chunk = locate(self.stage, receiver.chunk)
        mb = receiver.microbatch
        sent = float(self.table.table[src_stage, src_chunk, direction, mb])
        if sent != sent:  # NaN: the message outran its sender's record (written after the task):
            return self._link_clear.get(src_stage, 0.0)  # it must still not overtake an earlier one (FIFO link)
        latencies = self.realization.activation_latency if direction == _F else self.realization.gradient_latency
        # one sender per link: messages arrive in the order sent (FIFO link)
        usable = max(sent + latencies[src_stage][src_chunk][mb], self._link_clear.get(src_stage, 0.0))
        self._link_clear[src_stage] = usable
        return usable

    def _span(self, task: Task, start: float, end: float) -> None:
        self.spans.append(Span(self.rank, str(task), task.kind.value, start - self._t0, end - self._t0))


class DeviceSleep:
    """Modeled device time as a sleep kernel (``torch.cuda._sleep``, which spins for a number of
    GPU clock cycles) on the current stream; the cycles per second are measured once with CUDA
    events, since the clock under load is not the nominal one."""

    CALIBRATION_CYCLES = 50_000_000

    def __init__(self, device) -> None:
        import torch

        self._torch, self.device = torch, device
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # the first launch pays the module's load
        start.record()
        torch.cuda._sleep(self.CALIBRATION_CYCLES)
        end.record()
        end.synchronize()
        self.cycles_per_s = self.CALIBRATION_CYCLES / (start.elapsed_time(end) / 1e3)

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self._torch.cuda._sleep(int(seconds * self.cycles_per_s))

    def drain(self) -> None:
        self._torch.cuda.current_stream(self.device).synchronize()


def shared_table_path(tag: str) -> str:
    """The table of one local benchmark run; ``tag`` starts with the parent's pid."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")
    return os.path.join(base, f"rrfp-sendtimes-{tag}.npy")


def remove_stale_tables() -> list[str]:
    """Remove tables left by benchmark processes that no longer exist (killed by SIGKILL or
    the OOM killer, where no clean-up runs); returns their paths."""
    base = os.path.dirname(shared_table_path("x"))
    removed = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        match = re.fullmatch(r"rrfp-sendtimes-(\d+)-\d+\.npy", name)
        if match is None or _alive(int(match.group(1))):
            continue
        try:
            os.remove(os.path.join(base, name))
            removed.append(os.path.join(base, name))
        except OSError:
            pass  # another user's, or already gone
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process (or a number no pid can be): leave its file alone
    return True
