"""The DP epoch rule, simulated: one replica's iteration under the rule.

The rule (docs/design/dp-epochs.md) keeps interleaved pipelines' DP replicas independent
between *DP points* while their DP communication overlaps the task loop. Its bookkeeping
(the static timeline, each stage's ``EpochBook``) is ``policy/epochs.py``; this runs the
policy's dry-run engine (``policy/dryrun.py``'s readiness bookkeeping) under it:

* a stage dispatches the task holding a DP point only after every task before it in its
  static order and no task after it before it (rule 1);
* before that task, every message of an epoch <= the point's, to or from the stage, has been
  delivered (the barrier of rule 3);
* a message is delivered (its round issued at both ends) only once it arrived and both its
  sender's and its receiver's books allow a round of its epoch (rule 3);
* where the hint waits for a task the rule holds back, the interval's earliest admitted task runs.

The trace goes to ``sim/dp_comm.replicas_iteration_time`` with the other replicas' (a
reduction starts once the slower replica launched it). Units of f0.

``choose_variant`` is the rule's one free choice (``policy.epochs.EpochVariant``: which
static order, which chunks reduce after the loop), made by this simulator on the job's own
layout, variability and DP communication: among the variants within ``CHOICE_TOLERANCE`` of the
smallest median iteration, the one with the fewest DP points.
"""
from __future__ import annotations

import heapq

from ..policy.actions import Kind, Task
from ..policy.arbiter import ArbiterConfig
from ..policy.dryrun import DeadlockError, DryRun, _Pipeline, _task_time
from ..policy.epochs import (
    DPPoint,
    EpochBook,
    EpochVariant,
    Timeline,
    candidate_variants,
    megatron_orders,
    policy_orders,
    static_timeline,
    timeline_for,
)
from ..policy.epochs import choose as choose_under_rule
from ..policy.plan import Plan
from ..policy.topology import Topology
from .dp_comm import DPComm, replicas_iteration_time
from .simulator import median
from .variability import Realization, Variability, sample_realization

_FINISH = 1  # policy/dryrun.py's event kinds: 0 a message arrives, 1 a task finishes


class _EpochPipeline(_Pipeline):
    """Readiness bookkeeping with the rule's delivery holds."""

    def __init__(self, arbiters, topology, latency, timeline: Timeline) -> None:
        super().__init__(arbiters, topology, latency)
        self.timeline = timeline
        self.books = [EpochBook(timeline, topology, stage) for stage in range(topology.num_stages)]
        self.held: list = []  # (epoch, seq, src, dst, payload): arrived, not delivered
        self._held_seq = 0

    def epoch_of(self, payload, dst: int) -> int:
        """The epoch of a message to ``dst``; the payload names the consumer's chunk."""
        direction, mb, chunk = payload
        return self.timeline.message_epoch(self.topology, dst, direction == "F", mb, chunk)

    def send(self, src: int, dst: int, time: float, latency: float, payload) -> None:
        super().send(src, dst, time, latency, (*payload, src))

    def arrive(self, stage: int, payload) -> None:  # arrived over the link: held until deliverable
        epoch = self.epoch_of(payload[:3], stage)
        heapq.heappush(self.held, (epoch, self._held_seq, payload[3], stage, payload[:3]))
        self._held_seq += 1
        self.release()

    def release(self) -> bool:
        """Deliver every held message the epoch order allows; True if any was."""
        delivered, progress = False, True
        while progress:
            progress, kept = False, []
            for item in sorted(self.held):
                epoch, _, src, dst, payload = item
                if self.books[src].may_issue(epoch) and self.books[dst].may_issue(epoch):
                    super().arrive(dst, payload)
                    self.books[src].issued(epoch)
                    self.books[dst].issued(epoch)
                    progress = delivered = True
                else:
                    kept.append(item)
            self.held = kept
        heapq.heapify(self.held)
        return delivered


def run_with_epochs(config: ArbiterConfig, topology: Topology, num_microbatches: int, realization: Realization,
                    timeline: Timeline | None = None) -> DryRun:
    """One replica's iteration under the rule (module docstring), with its trace; ``timeline``
    defaults to the one the executor uses (``policy.epochs.timeline_for``)."""
    plan = Plan.build(config, topology, num_microbatches)
    split = plan.split_backward
    timeline = timeline or timeline_for(config, topology, num_microbatches, split)
    arbiters = plan.arbiters()

    def latency(stage: int, task: Task) -> float:
        table = realization.activation_latency if task.kind is Kind.F else realization.gradient_latency
        return table[stage][task.chunk][task.microbatch]

    def duration(stage: int, task: Task) -> float:
        return realization.duration(stage, task, split)

    pipe = _EpochPipeline(arbiters, topology, latency, timeline)
    pp = topology.num_stages
    busy_until: list = [None] * pp
    busy = [0.0] * pp
    trace: list = []
    now = 0.0
    touched = set(range(pp))
    while True:
        for stage in sorted(touched):
            if busy_until[stage] is not None:
                continue
            book, arbiter = pipe.books[stage], arbiters[stage]
            task = choose_under_rule(book, arbiter, pipe.ready[stage])
            if task is None:
                continue
            pipe.ready[stage].discard(task)
            arbiter.record(task)
            if book.dispatched(task) is not None and pipe.release():
                touched.update(range(pp))
            length = _task_time(arbiter, duration, stage, task)
            busy_until[stage] = now + length
            busy[stage] += length
            trace.append((stage, task, now, now + length))
            pipe.push(now + length, _FINISH, stage, task)
        if not pipe.events:
            break
        now = pipe.events[0][0]
        while pipe.events and pipe.events[0][0] == now:
            _, _, kind, stage, payload = heapq.heappop(pipe.events)
            if kind == _FINISH:
                busy_until[stage] = None
                pipe.finish(stage, payload, now)
            else:
                pipe.arrive(stage, payload)
        touched = {s for s in range(pp) if busy_until[s] is None}  # a delivery can open a barrier anywhere
    if not all(a.done for a in arbiters):
        states = "\n".join(f"  {a.describe()} ready={sorted(map(str, pipe.ready[a.stage]))} "
                           f"allowed={sorted(map(str, pipe.books[a.stage].allowed(pipe.ready[a.stage])))} "
                           f"passed={pipe.books[a.stage].passed} lowest open epoch={pipe.books[a.stage].lowest}"
                           for a in arbiters)
        states += f"\n  held (epoch, seq, from, to, message): {sorted(pipe.held)}"
        raise DeadlockError(f"the epoch rule stalled at t={now:.3f} with work left:\n{states}")
    return DryRun(policy=config.parsed_hint.name + "+epochs", makespan=now, busy=busy,
                  peak_in_flight=[a.peak_in_flight for a in arbiters],
                  orders=[list(a.dispatched) for a in arbiters], trace=trace)


