"""The real executor, TP agreement and transport on single-queue stand-in GPUs
(``tests/helpers/queue_device.py``): test code, run by tests/unit/test_transport_emulated.py and
scripts/emulate_transport.py, never by the package.

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

from megatron_rrfp.policy.actions import Task
from megatron_rrfp.policy.arbiter import ArbiterConfig
from megatron_rrfp.policy.epochs import EpochBook, EpochVariant, candidate_variants, timeline_for
from megatron_rrfp.policy.plan import Plan
from megatron_rrfp.policy.topology import Topology
from megatron_rrfp.runtime.agreement import TPAgreement
from megatron_rrfp.runtime.executor import Inbox, PipelineIteration
from megatron_rrfp.runtime.rounds import RoundTransport
from megatron_rrfp.runtime.transport import (
    HEADER_LEN,
    Message,
    SelfDelivering,
    decode_header,
    encode_header,
    payload_bytes,
)

from .queue_device import (
    ChannelHub,
    EmulatedChannel,
    EmulatedDevice,
    Op,
    QueueFabric,
    ThreadCollective,
    TPGroupOps,
)


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
    dp: int = 1  # pipelines (data-parallel replicas); stage s of each shares DP groups with the others'
    ep: int = 1  # expert-parallel replicas (divides dp): MoE all-to-alls in F and B, the dispatcher's host sync
    overlap_grad_reduce: bool = False  # DDP bucket reductions in the chunk's last B (last W under the split)
    overlap_param_gather: bool = False  # distributed optimizer all-gathers where megatron issues them
    buckets: int = 2  # chunk 0's DDP buckets; later chunks have one (Megatron-LM's disable_bucketing)
    straggler: float = 1.0  # each (pipeline, stage) runs its device work at a speed factor in [1/x, x]
    dp_after_loop: bool = False  # --rrfp-dp-overlap after-loop: all-gathers before the loop, reductions after it
    dp_epochs: bool = False  # --rrfp-dp-overlap epochs: the DP epoch rule instead of the whole-stage agreement
    pair: bool = False  # ArbiterConfig.pair_forward_backward: a ready F and B run as one combined step
    epochs_order: str = "megatron"  # the epoch rule's variant (policy.epochs.EpochVariant): its static order,
    epochs_deferred: tuple = ()  # the chunks whose reductions leave the loop,
    epochs_gathers_before: bool = False  # and whether every chunk's all-gathers come before it

    def describe(self) -> str:
        dp = (f" DP={self.dp}" + (f" EP={self.ep}" if self.ep > 1 else "")
              + (" grad-reduce" if self.overlap_grad_reduce else "")
              + (" param-gather" if self.overlap_param_gather else "")
              + (" after-loop" if self.dp_after_loop else "")
              + (f" epochs[{self.variant}]" if self.dp_epochs else "")) if self.dp > 1 else ""
        dp += " paired" if self.pair else ""
        return (f"PP={self.pp} TP={self.tp}{dp} chunks={self.chunks} M={self.microbatches} hint={self.hint} "
                f"limit={self.buffer_limit} {self.protocol} seed={self.seed}")

    @property
    def whole_stage(self) -> bool:
        """The agreement spans every DP replica of a stage (mcore/dp_overlap.py's rule; on
        CUDA where it asks for it), unless this is the ablation that drops the rule."""
        overlap = self.overlap_grad_reduce or self.overlap_param_gather
        return (self.dp > 1 and self.chunks > 1 and overlap and self.protocol != "rounds-dp-unagreed"
                and not self.dp_after_loop and not self.dp_epochs)

    @property
    def variant(self) -> EpochVariant:
        return EpochVariant(self.epochs_order, frozenset(self.epochs_deferred), self.epochs_gathers_before)

    @property
    def gathers_before_loop(self) -> bool:
        """Every chunk's all-gathers before the first task (after-loop, or the rule's variant)."""
        return self.dp_after_loop or (self.epoch_rule and self.epochs_gathers_before)

    @property
    def epoch_rule(self) -> bool:
        """The DP epoch rule applies (mcore/dp_overlap.py's ``epochs``: interleaved, DP > 1, overlap)."""
        return self.dp_epochs and self.dp > 1 and self.chunks > 1 and (self.overlap_grad_reduce
                                                                       or self.overlap_param_gather)


@dataclass(frozen=True, slots=True)
class EmulatedOutcome:
    job: EmulatedJob
    completed: bool
    deadlock: bool
    error: str
    orders: dict  # rank -> [order per iteration]
    wall_s: float
    pairs: int = 0  # combined F+B steps run, over every rank and iteration


class EmulatedWork:
    """``StageWork`` issuing queue ops: compute, a TP all-reduce, compute (values at completion);
    with EP the MoE layer's all-to-alls (and in F the dispatcher's host sync) in the middle;
    with DP the DDP reductions and all-gathers where megatron issues them (``grad_sync.py``):

    * ``overlap_param_gather``: interleaved (align_param_gather) chunks 0 and 1 at the start
      of the call, chunk c + 1 before chunk c's first forward; one chunk: its buckets in its
      first forward (DDP's forward pre-hook chain);
    * ``overlap_grad_reduce``: a chunk's buckets in its last B (last W under the split: every
      bucket holds a W-computed weight), in bucket order; without it (or at the end) after the loop;
    * ``dp_after_loop`` (``grad_sync``'s ``in_loop=False``): every chunk's all-gathers at the start
      of the call, every reduction after the loop, in chunk and bucket order.
    """

    def __init__(self, job: EmulatedJob, device: EmulatedDevice, tp_ops: TPGroupOps, topology: Topology,
                 stage: int, finals: dict, rng: random.Random, *, dp_ops: TPGroupOps | None = None,
                 ep_ops: TPGroupOps | None = None, split: bool = False, speed: float = 1.0) -> None:
        self.job, self.device, self.tp_ops, self.topology, self.stage = job, device, tp_ops, topology, stage
        self.finals, self.rng = finals, rng
        self.dp_ops, self.ep_ops, self.split, self.speed = dp_ops, ep_ops, split, speed  # speed: a time factor
        self.saved: dict = {}
        self.pairs_run = 0
        self.start_iteration()

    def start_iteration(self) -> None:
        """Megatron's per-call state (GradSyncController.start): counters, first all-gathers."""
        chunks = self.topology.num_chunks
        self._f_seen, self._b_left = set(), [self.job.microbatches] * chunks
        self._w_left = [self.job.microbatches] * chunks
        self._reduced: set = set()
        if self.dp_ops is not None and self.job.overlap_param_gather and (chunks > 1 or self.job.dp_after_loop):
            for chunk in range(chunks if self.job.gathers_before_loop else min(2, chunks)):
                self._dp("gather", chunk)

    def finish_iteration(self) -> None:
        """After the loop: the reductions not launched inside it (grad_sync.finish), in chunk order."""
        for chunk in range(self.topology.num_chunks):
            if self.dp_ops is not None and chunk not in self._reduced:
                self._dp("reduce", chunk)

    def _dp(self, what: str, chunk: int) -> None:
        if what == "reduce":
            self._reduced.add(chunk)
        for bucket in range(self.job.buckets if chunk == 0 else 1):
            self.dp_ops.collective(self.device.rank, (what, chunk, bucket))

    def _work(self, factor: float, run, *, moe: str = "") -> None:
        time.sleep(self.rng.random() * self.job.host_jitter_ms / 1000)  # the host's own pace varies
        lo, hi = self.job.task_ms
        duration = factor * self.speed * self.rng.uniform(lo, hi) / 1000
        self.device.compute(duration / 2, run)
        self.tp_ops.all_reduce(self.device.rank)
        if self.ep_ops is not None and moe:
            rank = self.device.rank
            if moe == "F":  # tokens per expert over EP, copied to the host: d2h_event.synchronize()
                self.ep_ops.collective(rank, ("counts",))
                if not self.device.mark().synchronize(self.job.timeout_s):
                    raise TimeoutError(f"rank {rank}: the MoE dispatcher's host sync timed out")
            self.ep_ops.collective(rank, ("all-to-all", moe, 0))
            self.device.compute(duration / 4)
            self.ep_ops.collective(rank, ("all-to-all", moe, 1))
        self.device.compute(duration / 2)

    def forward(self, task: Task, input_tensor, send) -> None:
        out = self.device.empty((2,), torch.float32)
        first = self.topology.is_first(self.stage, task.chunk)
        if (self.dp_ops is not None and self.job.overlap_param_gather and not self.job.gathers_before_loop
                and task.chunk not in self._f_seen):
            self._f_seen.add(task.chunk)
            if self.topology.num_chunks == 1:
                self._dp("gather", 0)
            elif 1 < task.chunk + 1 < self.topology.num_chunks:
                self._dp("gather", task.chunk + 1)

        def run(x=input_tensor, mb=task.microbatch):
            out.copy_((torch.full((2,), float(mb)) if first else x) + 1)

        self._work(1.0, run, moe="F")
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

        self._work(2.0, run, moe="B")
        self._b_left[task.chunk] -= 1
        if self._reduces_now(task.chunk) and not self.split and self._b_left[task.chunk] == 0:
            self._dp("reduce", task.chunk)
        if send is not None:
            send(grad)

    def pair(self, forward, backward) -> None:
        """A combined step (``ArbiterConfig.pair_forward_backward``): both halves' ops on the one queue in
        the order megatron-core's layer schedule issues them — B's combine all-to-all, F's attention, B's
        expert compute, F's dispatch all-to-all (after the dispatcher's host sync), B's dispatch all-to-all,
        F's expert compute and combine all-to-all, B's attention — each all-to-all beside the other half's
        compute. Every EP replica runs the same pair (the agreement), so the all-to-alls match."""
        (f_task, f_in, f_send), (b_task, b_grad, b_send) = forward, backward
        self.pairs_run += 1
        out, grad = self.device.empty((2,), torch.float32), self.device.empty((2,), torch.float32)
        b_out = self.saved.pop((b_task.microbatch, b_task.chunk))
        f_first = self.topology.is_first(self.stage, f_task.chunk)
        b_last, b_first = self.topology.is_last(self.stage, b_task.chunk), self.topology.is_first(self.stage,
                                                                                                   b_task.chunk)
        if (self.dp_ops is not None and self.job.overlap_param_gather and not self.job.gathers_before_loop
                and f_task.chunk not in self._f_seen):
            self._f_seen.add(f_task.chunk)
            if self.topology.num_chunks == 1:
                self._dp("gather", 0)
            elif 1 < f_task.chunk + 1 < self.topology.num_chunks:
                self._dp("gather", f_task.chunk + 1)

        def run_forward(x=f_in, mb=f_task.microbatch):
            out.copy_((torch.full((2,), float(mb)) if f_first else x) + 1)

        def run_backward(g=b_grad, mb=b_task.microbatch):
            grad.copy_(b_out * 10 if b_last else g + 1)
            if b_first:
                self.finals[mb] = float(grad[0])

        time.sleep(self.rng.random() * self.job.host_jitter_ms / 1000)
        lo, hi = self.job.task_ms
        f_time = self.speed * self.rng.uniform(lo, hi) / 1000
        b_time = 2.0 * self.speed * self.rng.uniform(lo, hi) / 1000
        rank, ep = self.device.rank, self.ep_ops
        if ep is not None:
            ep.collective(rank, ("all-to-all", "B", 1))  # B's combine, beside F's attention
        self.device.compute(f_time / 2, run_forward)
        self.tp_ops.all_reduce(rank)
        self.device.compute(b_time / 2, run_backward)
        self.tp_ops.all_reduce(rank)
        if ep is not None:
            ep.collective(rank, ("counts",))
            if not self.device.mark().synchronize(self.job.timeout_s):
                raise TimeoutError(f"rank {rank}: the MoE dispatcher's host sync timed out")
            ep.collective(rank, ("all-to-all", "F", 0))
            ep.collective(rank, ("all-to-all", "B", 0))
            self.device.compute(f_time / 4)
            ep.collective(rank, ("all-to-all", "F", 1))
        self.device.compute(f_time / 2 + b_time / 2)
        self.saved[(f_task.microbatch, f_task.chunk)] = out
        self._b_left[b_task.chunk] -= 1
        if self._reduces_now(b_task.chunk) and not self.split and self._b_left[b_task.chunk] == 0:
            self._dp("reduce", b_task.chunk)
        if f_send is not None:
            f_send(out)
        if b_send is not None:
            b_send(grad)

    def weight(self, task: Task) -> None:
        self._work(1.0, None)
        self._w_left[task.chunk] -= 1
        if self._reduces_now(task.chunk) and self._w_left[task.chunk] == 0:
            self._dp("reduce", task.chunk)

    def _reduces_now(self, chunk: int) -> bool:
        return (self.dp_ops is not None and self.job.overlap_grad_reduce and not self.job.dp_after_loop
                and not (self.job.epoch_rule and chunk in self.job.epochs_deferred))


class _RoundsWithoutRingRule(RoundTransport):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._exclusive = False


class _RoundsUnagreed(RoundTransport):
    def advance(self, state) -> None:
        super().advance(self.local_state())


class _RoundsWithoutEpochOrder(RoundTransport):
    """Rule 1 of the epoch rule alone ("pin only the DP tasks"): rounds bundle and order
    messages of any epochs (``_PinnedOnly`` drops the DP point's barrier to match)."""

    def use_epochs(self, book) -> None:
        super().use_epochs(None)


class _PinnedOnly(EpochBook):
    def allowed(self, ready) -> set:
        lowest, self.lowest = self.lowest, len(self.open)  # every epoch counts as issued: no barrier
        try:
            return super().allowed(ready)
        finally:
            self.lowest = lowest


_ROUNDS = {"rounds": RoundTransport, "rounds-without-ring-rule": _RoundsWithoutRingRule,
           "rounds-unagreed": _RoundsUnagreed, "rounds-dp-unagreed": RoundTransport,
           "rounds-without-epoch-order": _RoundsWithoutEpochOrder}
"""``rounds-dp-unagreed``: the shipped transport, but the agreement spans TP (and EP) only even
where interleaved DP overlap needs every replica of the stage in it (mcore/dp_overlap.py);
``rounds-without-epoch-order``: under the epoch rule (``dp_epochs``), rule 1 only (tasks pinned
at DP points, rounds free of epochs)."""
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
    if job.dp % job.ep:
        raise ValueError(f"ep={job.ep} must divide dp={job.dp}")
    topology = Topology(job.pp, job.chunks)
    per_replica = job.pp * job.tp
    ranks = list(range(job.dp * per_replica))
    rank_of = lambda stage, t, r=0: r * per_replica + stage * job.tp + t  # noqa: E731
    fabric = QueueFabric(ranks, quiet_s=job.quiet_s)
    hub = ChannelHub(max_latency_s=job.channel_latency_ms / 1000, seed=job.seed)
    # the agreement: a stage's TP ranks, joined with its EP replicas, or every replica (the DP rule)
    span = job.dp if job.whole_stage else job.ep
    groups = {(s, g): ThreadCollective.Group(job.tp * span) for s in range(job.pp) for g in range(job.dp // span)}
    tp_ops = {(s, r): TPGroupOps(fabric, f"tp{s}.{r}", [rank_of(s, t, r) for t in range(job.tp)])
              for s in range(job.pp) for r in range(job.dp)}
    dp_ops = {(s, t): TPGroupOps(fabric, f"dp{s}.{t}", [rank_of(s, t, r) for r in range(job.dp)])
              for s in range(job.pp) for t in range(job.tp)} if job.dp > 1 else {}
    ep_ops = {(s, t, g): TPGroupOps(fabric, f"ep{s}.{t}.{g}", [rank_of(s, t, r) for r in range(g * job.ep,
                                                                                            (g + 1) * job.ep)])
              for s in range(job.pp) for t in range(job.tp) for g in range(job.dp // job.ep)} if job.ep > 1 else {}
    plan = Plan.build(ArbiterConfig(hint=job.hint, buffer_limit=job.buffer_limit, pair_forward_backward=job.pair),
                      topology, job.microbatches)
    works: list = []
    finals: dict = {r: {} for r in range(job.dp)}
    orders: dict = {r: [] for r in ranks}
    errors: dict = {}
    inboxes = {r: Inbox() for r in ranks}
    for r in ranks:
        fabric.on_abort.append(inboxes[r].fail)
    for group in groups.values():
        fabric.on_abort.append(group.abort)

    def rank_main(stage: int, t: int, replica: int) -> None:
        rank = rank_of(stage, t, replica)
        pipeline = [rank_of(s, t, replica) for s in range(job.pp)]
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
        pace = random.Random(job.seed * 7919 + 104729 * replica + stage).uniform(1 / job.straggler, job.straggler)
        split = plan.arbiter(stage).split_backward
        work = EmulatedWork(job, device, tp_ops[(stage, replica)], topology, stage,
                            finals[replica] if t == 0 else {}, rng, dp_ops=dp_ops.get((stage, t)),
                            ep_ops=ep_ops.get((stage, t, replica // job.ep)), split=split, speed=pace)
        works.append(work)
        collective = ThreadCollective(groups[(stage, replica // span)], (replica % span) * job.tp + t)
        try:
            for iteration in range(job.iterations):
                if iteration:
                    work.start_iteration()
                agreement = None
                if job.tp * span > 1:
                    agreement = TPAgreement(collective, num_microbatches=job.microbatches,
                                            num_chunks=job.chunks, split_backward=split, forward_only=False)
                arbiter = plan.arbiter(stage)
                book = None
                timeline = timeline_for(plan.config, topology, job.microbatches, split, job.variant) \
                    if job.epoch_rule else None
                if timeline is not None and timeline.points:  # as mcore/call.py: no DP point, no book
                    book = (_PinnedOnly if job.protocol == "rounds-without-epoch-order" else EpochBook)(
                        timeline, topology, stage)
                report = PipelineIteration(work=work, arbiter=arbiter, topology=topology, stage=stage,
                                           stage_ranks=pipeline, transport=transport, inbox=inbox,
                                           agreement=agreement, timeout_s=job.timeout_s, forward_only=False,
                                           epochs=book).run()
                work.finish_iteration()
                orders[rank].append(report.order_string)
                device.mark().synchronize(job.timeout_s)  # the iteration's work is done on the device
        except BaseException as exc:  # noqa: BLE001 - reported in the outcome
            errors[rank] = exc

    start = time.monotonic()
    threads = [threading.Thread(target=rank_main, args=(s, t, r), daemon=True,
                                name=f"emulated-rank{rank_of(s, t, r)}")
               for r in range(job.dp) for s in range(job.pp) for t in range(job.tp)]
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
    problems = []
    if hung:
        problems.append(f"threads still running: {hung}")
    if errors:
        first = min(errors)
        problems.append(f"rank {first}: {type(errors[first]).__name__}: {errors[first]}")
    for replica, got in finals.items():
        wrong = {mb: value for mb, value in got.items() if value != 10 * (mb + v) + v - 1}
        if wrong or (not errors and len(got) != job.microbatches):
            problems.append(f"wrong gradients reached stage 0 of pipeline {replica}: {wrong or got}")
    for s in range(job.pp):  # every TP rank of a stage ran the same order (every replica too, under the rule)
        for g in range(job.dp // span):
            seen = {tuple(orders[rank_of(s, t, r)]) for t in range(job.tp) for r in range(g * span, (g + 1) * span)}
            if not errors and len(seen) != 1:
                problems.append(f"stage {s}: agreeing ranks ran different orders {seen}")
    if deadlock:  # name a rank that failed on its own (not through the abort) first: that is the cause
        own = [f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(errors.items())
               if "device deadlock" not in str(e) and "mismatched collective" not in str(e)]
        problems = own[:1] + [str(fabric.error)]
    return EmulatedOutcome(job=job, completed=not problems, deadlock=deadlock and len(problems) == 1,
                           error="; ".join(problems), orders=orders, wall_s=wall,
                           pairs=sum(work.pairs_run for work in works))


def random_jobs(count: int, *, seed: int, protocol: str, pps=(2, 3, 4, 6, 8), chunks=(1, 2, 3, 4),
                quiet_s: float = 2.0, production: float = 0.5, dp_epochs: bool = False) -> list[EmulatedJob]:
    """``count`` random layouts and policies (PP, chunks, hint, buffer limit, delays); a
    ``production`` share of them are whole production jobs: two pipelines (DP=2) with DDP's
    overlapped reductions and all-gathers, or MoE with EP=2 (all-to-alls in F and B).
    ``dp_epochs``: the same jobs, every interleaved DP=2 one under the DP epoch rule."""
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
        dp = dict(dp=1)
        if rng.random() < production:  # two pipelines: at most 4 stages x 4 chunks (threads: 2 x PP x TP)
            pp, chunks = min(pp, 4), chunks
            microbatches = pp * rng.choice((1, 2)) if chunks > 1 else rng.choice((4, 6))
            grad, param = rng.choice(((True, True), (True, False), (False, True), (True, True)))
            dp = dict(dp=2, ep=rng.choice((1, 1, 2)), overlap_grad_reduce=grad, overlap_param_gather=param,
                      buckets=rng.choice((1, 2, 3)), dp_after_loop=chunks > 1 and rng.random() < 0.5)
            if dp_epochs:
                dp.update(dp_after_loop=False, dp_epochs=chunks > 1,
                          **_random_variant(seed * 1000 + i, chunks, protocol))
        jobs.append(EmulatedJob(pp=pp, chunks=chunks, microbatches=microbatches,
                                hint=hint, buffer_limit=rng.choice((2, 4, 32)), protocol=protocol,
                                seed=seed * 1000 + i, task_ms=(0.2, rng.choice((1.0, 3.0))),
                                host_jitter_ms=rng.choice((0.2, 1.0, 3.0)),
                                channel_latency_ms=rng.choice((0.5, 2.0, 5.0)), quiet_s=quiet_s, **dp,
                                straggler=rng.choice((1.0, 3.0)) if dp["dp"] > 1 else 1.0))
    return jobs


def dp_stress_jobs(count: int, *, seed: int, protocol: str, quiet_s: float = 2.0,
                   dp_after_loop: bool = False, dp_epochs: bool = False) -> list[EmulatedJob]:
    """Interleaved DP=2 jobs made to separate the pipelines: PP 3-4, 2-3 chunks, overlapped
    reductions (all-gathers in half), stages at paces up to 3-6x apart, slow host channels —
    where dropping the whole-stage rule (``rounds-dp-unagreed``) can close a cycle through
    both pipelines (``runtime/rounds.py``: R(c) before round j on one, after round i on the other);
    ``dp_after_loop``: the same jobs with the DP communication out of the loop instead;
    ``dp_epochs``: under the DP epoch rule instead."""
    rng = random.Random(seed)
    jobs = []
    for i in range(count):
        pp = rng.choice((3, 4))
        chunks = rng.choice((2, 3))
        jobs.append(EmulatedJob(pp=pp, chunks=chunks, microbatches=pp * rng.choice((1, 2)), dp=2,
                                hint=rng.choice(("bf", "bfw")), buffer_limit=rng.choice((2, 4, 32)),
                                overlap_grad_reduce=True, overlap_param_gather=rng.random() < 0.5,
                                buckets=rng.choice((1, 3)), straggler=rng.choice((3.0, 6.0)),
                                host_jitter_ms=rng.choice((1.0, 3.0)), channel_latency_ms=rng.choice((5.0, 10.0)),
                                task_ms=(0.2, rng.choice((1.0, 3.0))), protocol=protocol, seed=seed * 1000 + i,
                                quiet_s=quiet_s, timeout_s=20.0, dp_after_loop=dp_after_loop, dp_epochs=dp_epochs,
                                **(_random_variant(seed * 1000 + i, chunks, protocol) if dp_epochs else {})))
    return jobs


def _random_variant(seed: int, chunks: int, protocol: str) -> dict:
    """One of the epoch rule's variants (``policy.epochs.candidate_variants``), drawn apart from
    the job's other fields so the same seeds give the same layouts as before; the ablation of
    rule 3 keeps every DP point (with fewer there is less for the epoch order to prevent)."""
    if protocol == "rounds-without-epoch-order":
        return {}
    variant = random.Random(f"variant-{seed}").choice(candidate_variants(chunks))
    return dict(epochs_order=variant.order, epochs_deferred=tuple(sorted(variant.deferred)),
                epochs_gathers_before=variant.gathers_before)



def paired_jobs(count: int, *, seed: int, protocol: str, quiet_s: float = 2.0) -> list[EmulatedJob]:
    """``count`` random jobs whose stages pair a ready F with a ready B (megatron-core's combined step,
    ``--overlap-moe-expert-parallel-comm``): MoE with EP=2 (all-to-alls in both halves of a pair, the
    dispatcher's host sync) in most, TP=2, with and without chunks, the hints that pair (``default``
    with its B/W split: a pair's backward defers its W or runs whole, as the arbiter decides)."""
    rng = random.Random(seed)
    jobs = []
    for i in range(count):
        pp, chunks = rng.choice((2, 3, 4)), rng.choice((1, 1, 2, 3))
        microbatches = pp * rng.choice((1, 2)) if chunks > 1 else rng.choice((4, 6, 8))
        ep = rng.choice((1, 2, 2))
        hint = rng.choice(("bf", "1f1b", "default"))
        jobs.append(EmulatedJob(pp=pp, chunks=chunks, microbatches=microbatches, hint=hint,
                                buffer_limit=rng.choice((2, 4, 32)), protocol=protocol, seed=seed * 1000 + i,
                                task_ms=(0.2, rng.choice((1.0, 3.0))), host_jitter_ms=rng.choice((0.2, 1.0, 3.0)),
                                channel_latency_ms=rng.choice((0.5, 2.0, 5.0)), quiet_s=quiet_s, dp=2 if ep > 1 else 1,
                                ep=ep, pair=True, straggler=rng.choice((1.0, 3.0)) if ep > 1 else 1.0))
    return jobs


__all__ = ["PROTOCOLS", "EarlyReceiveTransport", "EmulatedJob", "EmulatedOutcome", "EmulatedWork", "dp_stress_jobs",
           "paired_jobs", "random_jobs", "run_emulated"]
