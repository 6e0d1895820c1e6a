"""The real executor, TP agreement and transport on single-queue stand-in GPUs (``queue_device``).

``run_emulated(config)`` runs a whole PP x TP job in one process, a thread per rank: each
rank's ``PipelineIteration`` with the shipped ``Arbiter``, ``TPAgreement`` and either

* ``protocol="rounds"``: the shipped ``RoundTransport`` on an ``EmulatedDevice``, or
* ``protocol="early-receive"``: ``EarlyReceiveTransport``, the CUDA path this project had
  before rounds, replayed op by op on the same device: a receiver thread per source that
  posts the next header receive as soon as a message is expected and syncs on it
  (``decode_header(raw.cpu())``), then the payload receive; a sender thread per
  destination that issues header and payload sends and syncs on them; one stream per
  thread — on this device, all one queue;
* ablations of the rounds protocol, each dropping one rule its deadlock-freedom argument
  uses (``runtime/rounds.py``): ``rounds-without-ring-rule`` (stage 0 may have rounds of
  both its pairs in flight) and ``rounds-unagreed`` (each TP rank issues rounds as soon as
  its own records arrive, not at agreed points of the task sequence).

Every task's work is queue ops too (compute, one TP all-reduce, compute), with random
durations, random host jitter and random host-channel latency. Data checks the movement:
a forward adds 1, the last stage's backward starts at 10x its output, every earlier one
adds 1, so microbatch ``mb`` must reach stage 0 as ``10 * (mb + V) + V - 1``.
"""
from __future__ import annotations

import queue
import random
import threading
import time
from dataclasses import dataclass

import torch

from ..policy.actions import Task
from ..policy.arbiter import ArbiterConfig
from ..policy.plan import Plan
from ..policy.topology import Topology
from ..runtime.agreement import TPAgreement
from ..runtime.executor import Inbox, PipelineIteration
from ..runtime.rounds import RoundTransport
from ..runtime.transport import HEADER_LEN, Message, SelfDelivering, decode_header, encode_header, payload_bytes
from .queue_device import ChannelHub, EmulatedChannel, EmulatedDevice, Op, QueueFabric, ThreadCollective, TPGroupOps


@dataclass(frozen=True, kw_only=True, slots=True)
class EmulatedJob:
    pp: int
    tp: int = 2
    chunks: int = 1
    microbatches: int = 6
    hint: str = "bf"
    buffer_limit: int = 32
    iterations: int = 2
    protocol: str = "rounds"  # or "early-receive"
    seed: int = 0
    task_ms: tuple[float, float] = (0.2, 2.0)  # device time of a forward, U(lo, hi); B = 2x, W = 1x
    host_jitter_ms: float = 1.0
    channel_latency_ms: float = 2.0
    timeout_s: float = 30.0
    quiet_s: float = 2.0

    def describe(self) -> str:
        return (f"PP={self.pp} TP={self.tp} chunks={self.chunks} M={self.microbatches} hint={self.hint} "
                f"limit={self.buffer_limit} {self.protocol} seed={self.seed}")


@dataclass(frozen=True, slots=True)
class EmulatedOutcome:
    job: EmulatedJob
    completed: bool
    deadlock: bool
    error: str
    orders: dict  # rank -> [order per iteration]
    wall_s: float


class EmulatedWork:
    """``StageWork`` issuing queue ops: compute, a TP all-reduce, compute (values at completion)."""

    def __init__(self, job: EmulatedJob, device: EmulatedDevice, tp_ops: TPGroupOps, topology: Topology,
                 stage: int, finals: dict, rng: random.Random) -> None:
        self.job, self.device, self.tp_ops, self.topology, self.stage = job, device, tp_ops, topology, stage
        self.finals, self.rng = finals, rng
        self.saved: dict = {}

    def _work(self, factor: float, run) -> None:
        time.sleep(self.rng.random() * self.job.host_jitter_ms / 1000)  # the host's own pace varies
        lo, hi = self.job.task_ms
        duration = factor * self.rng.uniform(lo, hi) / 1000
        self.device.compute(duration / 2, run)
        self.tp_ops.all_reduce(self.device.rank)
        self.device.compute(duration / 2)

    def forward(self, task: Task, input_tensor, send) -> None:
        out = self.device.empty((2,), torch.float32)
        first = self.topology.is_first(self.stage, task.chunk)

        def run(x=input_tensor, mb=task.microbatch):
            out.copy_((torch.full((2,), float(mb)) if first else x) + 1)

        self._work(1.0, run)
        self.saved[(task.microbatch, task.chunk)] = out
        if send is not None:
            send(out)

    def backward(self, task: Task, output_grad, send) -> None:
        grad = self.device.empty((2,), torch.float32)
        out = self.saved.pop((task.microbatch, task.chunk))
        last = self.topology.is_last(self.stage, task.chunk)
        first = self.topology.is_first(self.stage, task.chunk)

        def run(g=output_grad, mb=task.microbatch):
            grad.copy_(out * 10 if last else g + 1)
            if first:
                self.finals[mb] = float(grad[0])

        self._work(2.0, run)
        if send is not None:
            send(grad)

    def weight(self, task: Task) -> None:
        self._work(1.0, None)


