"""The DP epoch rule's bookkeeping (docs/design/dp-epochs.md): the static timeline and one rank's book.

Pure Python, like the rest of ``policy``, so the simulator (``sim/dp_epochs.py``) and a runtime
drive the same rule. ``static_timeline`` runs Megatron's interleaved order (each W right after
its B under the split) at nominal durations without latency and returns the DP points in key
order and every message's epoch; ``EpochBook`` is one stage's view of it: which tasks the rule
allows now (the tasks before the next DP point; the DP task itself once every task before it is
dispatched and every message of an epoch up to the point's, to or from the stage, is in an issued
round), whether a round of an epoch may be issued now (no smaller epoch open here, the stage past
its own DP points of smaller index), and which task to run where the hint waits for one the rule
holds back (the interval's earliest admitted task).
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Optional

from .actions import Kind, Task
from .arbiter import ArbiterConfig
from .budget import BufferLimitError, is_auto, megatron_peak_in_flight, resolve_buffer_limit
from .dryrun import DeadlockError, constant_durations
from .dryrun import run as dry_run
from .plan import Plan
from .topology import Topology

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
    deferred: frozenset = frozenset()  # chunks reduced after the loop (no reduction point)
    gathers_before: bool = False  # every chunk's all-gathers launched before the first task (no gather point)

    def message_epoch(self, topology: Topology, dst: int, forward: bool, microbatch: int, chunk: int) -> int:
        """The epoch of the message stage ``dst`` receives for its ``chunk`` (an activation if
        ``forward``, else a gradient): its producer's task is one chunk away."""
        src, produced_by = (topology.upstream if forward else topology.downstream)(dst, chunk)
        return self.epoch[(src, Task(Kind.F if forward else Kind.B, microbatch, produced_by))]


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
                    orders: list[list[Task]] | None = None, deferred: frozenset = frozenset(),
                    gathers_before: bool = False) -> Timeline:
    """Run the static orders (default: Megatron's, ``megatron_orders``) at nominal durations
    (F 1, B 2; split B = W = 1) without latency. The chunks in ``deferred`` reduce after the
    task loop, so their last B / W is no DP point; ``gathers_before``: every chunk's
    all-gathers are launched before the first task, so no forward is a DP point."""
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
            if chunk in deferred:
                continue
            keyed.append(((end[(stage, task)], REDUCE, stage, chunk), DPPoint(stage, task, "reduce", chunk)))
        for chunk in range(1, chunks - 1) if not gathers_before else ():  # chunk c's first F gathers c + 1
            task = first[chunk]
            keyed.append(((start[(stage, task)], GATHER, stage, chunk), DPPoint(stage, task, "gather", chunk + 1)))
    keyed.sort(key=lambda item: item[0])
    keys = [key for key, _ in keyed]
    timeline = Timeline(orders=orders, points=[point for _, point in keyed], deferred=frozenset(deferred),
                        gathers_before=gathers_before)
    for stage, order in enumerate(orders):
        for i, task in enumerate(order):
            timeline.index[(stage, task)] = i
            if task.kind is not Kind.W:
                timeline.epoch[(stage, task)] = bisect.bisect_left(keys, (end[(stage, task)], MESSAGE, -1, -1))
    for g, point in enumerate(timeline.points):
        timeline.point_of[(point.stage, point.task)] = g
    return timeline


