"""The DP epoch rule, simulated: one replica's iteration under the rule, and its static timeline.

The rule (docs/design/dp-epochs.md) keeps interleaved pipelines' DP replicas independent
between *DP points* while their DP communication overlaps the task loop. This module builds
the rule's static timeline (Megatron's interleaved order, each W right after its B under the
split, at nominal durations) with its DP points and message epochs, and runs the policy's
dry-run engine (``policy/dryrun.py``'s readiness bookkeeping) under the rule:

* a stage dispatches the task holding a DP point only after every task before it in its
  static order and no task after it before it (rule 1);
* before that task, every message of an epoch <= the point's, to or from the stage, has been
  delivered (the barrier of rule 3);
* a message is delivered only once it arrived and no message of a smaller epoch to or from
  its sender or its receiver is still undelivered, and after the receiver passed its DP
  points of smaller index (rounds in epoch order on each rank, rule 3).

``dp_points`` of the result give, per stage and chunk, when the reduction was launched
(``sim/dp_comm.replicas_iteration_time`` takes the slower replica's). Gathers are left to
``dp_comm``'s model. Units of f0.
"""
from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field

from ..policy.actions import Kind, Task
from ..policy.arbiter import ArbiterConfig
from ..policy.dryrun import DeadlockError, DryRun, _Pipeline, _task_time, constant_durations
from ..policy.dryrun import run as dry_run
from ..policy.plan import Plan
from ..policy.topology import Topology
from .variability import Realization

REDUCE, MESSAGE, GATHER = 0, 1, 2  # event classes at equal times (the module docstring's key order)


@dataclass(frozen=True, slots=True)
class DPPoint:
    stage: int
    task: Task
    what: str  # "reduce" (after the task's compute) or "gather" (before it)
    chunk: int  # the chunk whose DP communication it issues


@dataclass(slots=True)
class Timeline:
    """The static timeline: per-stage orders, DP points in key order, message epochs."""

    orders: list[list[Task]]
    points: list[DPPoint]  # G_0 < G_1 < ... (key order)
    epoch: dict = field(default_factory=dict)  # (producer stage, task) -> epoch of the message it sends
    index: dict = field(default_factory=dict)  # (stage, task) -> its position in orders[stage]
    point_of: dict = field(default_factory=dict)  # (stage, task) -> index g of the DP point it holds


def megatron_orders(topology: Topology, num_microbatches: int, split: bool) -> list[list[Task]]:
    """Megatron's interleaved 1F1B order per stage (its strict dry run); W right after its B if ``split``."""
    plan = Plan.build(ArbiterConfig(hint="1f1b", strict=True), topology, num_microbatches)
    orders = dry_run(plan.arbiters(), topology, duration=constant_durations(False)).orders
    if not split:
        return orders
    return [[t for task in order for t in ((task, Task(Kind.W, task.microbatch, task.chunk))
                                           if task.kind is Kind.B else (task,))] for order in orders]


def policy_orders(config: ArbiterConfig, topology: Topology, num_microbatches: int) -> list[list[Task]]:
    """The policy's own order per stage: its dry run at nominal durations (W where it defers them)."""
    plan = Plan.build(config, topology, num_microbatches)
    return dry_run(plan.arbiters(), topology, duration=constant_durations(plan.split_backward)).orders


