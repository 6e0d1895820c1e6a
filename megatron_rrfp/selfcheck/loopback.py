"""The self-check's one-GPU pipeline, two stages as two threads of one process on one GPU,
and its two steps: ``loopback`` (values exact under random kernel times) and ``stage-memory``
(a stage's peak under RRFP against 1F1B at the same in-flight bound).

``CudaLoopbackDevice`` is a ``rounds.Device`` whose rounds are CUDA copies between the two
threads' streams (after both producers' events), so the shipped executor and
``RoundTransport`` run with real CUDA streams, events, caching-allocator buffers and host
pacing — everything of the NCCL path except NCCL itself (``nccl-stress`` in ``stress.py`` runs NCCL).
"""
from __future__ import annotations

import random
import threading
import time

from .result import Result


class _LoopbackRound:
    def __init__(self) -> None:
        self.sides: dict = {}
        self.done_event = None
        self.cv = threading.Condition()


class CudaLoopbackDevice:
    """``rounds.Device`` for two ranks (threads) of one process on one GPU: the second side
    of a round to arrive enqueues the copies on a copy stream after both producers' events."""

    def __init__(self, rank: int, rounds: dict, lock: threading.Lock, copy_stream) -> None:
        self.rank, self._rounds, self._lock, self._copy = rank, rounds, lock, copy_stream
        self._count: dict = {}

    def empty(self, shape, dtype):
        import torch

        return torch.empty(shape, dtype=dtype, device="cuda")  # on this thread's (compute) stream

    def exchange(self, peer, sends, recvs):
        import torch

        index = self._count.get(peer, 0)
        self._count[peer] = index + 1
        key = (min(self.rank, peer), max(self.rank, peer), index)
        ready = torch.cuda.Event()
        ready.record()
        with self._lock:
            pending = self._rounds.setdefault(key, _LoopbackRound())
        with pending.cv:
            pending.sides[self.rank] = (list(sends), list(recvs), ready)
            if len(pending.sides) == 2:
                (a_send, a_recv, a_ready), (b_send, b_recv, b_ready) = pending.sides.values()
                with torch.cuda.stream(self._copy):
                    self._copy.wait_event(a_ready)
                    self._copy.wait_event(b_ready)
                    for source, target in list(zip(a_send, b_recv)) + list(zip(b_send, a_recv)):
                        target.copy_(source)
                        source.record_stream(self._copy)
                        target.record_stream(self._copy)
                    pending.done_event = torch.cuda.Event()
                    pending.done_event.record(self._copy)
                pending.cv.notify_all()
                with self._lock:
                    del self._rounds[key]
        return _LoopbackCompletion(pending)

    def mark(self):
        import torch

        from ..runtime.device import EventCompletion

        event = torch.cuda.Event()
        event.record()
        return EventCompletion(event)


class _LoopbackCompletion:
    def __init__(self, pending: _LoopbackRound) -> None:
        self.pending = pending

    def _event(self, timeout=None):
        with self.pending.cv:
            self.pending.cv.wait_for(lambda: self.pending.done_event is not None, timeout)
            return self.pending.done_event

    def done(self) -> bool:
        event = self.pending.done_event
        return event is not None and event.query()

    def wait(self) -> None:
        import torch

        torch.cuda.current_stream().wait_event(self._event())  # the host waits for the peer's side first

    def synchronize(self, timeout: float) -> bool:
        event = self._event(timeout)
        if event is None:
            return False
        event.synchronize()
        return True


# --------------------------------------------------------------------------- token work