class EpochBook:
    """One stage's side of the rule over one iteration (module docstring)."""

    def __init__(self, timeline: Timeline, topology: Topology, stage: int) -> None:
        self.timeline, self.topology, self.stage = timeline, topology, stage
        self.points = [g for g, p in enumerate(timeline.points) if p.stage == stage]
        self.open = [0] * (len(timeline.points) + 1)  # incident messages per epoch not yet in an issued round
        for (producer, task), epoch in timeline.epoch.items():
            peer = self.peer(producer, task)
            if peer is not None and stage in (producer, peer):
                self.open[epoch] += 1
        self.lowest = 0
        self._advance()
        self.passed = 0  # own DP points dispatched
        self._before_next = 0  # tasks dispatched that come before the next own DP point
        # this stage's forwards in static order (their epochs never decrease along it) and the first not run
        self._forwards = [t for t in timeline.orders[stage] if t.kind is Kind.F]
        self._forwards_run: set = set()
        self._next_forward = 0

    def peer(self, stage: int, task: Task) -> Optional[int]:
        """The stage that receives what ``task`` on ``stage`` sends, None if nothing."""
        nxt = (self.topology.downstream if task.kind is Kind.F else self.topology.upstream)(stage, task.chunk)
        return None if nxt is None else nxt[0]

    def _advance(self) -> None:
        while self.lowest < len(self.open) and self.open[self.lowest] == 0:
            self.lowest += 1

    # -- rounds -------------------------------------------------------------------------
    def may_issue(self, epoch: int) -> bool:
        """May a round of ``epoch`` be issued on this stage now (rule 3)?"""
        return self.lowest >= epoch and self.passed >= bisect.bisect_left(self.points, epoch)

    def issued(self, epoch: int, count: int = 1) -> None:
        """``count`` incident messages of ``epoch`` are now in issued rounds."""
        self.open[epoch] -= count
        if self.open[epoch] < 0:
            raise RuntimeError(f"stage {self.stage}: more messages of epoch {epoch} issued than the timeline has")
        self._advance()

    # -- tasks --------------------------------------------------------------------------
    @property
    def next_point(self) -> Optional[int]:
        return self.points[self.passed] if self.passed < len(self.points) else None

    def allowed(self, ready) -> set:
        """The ready tasks the rule lets this stage dispatch now (rules 1 and 3, and forwards in
        epoch order: a forward may not take the memory an earlier epoch's forward still needs)."""
        while self._next_forward < len(self._forwards) and self._forwards[self._next_forward] in self._forwards_run:
            self._next_forward += 1
        if self._next_forward < len(self._forwards):
            bound = self.timeline.epoch[(self.stage, self._forwards[self._next_forward])]
            ready = {t for t in ready if t.kind is not Kind.F or self.timeline.epoch[(self.stage, t)] <= bound}
        g = self.next_point
        if g is None:
            return set(ready)
        point = self.timeline.points[g].task
        limit = self.timeline.index[(self.stage, point)]
        ok = {t for t in ready if self.timeline.index[(self.stage, t)] < limit}
        if point in ready and self._before_next == limit and self.lowest > g:
            ok.add(point)
        return ok

    def fallback(self, choices, admission_frontier: int) -> Optional[Task]:
        """Where the hint waits: the earliest (static order) of ``choices`` the memory rule admits."""
        admitted = [t for t in choices if t.kind is not Kind.F or t.microbatch <= admission_frontier]
        return min(admitted, key=lambda t: self.timeline.index[(self.stage, t)], default=None)

    def dispatched(self, task: Task) -> Optional[DPPoint]:
        """Record a dispatch; the DP point it holds, if it holds this stage's next one."""
        if task.kind is Kind.F:
            self._forwards_run.add(task)
        g = self.next_point
        if g is None or self.timeline.points[g].task != task:
            self._before_next += 1
            return None
        self.passed += 1
        # nothing after the point was dispatched before it: everything up to it is, and nothing else
        self._before_next = self.timeline.index[(self.stage, task)] + 1
        return self.timeline.points[g]