def static_timeline(topology: Topology, num_microbatches: int, split: bool,
                    orders: list[list[Task]] | None = None) -> Timeline:
    """Run the static orders (default: Megatron's, ``megatron_orders``) at nominal durations
    (F 1, B 2; split B = W = 1) without latency."""
    orders = orders or megatron_orders(topology, num_microbatches, split)
    pp, chunks = topology.num_stages, topology.num_chunks
    nominal = constant_durations(split)
    end: dict = {}  # (stage, task) -> end time
    start: dict = {}
    free = [0.0] * pp
    position = [0] * pp
    left = sum(map(len, orders))

    def input_time(stage: int, task: Task):
        if task.kind is Kind.W:
            return end.get((stage, Task(Kind.B, task.microbatch, task.chunk)))
        if task.kind is Kind.F:
            up = topology.upstream(stage, task.chunk)
            return 0.0 if up is None else end.get((up[0], Task(Kind.F, task.microbatch, up[1])))
        down = topology.downstream(stage, task.chunk)
        own = end.get((stage, Task(Kind.F, task.microbatch, task.chunk)))
        if down is None or own is None:
            return own
        grad = end.get((down[0], Task(Kind.B, task.microbatch, down[1])))
        return None if grad is None else max(own, grad)

    while left:
        progressed = False
        for stage in range(pp):
            while position[stage] < len(orders[stage]):
                task = orders[stage][position[stage]]
                ready = input_time(stage, task)
                if ready is None:
                    break
                start[(stage, task)] = begin = max(free[stage], ready)
                end[(stage, task)] = free[stage] = begin + nominal(stage, task)
                position[stage] += 1
                left -= 1
                progressed = True
        if not progressed:
            raise DeadlockError("the static orders cannot run")  # Megatron's order always can

    keyed = []
    for stage, order in enumerate(orders):
        closing = Kind.W if split else Kind.B
        last = {task.chunk: task for task in order if task.kind is closing}  # each chunk's last B / W
        first = {}
        for task in order:
            if task.kind is Kind.F:
                first.setdefault(task.chunk, task)
        for chunk, task in last.items():
            keyed.append(((end[(stage, task)], REDUCE, stage, chunk), DPPoint(stage, task, "reduce", chunk)))
        for chunk in range(1, chunks - 1):  # chunk c's first forward gathers chunk c + 1
            task = first[chunk]
            keyed.append(((start[(stage, task)], GATHER, stage, chunk), DPPoint(stage, task, "gather", chunk + 1)))
    keyed.sort(key=lambda item: item[0])
    keys = [key for key, _ in keyed]
    timeline = Timeline(orders=orders, points=[point for _, point in keyed])
    for stage, order in enumerate(orders):
        for i, task in enumerate(order):
            timeline.index[(stage, task)] = i
            if task.kind is not Kind.W:
                timeline.epoch[(stage, task)] = bisect.bisect_left(keys, (end[(stage, task)], MESSAGE, -1, -1))
    for g, point in enumerate(timeline.points):
        timeline.point_of[(point.stage, point.task)] = g
    return timeline


@dataclass(slots=True)
class EpochRun:
    result: DryRun
    reduce_launched: list  # [stage][chunk]: when the chunk's reductions were launched


class _EpochPipeline(_Pipeline):
    """Readiness bookkeeping with the rule's delivery holds."""

    def __init__(self, arbiters, topology, latency, timeline: Timeline) -> None:
        super().__init__(arbiters, topology, latency)
        self.timeline = timeline
        pp, k = topology.num_stages, len(timeline.points) + 1
        self.pending = [[0] * (k + 1) for _ in range(pp)]  # per stage: undelivered incident messages per epoch
        for (stage, task), epoch in timeline.epoch.items():
            other = self._peer(stage, task)
            if other is not None:
                self.pending[stage][epoch] += 1
                self.pending[other][epoch] += 1
        self.lowest = [0] * pp  # per stage: the smallest epoch with an undelivered message
        for stage in range(pp):
            self._advance_lowest(stage)
        self.passed = [0] * pp  # per stage: how many of its own DP points it dispatched
        self.own_points = [[g for g, p in enumerate(timeline.points) if p.stage == s] for s in range(pp)]
        self.held: list = []  # (epoch, seq, src, dst, payload) arrived, not delivered
        self._held_seq = 0

    def _peer(self, stage: int, task: Task):
        nxt = (self.topology.downstream if task.kind is Kind.F else self.topology.upstream)(stage, task.chunk)
        return None if nxt is None else nxt[0]

    def _advance_lowest(self, stage: int) -> None:
        counts = self.pending[stage]
        while self.lowest[stage] < len(counts) and counts[self.lowest[stage]] == 0:
            self.lowest[stage] += 1

    def epoch_of(self, payload, dst: int) -> int:
        """The epoch of a message to ``dst``; the payload names the consumer's chunk."""
        direction, mb, chunk = payload
        src, produced_by = (self.topology.upstream if direction == "F" else self.topology.downstream)(dst, chunk)
        return self.timeline.epoch[(src, Task(Kind.F if direction == "F" else Kind.B, mb, produced_by))]

    def passed_below(self, stage: int, epoch: int) -> bool:
        """Has ``stage`` dispatched every DP point of its own with index < ``epoch``?"""
        own = self.own_points[stage]
        return self.passed[stage] >= bisect.bisect_left(own, epoch)

    def arrive(self, stage: int, payload) -> None:  # arrived over the link: held until deliverable
        src = payload[3]
        epoch = self.epoch_of(payload[:3], stage)
        heapq.heappush(self.held, (epoch, self._held_seq, src, stage, payload[:3]))
        self._held_seq += 1
        self.release()

    def send(self, src: int, dst: int, time: float, latency: float, payload) -> None:
        super().send(src, dst, time, latency, (*payload, src))

    def release(self) -> bool:
        """Deliver every held message the epoch order allows; True if any was."""
        delivered, kept = False, []
        while self.held:
            item = heapq.heappop(self.held)
            epoch, _, src, dst, payload = item
            if self.lowest[src] >= epoch and self.lowest[dst] >= epoch and self.passed_below(dst, epoch):
                super().arrive(dst, payload)
                for stage in (src, dst):
                    self.pending[stage][epoch] -= 1
                    self._advance_lowest(stage)
                delivered = True
                self.held.extend(kept)
                heapq.heapify(self.held)
                kept = []
            else:
                kept.append(item)
        self.held = kept
        heapq.heapify(self.held)
        return delivered