class _RoundsWithoutRingRule(RoundTransport):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._exclusive = False


class _RoundsUnagreed(RoundTransport):
    def advance(self, state) -> None:
        super().advance(self.local_state())


_ROUNDS = {"rounds": RoundTransport, "rounds-without-ring-rule": _RoundsWithoutRingRule,
           "rounds-unagreed": _RoundsUnagreed}
PROTOCOLS = (*_ROUNDS, "early-receive")


class EarlyReceiveTransport(SelfDelivering):
    """The pre-rounds CUDA protocol, op by op, on an ``EmulatedDevice`` (module docstring)."""

    def __init__(self, *, rank: int, fabric: QueueFabric, neighbours: list[int], on_message, on_error) -> None:
        self.rank, self.fabric = rank, fabric
        self._on_message, self._on_error = on_message, on_error
        self._cv = threading.Condition()
        self._expected = {src: 0 for src in neighbours}
        self._pending = 0
        self._queues = {dst: queue.SimpleQueue() for dst in neighbours}
        self._seq: dict = {}
        for dst in neighbours:
            threading.Thread(target=self._send_loop, args=(dst,), daemon=True).start()
        for src in neighbours:
            threading.Thread(target=self._recv_loop, args=(src,), daemon=True).start()

    def _op(self, kind: str, src: int, dst: int, tensor: torch.Tensor):
        with self._cv:
            seq = self._seq.get((kind, src, dst), 0)
            self._seq[(kind, src, dst)] = seq + 1
        return self.fabric.issue(Op(self.rank, kind, (src, dst, seq), tensors=[tensor]))

    def send(self, dst: int, kind: str, microbatch: int, chunk: int, tensor: torch.Tensor) -> None:
        with self._cv:
            self._pending += 1
        self._queues[dst].put((encode_header(kind, microbatch, chunk, tensor), tensor))

    def expect(self, src: int, count: int) -> None:
        with self._cv:
            self._expected[src] += count
            self._cv.notify_all()

    def _send_loop(self, dst: int) -> None:
        while True:
            header, tensor = self._queues[dst].get()
            try:
                sent = [self._op("send", self.rank, dst, header), self._op("send", self.rank, dst, tensor)]
                for completion in sent:  # stream.synchronize(): NCCL's send returned when queued
                    completion.synchronize(None)
            except BaseException as exc:  # noqa: BLE001 - the fabric aborted
                self._on_error(exc)
                return
            with self._cv:
                self._pending -= 1
                self._cv.notify_all()

    def _recv_loop(self, src: int) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._expected[src] > 0)
                self._expected[src] -= 1
            try:
                raw = torch.zeros(HEADER_LEN, dtype=torch.int64)
                self._op("recv", src, self.rank, raw).synchronize(None)  # decode_header(raw.cpu())
                header = decode_header(raw)
                payload = torch.zeros(header.shape, dtype=header.dtype)
                assert payload.numel() * payload.element_size() == payload_bytes(header)
                arrived = self._op("recv", src, self.rank, payload)
            except BaseException as exc:  # noqa: BLE001 - the fabric aborted
                self._on_error(exc)
                return
            self._on_message(Message(header.kind, header.microbatch, header.chunk, payload, src, arrived))

    def flush(self, timeout: float) -> None:
        with self._cv:
            if not self._cv.wait_for(lambda: self._pending == 0, timeout):
                raise RuntimeError(f"rank {self.rank}: flush timed out")