@dataclass(frozen=True, slots=True)
class EpochVariant:
    """Which static timeline the rule follows, and which DP collectives leave the loop.

    ``order``: "megatron" (Megatron's interleaved order, each W after its B) or "policy" (the
    policy's own nominal dry run). ``deferred``: chunks whose reductions launch after the last
    task (no DP point, as ``after-loop`` does for every chunk); ``gathers_before``: every
    chunk's all-gathers launch before the first task. Fewer points free the order; each
    collective moved out of the loop stops overlapping compute (or, an all-gather, overlaps
    the first chunks' forwards only)."""

    order: str = "megatron"
    deferred: frozenset = frozenset()
    gathers_before: bool = False

    def __str__(self) -> str:
        out = [self.order + " order"]
        if self.deferred:
            out.append(f"chunks {','.join(map(str, sorted(self.deferred)))} reduced after the loop")
        if self.gathers_before:
            out.append("all-gathers before it")
        return ", ".join(out)


DEFAULT_VARIANT = EpochVariant()


def candidate_variants(num_chunks: int) -> list[EpochVariant]:
    """Every variant a job may choose: both orders, deferring chunks 0 .. k - 1 for each k
    (chunk 0 completes last, so its reduction overlaps least), and no DP point at all."""
    variants = [EpochVariant(order, frozenset(range(k))) for order in ("megatron", "policy")
                for k in range(num_chunks + 1)]
    if num_chunks > 2:  # with two chunks, deferring both leaves no point already
        variants.append(EpochVariant("megatron", frozenset(range(num_chunks)), gathers_before=True))
    return variants


@functools.lru_cache(maxsize=64)
def _timeline(topology: Topology, num_microbatches: int, split: bool, variant: EpochVariant,
              policy_config: Optional[ArbiterConfig]) -> Timeline:
    orders = None if policy_config is None else policy_orders(policy_config, topology, num_microbatches)
    return static_timeline(topology, num_microbatches, split, orders, variant.deferred, variant.gathers_before)


def megatron_timeline(topology: Topology, num_microbatches: int, split: bool) -> Timeline:
    """``static_timeline`` of Megatron's order, made once per layout (the runtime's every call reads it)."""
    return _timeline(topology, num_microbatches, split, DEFAULT_VARIANT, None)


def timeline_for(config: ArbiterConfig, topology: Topology, num_microbatches: int, split: bool,
                 variant: EpochVariant = DEFAULT_VARIANT) -> Timeline:
    """The static timeline a job uses (docs/design/dp-epochs.md): Megatron's order where the
    buffer limit holds Megatron's own peak and ``variant`` asks for it, else the policy's
    nominal dry run at that limit (a valid execution the memory rule admits). Read from the
    configured limit, not a rank's measured one, so every rank of every replica has the same
    timeline; ``auto`` reads Megatron's."""
    try:
        peak = megatron_peak_in_flight(topology, num_microbatches)
    except BufferLimitError:  # a layout Megatron's interleaved schedule refuses
        peak = None
    limit = peak if is_auto(config.buffer_limit) and peak is not None else \
        resolve_buffer_limit(config.buffer_limit, topology, num_microbatches)
    if peak is not None and limit >= peak and variant.order == "megatron":
        return _timeline(topology, num_microbatches, split, variant, None)
    own = dataclasses.replace(config, buffer_limit=limit, memory_bytes=None)
    return _timeline(topology, num_microbatches, split, variant, own)


def choose(book: EpochBook, arbiter, ready) -> Optional[Task]:
    """The task a stage runs under the rule: the hint's choice among the tasks the rule allows,
    or, where the hint waits, the interval's earliest admitted task (``EpochBook.fallback``).
    The simulator and the executor both call this. Without any DP point the rule is void."""
    if not book.timeline.points:
        return arbiter.choose(ready)
    allowed = book.allowed(ready)
    if not allowed:
        return None
    task = arbiter.choose(allowed)
    return task if task is not None else book.fallback(allowed, arbiter.admission_frontier())


__all__ = ["DEFAULT_VARIANT", "DPPoint", "EpochBook", "EpochVariant", "Timeline", "candidate_variants", "choose",
           "megatron_orders", "megatron_timeline", "policy_orders", "static_timeline", "timeline_for"]
