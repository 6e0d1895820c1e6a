"""A dry run of one iteration: every stage's ``Arbiter`` driven by discrete events.

The same readiness rules as the executor (``topology.py``): F(mb, c) is ready when its
activation arrived (virtual stage 0: always), B(mb, c) when the local F finished and the
output gradient arrived (last virtual stage: right after its own F), W(mb, c) after
B(mb, c). A stage runs one task at a time; every produced activation / gradient is a
message that arrives ``latency`` after its task finished, FIFO per directed link (one
stream per neighbour pair, as in the real transport).

Durations and latencies are caller-supplied functions, so the same engine serves the
policy's own checks (constant durations: materialising a rule hint's fixed order,
proving a strict order can run) and the simulator (``sim/``, sampled variability).
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

from .actions import Kind, Task
from .arbiter import Arbiter
from .topology import Topology

Duration = Callable[[int, Task], float]
"""(stage, task) -> how long the task runs."""
Latency = Callable[[int, Task], float]
"""(stage, producing task) -> how long its message travels (F: activation, B: gradient)."""
PairDuration = Callable[[int, Task, Task, bool], float]
"""(stage, forward, backward, whether the backward defers its W) -> how long the two run as one combined task."""


class DeadlockError(RuntimeError):
    """The arbiters stopped with work left: nothing allowed is ready anywhere."""


def _checked_time(value: float, what: str, stage: int, task: Task) -> float:
    """A duration or latency the event loop can order: NaN never compares equal to the
    clock (the loop would stop advancing) and infinity never ends."""
    try:
        ok = math.isfinite(value) and value >= 0
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"{what} of task {task} on stage {stage} is {value!r}: durations and latencies must be "
                         "finite and >= 0 (check the variability model: f0, sigmas, c50, factors)")
    return value


@dataclass(slots=True)
class DryRun:
    policy: str
    makespan: float
    busy: list[float]
    peak_in_flight: list[int]
    orders: list[list[Task]]
    trace: list[tuple[int, Task, float, float]] = field(default_factory=list)
    """(stage, task, start, end) per task, when asked for (a pair's two tasks share one span)."""
    pairs: list[list[tuple[Task, Task]]] = field(default_factory=list)
    """Per stage, the (F, B) it ran together as combined tasks (``ArbiterConfig.pair_forward_backward``)."""

    @property
    def bubble_fraction(self) -> float:
        """1 - (sum of stage busy time) / (stages x makespan): the idle share of the pipeline."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


def constant_durations(split_backward: bool) -> Duration:
    """F = 1, B = 2 (split backward: B = W = 1): the nominal 1F1B cost model."""
    backward = 1.0 if split_backward else 2.0
    return lambda stage, task: 1.0 if task.kind is Kind.F else (backward if task.kind is Kind.B else 1.0)


def no_latency(stage: int, task: Task) -> float:
    return 0.0


_ARRIVE, _FINISH = 0, 1


class _Pipeline:
    """Readiness bookkeeping of every stage plus the event queue."""

    def __init__(self, arbiters: Sequence[Arbiter], topology: Topology, latency: Latency) -> None:
        self.arbiters, self.topology, self.latency = list(arbiters), topology, latency
        pp = topology.num_stages
        self.split = self.arbiters[0].split_backward
        self.ready: list[set[Task]] = [set() for _ in range(pp)]
        self.forward_done: list[set[tuple[int, int]]] = [set() for _ in range(pp)]
        self.grad_arrived: list[set[tuple[int, int]]] = [set() for _ in range(pp)]
        self.link_clear: dict[tuple[int, int], float] = {}
        self.events: list = []
        self._seq = 0
        self.ready[0].update(Task(Kind.F, mb, 0) for mb in range(self.arbiters[0].num_microbatches))

    def push(self, time: float, kind: int, stage: int, payload) -> None:
        heapq.heappush(self.events, (time, self._seq, kind, stage, payload))
        self._seq += 1

    def send(self, src: int, dst: int, time: float, latency: float, payload) -> None:
        link = (src, dst)
        arrival = time if src == dst else max(time + latency, self.link_clear.get(link, 0.0))
        if not math.isfinite(arrival):
            raise ValueError(f"message {payload} from stage {src} to stage {dst} would arrive at {arrival!r}: "
                             "durations and latencies must be finite and >= 0")
        self.link_clear[link] = arrival  # FIFO: a message never overtakes an earlier one on its link
        self.push(arrival, _ARRIVE, dst, payload)

    def _backward_maybe_ready(self, stage: int, key: tuple[int, int]) -> None:
        if key in self.forward_done[stage] and key in self.grad_arrived[stage]:
            self.ready[stage].add(Task(Kind.B, *key))

    def finish(self, stage: int, task: Task, time: float) -> None:
        key = (task.microbatch, task.chunk)
        forward_only = self.arbiters[stage].forward_only
        if task.kind is Kind.F:
            self.forward_done[stage].add(key)
            nxt = self.topology.downstream(stage, task.chunk)
            if nxt is not None:
                latency = _checked_time(self.latency(stage, task), "message latency", stage, task)
                self.send(stage, nxt[0], time, latency, ("F", task.microbatch, nxt[1]))
            elif not forward_only:
                self.grad_arrived[stage].add(key)  # the loss is its own output gradient
                self._backward_maybe_ready(stage, key)
        elif task.kind is Kind.B:
            if self.split:
                self.ready[stage].add(Task(Kind.W, *key))
            prev = self.topology.upstream(stage, task.chunk)
            if prev is not None:
                latency = _checked_time(self.latency(stage, task), "message latency", stage, task)
                self.send(stage, prev[0], time, latency, ("B", task.microbatch, prev[1]))

    def arrive(self, stage: int, payload) -> None:
        direction, mb, chunk = payload
        if direction == "F":
            self.ready[stage].add(Task(Kind.F, mb, chunk))
        else:
            self.grad_arrived[stage].add((mb, chunk))
            self._backward_maybe_ready(stage, (mb, chunk))


def _task_time(arbiter: Arbiter, duration: Duration, stage: int, task: Task) -> float:
    """A B the byte budget ran unsplit (``Arbiter.defers_weight``) takes its W's time too; that W is a no-op."""
    if task.kind is Kind.F or not arbiter.split_backward or arbiter.defers_weight(task):
        return _checked_time(duration(stage, task), "duration", stage, task)
    if task.kind is Kind.W:
        return 0.0
    weight = Task(Kind.W, task.microbatch, task.chunk)
    return (_checked_time(duration(stage, task), "duration", stage, task)
            + _checked_time(duration(stage, weight), "duration", stage, weight))


def run(arbiters: Sequence[Arbiter], topology: Topology, *, duration: Duration, latency: Latency = no_latency,
        name: str = "", record_trace: bool = False, pair_duration: Optional[PairDuration] = None) -> DryRun:
    """Run one iteration; raises ``DeadlockError`` if the arbiters stall with work left and
    ValueError for a duration or latency that is negative, NaN or infinite. A pair the arbiter
    dispatches (``Arbiter.take_partner``) runs ``pair_duration`` (default: its halves in series,
    the backward with its W unless it defers it) and both its messages leave when it ends, as from
    megatron-core's combined step."""
    pipe = _Pipeline(arbiters, topology, latency)
    pp = topology.num_stages
    busy_until: list[Optional[float]] = [None] * pp
    busy = [0.0] * pp
    trace: list[tuple[int, Task, float, float]] = []
    now = 0.0
    touched = set(range(pp))
    while True:
        # decide only after every event of this instant is applied, and only where something
        # changed: an arbiter given the same state and ready set decides the same again
        for stage in sorted(touched):
            if busy_until[stage] is None and pipe.ready[stage]:
                task = pipe.arbiters[stage].choose(pipe.ready[stage])
                if task is not None:
                    arbiter = pipe.arbiters[stage]
                    partner = arbiter.take_partner(task)
                    group = (task,) if partner is None else (task, partner)
                    for member in group:
                        pipe.ready[stage].discard(member)
                    if partner is None:
                        arbiter.record(task)
                        length = _task_time(arbiter, duration, stage, task)
                    else:
                        arbiter.record_pair(task, partner)
                        forward, backward = arbiter.pairs[-1]
                        length = (_checked_time(duration(stage, forward), "duration", stage, forward)
                                  + _task_time(arbiter, duration, stage, backward)) if pair_duration is None else \
                            _checked_time(pair_duration(stage, forward, backward, arbiter.defers_weight(backward)),
                                          "pair duration", stage, task)
                    busy_until[stage] = now + length
                    busy[stage] += length
                    for member in group:
                        if record_trace:
                            trace.append((stage, member, now, now + length))
                        pipe.push(now + length, _FINISH, stage, member)
        if not pipe.events:
            break
        now = pipe.events[0][0]
        touched = set()
        while pipe.events and pipe.events[0][0] == now:
            _, _, kind, stage, payload = heapq.heappop(pipe.events)
            touched.add(stage)
            if kind == _FINISH:
                busy_until[stage] = None
                pipe.finish(stage, payload, now)
            else:
                pipe.arrive(stage, payload)
    if not all(a.done for a in pipe.arbiters):
        states = "\n".join(f"  {a.describe()} ready={sorted(map(str, pipe.ready[a.stage]))}" for a in pipe.arbiters)
        raise DeadlockError(f"policy {name or pipe.arbiters[0].hint.name} stalled at t={now:.3f} with work left:\n"
                            f"{states}")
    return DryRun(policy=name or pipe.arbiters[0].hint.name, makespan=now, busy=busy,
                  peak_in_flight=[a.peak_in_flight for a in pipe.arbiters],
                  orders=[list(a.dispatched) for a in pipe.arbiters], trace=trace,
                  pairs=[list(a.pairs) for a in pipe.arbiters])


__all__ = ["DeadlockError", "DryRun", "PairDuration", "constant_durations", "no_latency", "run"]