def run_emulated(job: EmulatedJob) -> EmulatedOutcome:
    """Run ``job`` to the end or to a device deadlock; never hangs (everything is bounded)."""
    if job.protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {job.protocol!r}")
    topology = Topology(job.pp, job.chunks)
    ranks = list(range(job.pp * job.tp))
    rank_of = lambda stage, t: stage * job.tp + t  # noqa: E731
    fabric = QueueFabric(ranks, quiet_s=job.quiet_s)
    hub = ChannelHub(max_latency_s=job.channel_latency_ms / 1000, seed=job.seed)
    groups = {s: ThreadCollective.Group(job.tp) for s in range(job.pp)}
    tp_ops = {s: TPGroupOps(fabric, f"tp{s}", [rank_of(s, t) for t in range(job.tp)]) for s in range(job.pp)}
    plan = Plan.build(ArbiterConfig(hint=job.hint, buffer_limit=job.buffer_limit), topology, job.microbatches)
    finals: dict = {}
    orders: dict = {r: [] for r in ranks}
    errors: dict = {}
    inboxes = {r: Inbox() for r in ranks}
    for r in ranks:
        fabric.on_abort.append(inboxes[r].fail)
    for group in groups.values():
        fabric.on_abort.append(group.abort)

    def rank_main(stage: int, t: int) -> None:
        rank = rank_of(stage, t)
        pipeline = [rank_of(s, t) for s in range(job.pp)]
        neighbours = sorted({pipeline[(stage + d) % job.pp] for d in (-1, 1)
                             if job.chunks > 1 or 0 <= stage + d < job.pp} - {rank})
        inbox, device = inboxes[rank], EmulatedDevice(fabric, rank)
        if job.protocol in _ROUNDS:
            transport = _ROUNDS[job.protocol](
                rank=rank, stage_of={r: i for i, r in enumerate(pipeline)}, neighbours=neighbours, device=device,
                channel_factory=lambda on_record, on_error: EmulatedChannel(hub, rank, on_record, on_error),
                on_message=inbox.put, on_error=inbox.fail, wake=inbox.wake, timeout_s=job.timeout_s)
        else:
            transport = EarlyReceiveTransport(rank=rank, fabric=fabric, neighbours=neighbours, on_message=inbox.put,
                                              on_error=inbox.fail)
        rng = random.Random(job.seed * 7919 + rank)
        work = EmulatedWork(job, device, tp_ops[stage], topology, stage, finals if t == 0 else {}, rng)
        collective = ThreadCollective(groups[stage], t)  # one sequence of exchanges for the whole run
        try:
            for _ in range(job.iterations):
                agreement = None
                if job.tp > 1:
                    agreement = TPAgreement(collective, num_microbatches=job.microbatches,
                                            num_chunks=job.chunks, split_backward=plan.arbiter(stage).split_backward,
                                            forward_only=False)
                report = PipelineIteration(work=work, arbiter=plan.arbiter(stage), topology=topology, stage=stage,
                                           stage_ranks=pipeline, transport=transport, inbox=inbox,
                                           agreement=agreement, timeout_s=job.timeout_s, forward_only=False).run()
                orders[rank].append(report.order_string)
                device.mark().synchronize(job.timeout_s)  # the iteration's work is done on the device
        except BaseException as exc:  # noqa: BLE001 - reported in the outcome
            errors[rank] = exc

    start = time.monotonic()
    threads = [threading.Thread(target=rank_main, args=(s, t), daemon=True, name=f"emulated-rank{rank_of(s, t)}")
               for s in range(job.pp) for t in range(job.tp)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(job.timeout_s * (job.iterations + 1))
    wall = time.monotonic() - start
    fabric.stop()
    hub.stop()
    deadlock = fabric.error is not None
    hung = [th.name for th in threads if th.is_alive()]
    v = topology.num_virtual_stages
    wrong = {mb: got for mb, got in finals.items() if got != 10 * (mb + v) + v - 1}
    problems = []
    if hung:
        problems.append(f"threads still running: {hung}")
    if errors:
        first = min(errors)
        problems.append(f"rank {first}: {type(errors[first]).__name__}: {errors[first]}")
    if wrong or (not errors and len(finals) != job.microbatches):
        problems.append(f"wrong gradients reached stage 0: {wrong or finals}")
    for s in range(job.pp):  # every TP rank of a stage ran the same order
        seen = {tuple(orders[rank_of(s, t)]) for t in range(job.tp)}
        if not errors and len(seen) != 1:
            problems.append(f"stage {s}: TP ranks ran different orders {seen}")
    if deadlock:  # name a rank that failed on its own (not through the abort) first: that is the cause
        own = [f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(errors.items())
               if "device deadlock" not in str(e)]
        problems = own[:1] + [str(fabric.error)]
    return EmulatedOutcome(job=job, completed=not problems, deadlock=deadlock and len(problems) == 1,
                           error="; ".join(problems), orders=orders, wall_s=wall)


def random_jobs(count: int, *, seed: int, protocol: str, pps=(2, 3, 4, 6, 8), chunks=(1, 2),
                quiet_s: float = 2.0) -> list[EmulatedJob]:
    """``count`` random layouts and policies (PP, chunks, hint, buffer limit, delays)."""
    rng = random.Random(seed)
    choices = chunks
    jobs = []
    for i in range(count):
        pp = rng.choice(pps)
        chunks = rng.choice(choices)
        hint = rng.choice(("bf", "bfw", "1f1b", "bf"))
        microbatches = rng.choice((4, 6)) if pp <= 4 else 4
        if chunks > 1:  # Megatron's interleaved 1F1B wants M a multiple of PP
            microbatches = pp * (rng.choice((1, 2)) if pp <= 4 else 1)
        jobs.append(EmulatedJob(pp=pp, chunks=chunks, microbatches=microbatches,
                                hint=hint, buffer_limit=rng.choice((2, 4, 32)), protocol=protocol,
                                seed=seed * 1000 + i, task_ms=(0.2, rng.choice((1.0, 3.0))),
                                host_jitter_ms=rng.choice((0.2, 1.0, 3.0)),
                                channel_latency_ms=rng.choice((0.5, 2.0, 5.0)), quiet_s=quiet_s))
    return jobs


__all__ = ["PROTOCOLS", "EarlyReceiveTransport", "EmulatedJob", "EmulatedOutcome", "EmulatedWork", "random_jobs",
           "run_emulated"]