class TokenWork:
    """``StageWork``: F adds 1, the last stage's B starts at 10x its output, earlier B's add 1;
    random kernel (CUDA) or host (CPU) times; message shapes vary with the microbatch. With
    ``tp_group`` each F and B all-reduces its result over the stage's TP ranks and divides
    by their number (exact for a power of two): TP ranks that ran different tasks here mix
    different microbatches' values, which ``check_finals`` sees."""

    def __init__(self, topology, stage: int, finals: dict, rng: random.Random, max_sleep_cycles: int,
                 device="cuda", tp_group=None) -> None:
        import torch

        self.topology, self.stage, self.finals, self.rng = topology, stage, finals, rng
        self.max_sleep_cycles, self.device, self.tp_group = max_sleep_cycles, torch.device(device), tp_group
        self.saved: dict = {}

    def _busy(self) -> None:
        import torch

        if self.device.type == "cuda" and self.max_sleep_cycles:
            torch.cuda._sleep(self.rng.randrange(self.max_sleep_cycles))
        elif self.max_sleep_cycles:
            time.sleep(self.rng.random() * self.max_sleep_cycles / 1e9)  # ~ the cycles of a GHz device
        if self.rng.random() < 0.2:
            time.sleep(self.rng.random() * 0.002)  # the host falls behind now and then

    def _tensor_parallel(self, value):
        if self.tp_group is None:
            return value
        import torch.distributed as dist

        total = value.clone()
        dist.all_reduce(total, group=self.tp_group)  # inside the task, as a TP layer's would be
        return total / dist.get_world_size(self.tp_group)

    def forward(self, task, input_tensor, send) -> None:
        import torch

        self._busy()
        shape = (2 + task.microbatch % 3, 4)
        base = torch.full(shape, float(task.microbatch), device=self.device) if input_tensor is None else input_tensor
        out = self._tensor_parallel(base + 1)
        self.saved[(task.microbatch, task.chunk)] = out
        if send is not None:
            send(out)

    def backward(self, task, output_grad, send) -> None:
        self._busy()
        out = self.saved.pop((task.microbatch, task.chunk))
        grad = self._tensor_parallel(out * 10 if self.topology.is_last(self.stage, task.chunk) else output_grad + 1)
        if self.topology.is_first(self.stage, task.chunk):
            self.finals[task.microbatch] = grad
        if send is not None:
            send(grad)

    def weight(self, task) -> None:
        self._busy()


def check_finals(finals: dict, topology, microbatches: int) -> str:
    v = topology.num_virtual_stages
    bad = {mb: float(t.flatten()[0]) for mb, t in finals.items()
           if not bool((t == 10 * (mb + v) + v - 1).all())}
    if bad or len(finals) != microbatches:
        return f"wrong gradients at stage 0: {bad or sorted(finals)} (expected 10 * (mb + {v}) + {v - 1})"
    return ""