def variant_traces(config: ArbiterConfig, topology: Topology, num_microbatches: int, draws) -> dict:
    """Every candidate variant's traces on ``draws`` (per seed, one ``Realization`` per DP
    replica): {variant: (deferred chunks, [per seed: the replicas' traces])}."""
    split = Plan.build(config, topology, num_microbatches).split_backward
    out = {}
    for variant in candidate_variants(topology.num_chunks):
        timeline = timeline_for(config, topology, num_microbatches, split, variant)
        out[variant] = (timeline.deferred, [[run_with_epochs(config, topology, num_microbatches, r, timeline).trace
                                             for r in replicas] for replicas in draws])
    return out


def variant_times(traces: dict, topology: Topology, comm: DPComm) -> dict:
    """{variant: median iteration} with the DP communication overlapped (a deferred chunk's
    reductions after the last task)."""
    return {variant: median([replicas_iteration_time(seed, topology.num_stages, topology.num_chunks, comm,
                                                     overlap_grad_reduce=True, overlap_param_gather=True,
                                                     deferred=deferred) for seed in per_seed])
            for variant, (deferred, per_seed) in traces.items()}


def dp_points(variant: EpochVariant, num_chunks: int) -> int:
    """A stage's DP points under ``variant``: a reduction per chunk kept in the loop, a gather per middle chunk."""
    return num_chunks - len(variant.deferred) + (0 if variant.gathers_before else max(0, num_chunks - 2))


CHOICE_TOLERANCE = 0.005
"""Variants within this share of the fastest median count as equally fast: the one with the
fewest DP points is chosen (its iteration depends least on the draws)."""
CHOICE_TASK_BUDGET = 200_000
"""Simulated tasks one choice may take (the seeds it runs: ``choice_seeds``)."""
CHOICE_SEEDS = 24
"""Seeds a small layout's choice runs: variants' medians lie within a few percent of each other, and
fewer seeds let a variant that is behind on most draws win the choice."""


def choice_seeds(topology: Topology, num_microbatches: int, dp: int = 2) -> int:
    """Seeds a choice runs: up to ``CHOICE_SEEDS``, fewer where a layout's tasks would exceed the
    budget (at least 1)."""
    per_seed = 3 * topology.num_stages * topology.num_chunks * num_microbatches * dp * \
        len(candidate_variants(topology.num_chunks))
    return max(1, min(CHOICE_SEEDS, CHOICE_TASK_BUDGET // per_seed))


def best_variant(times: dict, num_chunks: int) -> EpochVariant:
    """Among the variants within ``CHOICE_TOLERANCE`` of the fastest, the one with the fewest DP
    points (then the faster, then the earlier candidate)."""
    fastest = min(times.values())
    close = [v for v in times if times[v] <= fastest * (1 + CHOICE_TOLERANCE)]
    return min(close, key=lambda v: (dp_points(v, num_chunks), times[v]))


def choose_variant(config: ArbiterConfig, topology: Topology, num_microbatches: int, variability: Variability,
                   comm: DPComm, *, dp: int = 2, seeds=None) -> tuple[EpochVariant, dict]:
    """The variant ``best_variant`` picks from the simulated medians, and every candidate's median;
    ``dp`` replicas each draw their own durations per seed (default: ``choice_seeds`` of them)."""
    seeds = range(choice_seeds(topology, num_microbatches, dp)) if seeds is None else seeds
    draws = [[sample_realization(variability, topology, num_microbatches, 7919 * (seed + 1) + r) for r in range(dp)]
             for seed in seeds]
    times = variant_times(variant_traces(config, topology, num_microbatches, draws), topology, comm)
    return best_variant(times, topology.num_chunks), times


__all__ = ["CHOICE_SEEDS", "CHOICE_TASK_BUDGET", "CHOICE_TOLERANCE", "DPPoint", "EpochBook", "EpochVariant",
           "Timeline", "best_variant", "choice_seeds", "choose_variant", "dp_points", "megatron_orders",
           "policy_orders", "run_with_epochs", "static_timeline", "variant_times", "variant_traces"]