def run_with_epochs(config: ArbiterConfig, topology: Topology, num_microbatches: int, realization: Realization,
                    timeline: Timeline | None = None) -> EpochRun:
    """One replica's iteration under the rule (module docstring), with its trace."""
    plan = Plan.build(config, topology, num_microbatches)
    split = plan.split_backward
    timeline = timeline or static_timeline(topology, num_microbatches, split)
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
    reduce_launched = [[0.0] * topology.num_chunks for _ in range(pp)]
    dispatched_before = [0] * pp  # per stage: tasks dispatched that come before its next DP point
    now = 0.0
    touched = set(range(pp))

    def allowed(stage: int) -> set:
        own = pipe.own_points[stage]
        if pipe.passed[stage] == len(own):
            return pipe.ready[stage]
        g = own[pipe.passed[stage]]
        point = timeline.points[g]
        limit = timeline.index[(stage, point.task)]
        ok = {t for t in pipe.ready[stage] if timeline.index[(stage, t)] < limit}
        if point.task in pipe.ready[stage] and dispatched_before[stage] == limit and pipe.lowest[stage] > g:
            ok.add(point.task)
        return ok

    while True:
        for stage in sorted(touched):
            if busy_until[stage] is not None:
                continue
            choices = allowed(stage)
            if not choices:
                continue
            task = arbiters[stage].choose(choices)
            if task is None:
                # the hint waits for a task the rule holds back (beyond the DP point, or a message the
                # epoch order holds): the interval's earliest admitted task instead (the rule's premise)
                frontier = arbiters[stage].admission_frontier()
                admitted = [t for t in choices if t.kind is not Kind.F or t.microbatch <= frontier]
                task = min(admitted, key=lambda t: timeline.index[(stage, t)], default=None)
            if task is None:
                continue
            pipe.ready[stage].discard(task)
            arbiters[stage].record(task)
            own = pipe.own_points[stage]
            g = own[pipe.passed[stage]] if pipe.passed[stage] < len(own) else None
            length = _task_time(arbiters[stage], duration, stage, task)
            if g is not None and timeline.points[g].task == task:
                pipe.passed[stage] += 1
                point = timeline.points[g]
                if point.what == "reduce":
                    reduce_launched[stage][point.chunk] = now + length
                nxt = own[pipe.passed[stage]] if pipe.passed[stage] < len(own) else None
                dispatched_before[stage] = sum(
                    1 for t in arbiters[stage].dispatched
                    if nxt is None or timeline.index[(stage, t)] < timeline.index[(stage, timeline.points[nxt].task)])
                if pipe.release():
                    touched.update(range(pp))
            else:
                dispatched_before[stage] += 1
            busy_until[stage] = now + length
            busy[stage] += length
            trace.append((stage, task, now, now + length))
            pipe.push(now + length, 1, stage, task)
        if not pipe.events:
            break
        now = pipe.events[0][0]
        touched = set()
        while pipe.events and pipe.events[0][0] == now:
            _, _, kind, stage, payload = heapq.heappop(pipe.events)
            touched.add(stage)
            if kind == 1:
                busy_until[stage] = None
                pipe.finish(stage, payload, now)
            else:
                before = {s: len(pipe.ready[s]) for s in range(pp)}
                pipe.arrive(stage, payload)
                touched.update(s for s in range(pp) if len(pipe.ready[s]) != before[s] or s == stage)
        # a delivery can unblock a barrier anywhere
        touched.update(s for s in range(pp) if busy_until[s] is None)
    if not all(a.done for a in arbiters):
        states = "\n".join(f"  {a.describe()} ready={sorted(map(str, pipe.ready[a.stage]))} "
                           f"allowed={sorted(map(str, allowed(a.stage)))} passed={pipe.passed[a.stage]}"
                           for a in arbiters)
        raise DeadlockError(f"the epoch rule stalled at t={now:.3f} with work left:\n{states}")
    if not math.isfinite(now):
        raise ValueError("non-finite iteration time")
    result = DryRun(policy=config.parsed_hint.name + "+epochs", makespan=now, busy=busy,
                    peak_in_flight=[a.peak_in_flight for a in arbiters],
                    orders=[list(a.dispatched) for a in arbiters], trace=trace)
    return EpochRun(result=result, reduce_launched=reduce_launched)


__all__ = ["DPPoint", "EpochRun", "Timeline", "megatron_orders", "policy_orders", "run_with_epochs", "static_timeline"]