def loopback_pipeline(*, chunks: int, hint: str, buffer_limit: int, microbatches: int, iterations: int,
                       work_factory, seed: int, timeout_s: float) -> tuple[list, dict]:
    """Two stages as two threads on this GPU; returns (errors, per-stage results of work_factory)."""
    import torch

    from ..policy.arbiter import ArbiterConfig
    from ..policy.plan import Plan
    from ..policy.topology import Topology
    from ..runtime.executor import Inbox, PipelineIteration
    from ..runtime.rounds import RoundTransport
    from .host_channel import ChannelHub, EmulatedChannel

    device = torch.cuda.current_device()
    topology = Topology(2, chunks)
    plan = Plan.build(ArbiterConfig(hint=hint, buffer_limit=buffer_limit), topology, microbatches)
    hub = ChannelHub(max_latency_s=0.002, seed=seed)
    rounds, lock, copy_stream = {}, threading.Lock(), torch.cuda.Stream()
    errors, outputs = [], {}

    def stage_main(stage: int) -> None:
        torch.cuda.set_device(device)
        inbox = Inbox()
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                transport = RoundTransport(
                    rank=stage, stage_of={0: 0, 1: 1}, neighbours=[1 - stage],
                    device=CudaLoopbackDevice(stage, rounds, lock, copy_stream),
                    channel_factory=lambda on_record, on_error: EmulatedChannel(hub, stage, on_record, on_error),
                    on_message=inbox.put, on_error=inbox.fail, wake=inbox.wake, timeout_s=timeout_s)
                work = work_factory(topology, stage, random.Random(seed + stage))
                for _ in range(iterations):
                    PipelineIteration(work=work, arbiter=plan.arbiter(stage), topology=topology, stage=stage,
                                      stage_ranks=[0, 1], transport=transport, inbox=inbox, agreement=None,
                                      timeout_s=timeout_s, forward_only=False).run()
                torch.cuda.current_stream().synchronize()
                outputs[stage] = work
        except BaseException as exc:  # noqa: BLE001 - reported by the step
            errors.append(f"stage {stage}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=stage_main, args=(s,), daemon=True) for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * (iterations + 1))
    hub.stop()
    if any(t.is_alive() for t in threads):
        errors.append("a stage thread did not finish")
    return errors, outputs


class MLPWork:
    """A stage of Linear layers with real autograd, for the memory comparison."""

    def __init__(self, topology, stage: int, rng, hidden: int, layers: int) -> None:
        import torch

        self.topology, self.stage = topology, stage
        gen = torch.Generator().manual_seed(1 + stage)
        self.weights = [(torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5).cuda().requires_grad_()
                        for _ in range(layers)]
        self.hidden, self.saved = hidden, {}
        self.peak = 0

    def forward(self, task, input_tensor, send) -> None:
        import torch

        x = torch.randn(64, self.hidden, device="cuda") if input_tensor is None else input_tensor.requires_grad_()
        y = x
        for w in self.weights:
            y = torch.tanh(y @ w)
        self.saved[(task.microbatch, task.chunk)] = (x, y)
        if send is not None:
            send(y.detach())

    def backward(self, task, output_grad, send) -> None:
        import torch

        x, y = self.saved.pop((task.microbatch, task.chunk))
        if output_grad is None:
            output_grad = torch.ones_like(y)
        torch.autograd.backward(y, output_grad)
        if send is not None and x.grad is not None:
            send(x.grad)

    def weight(self, task) -> None:
        pass


def step_loopback(ctx) -> Result:
    import torch

    from ..policy.topology import Topology

    cases = [(1, "bf", 32), (1, "bfw", 2), (1, "1f1b", 32), (2, "bf", 4)]
    for i, (chunks, hint, limit) in enumerate(cases):
        microbatches = 8
        finals: dict = {}

        def factory(topology, stage, rng, finals=finals):
            return TokenWork(topology, stage, finals if stage == 0 else {}, rng, max_sleep_cycles=2_000_000)

        errors, _ = loopback_pipeline(chunks=chunks, hint=hint, buffer_limit=limit, microbatches=microbatches,
                                       iterations=3, work_factory=factory, seed=ctx["seed"] + i,
                                       timeout_s=ctx["stall_timeout_s"])
        torch.cuda.synchronize()
        problem = "; ".join(errors) or check_finals(finals, Topology(2, chunks), microbatches)
        if problem:
            return Result("loopback", "FAIL", f"chunks={chunks} hint={hint} limit={limit}: {problem}")
    return Result("loopback", "PASS", f"{len(cases)} layouts x 3 iterations, random kernel times, values exact "
                                      "(rounds as CUDA copies: not NCCL's blocking; see nccl-stress)")


def step_stage_memory(ctx) -> Result:
    import torch

    peaks = {}
    for label, hint, limit in (("1f1b", "1f1b", 32), ("rrfp bf, limit=PP", "bf", 2), ("rrfp default", "bf", 32)):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()

        def factory(topology, stage, rng):
            return MLPWork(topology, stage, rng, hidden=1024, layers=4)

        errors, _ = loopback_pipeline(chunks=1, hint=hint, buffer_limit=limit, microbatches=8, iterations=2,
                                       work_factory=factory, seed=ctx["seed"], timeout_s=ctx["stall_timeout_s"])
        torch.cuda.synchronize()
        if errors:
            return Result("stage-memory", "FAIL", f"{label}: {'; '.join(errors)}")
        peaks[label] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    figures = ", ".join(f"{k} {v:.1f} MiB" for k, v in peaks.items())
    ok = peaks["rrfp bf, limit=PP"] <= 1.10 * peaks["1f1b"] + 1.0
    verdict = "within 10% of 1F1B at the same in-flight bound" if ok else "ABOVE 1F1B at the same in-flight bound"
    return Result("stage-memory", "PASS" if ok else "FAIL", f"peak of both stages on one GPU: {figures}: {verdict}")


__all__ = ["CudaLoopbackDevice", "MLPWork", "TokenWork", "check_finals", "loopback_pipeline",
           "step_loopback", "step_stage_memory"]
