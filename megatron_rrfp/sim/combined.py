"""Megatron's combined 1F1B (``--overlap-moe-expert-parallel-comm``) as a fixed order of steps, for
the simulator: beside rrfp's paired and unpaired policies, what Megatron itself would run.

Megatron's interleaved schedule with the flag (megatron-core ``pipeline_parallel/schedules.py``,
``get_pp_rank_microbatches``) runs one more warm-up forward than its interleaved 1F1B, then each
steady-state step is one combined step — the next forward with the oldest pending backward, run
together by ``combined_forward_backward_step`` — then the cool-down backwards alone. With PP > 1
Megatron offers it only with virtual stages; ``combined_orders`` refuses one chunk there.

A step starts when the stage is free and every task in it is ready (readiness as in
``policy/dryrun.py``); a pair takes ``Realization.pair_duration``; its messages leave at its end.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from ..policy.actions import Kind, Task, peak_in_flight
from ..policy.hints import megatron_1f1b_order
from ..policy.topology import Topology
from .variability import Realization


def combined_orders(topology: Topology, num_microbatches: int) -> list[list[tuple[Task, ...]]]:
    """Per stage, Megatron's combined-1F1B steps: warm-up forwards (its interleaved warm-up + 1),
    (forward, backward) pairs, cool-down backwards."""
    if topology.num_chunks < 2 and topology.num_stages > 1:
        raise ValueError("Megatron's combined 1F1B needs virtual stages (chunks >= 2) with PP > 1")
    steps = []
    for stage in range(topology.num_stages):
        order = megatron_1f1b_order(stage, topology, num_microbatches)
        forwards = [t for t in order if t.kind is Kind.F]
        backwards = [t for t in order if t.kind is Kind.B]
        # the interleaved warm-up W, + 1: as many as the plain order runs before its first backward
        warmup = sum(1 for t in order[:order.index(backwards[0])] if t.kind is Kind.F)
        stage_steps: list[tuple[Task, ...]] = [(f,) for f in forwards[:warmup]]
        for k in range(len(forwards) - warmup):
            stage_steps.append((forwards[warmup + k], backwards[k]))
        stage_steps += [(b,) for b in backwards[len(forwards) - warmup:]]
        steps.append(stage_steps)
    return steps


@dataclass(slots=True)
class CombinedRun:
    makespan: float
    peak_in_flight: list[int]
    pairs: int
    busy: list[float]
    """Per stage, the time it computed (a pair counted once)."""

    @property
    def bubble_fraction(self) -> float:
        """The idle share of the pipeline, as ``DryRun.bubble_fraction``."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


def simulate_combined(topology: Topology, num_microbatches: int, realization: Realization) -> CombinedRun:
    """Megatron's combined 1F1B under ``realization``'s durations and latencies."""
    steps = combined_orders(topology, num_microbatches)
    pp = topology.num_stages
    position, free_at, busy = [0] * pp, [0.0] * pp, [0.0] * pp
    arrived: list[set] = [set() for _ in range(pp)]  # ("F" | "B", mb, chunk) messages here
    done: list[set] = [set() for _ in range(pp)]
    link_clear: dict = {}
    events: list = []
    for mb in range(num_microbatches):
        arrived[0].add(("F", mb, 0))

    def ready(stage: int, task: Task) -> bool:
        key = (task.microbatch, task.chunk)
        if task.kind is Kind.F:
            return ("F", *key) in arrived[stage]
        return Task(Kind.F, *key) in done[stage] and (
            topology.downstream(stage, task.chunk) is None or ("B", *key) in arrived[stage])

    def send(src: int, dst: int, at: float, latency: float, payload) -> None:
        arrival = max(at + latency, link_clear.get((src, dst), 0.0)) if src != dst else at
        link_clear[(src, dst)] = arrival
        heapq.heappush(events, (arrival, len(events), dst, payload))

    now = 0.0
    while True:
        for stage in range(pp):
            while position[stage] < len(steps[stage]) and free_at[stage] <= now:
                step = steps[stage][position[stage]]
                if not all(ready(stage, task) for task in step):
                    break
                position[stage] += 1
                if len(step) == 2:
                    length = realization.pair_duration(stage, step[0], step[1])
                else:
                    length = realization.duration(stage, step[0], False)
                end = now + length
                free_at[stage] = end
                busy[stage] += length
                heapq.heappush(events, (end, len(events), stage, ("done", step)))
        if not events:
            break
        now, _, stage, payload = heapq.heappop(events)
        if payload[0] == "done":
            for task in payload[1]:
                done[stage].add(task)
                nxt = (topology.downstream(stage, task.chunk) if task.kind is Kind.F
                       else topology.upstream(stage, task.chunk))
                if nxt is not None:
                    table = realization.activation_latency if task.kind is Kind.F else realization.gradient_latency
                    latency = table[stage][task.chunk][task.microbatch]
                    send(stage, nxt[0], now, latency, (task.kind.value, task.microbatch, nxt[1]))
        else:
            arrived[stage].add(payload)
    if any(position[s] < len(steps[s]) for s in range(pp)):
        raise RuntimeError(f"Megatron's combined order stalled at t={now}: positions {position}")
    peaks = [peak_in_flight([t for step in stage_steps for t in sorted(step, key=lambda t: t.kind is Kind.F)])
             for stage_steps in steps]
    return CombinedRun(makespan=now, peak_in_flight=peaks,
                       pairs=sum(len(step) == 2 for stage_steps in steps for step in stage_steps), busy=busy)


__all__ = ["CombinedRun", "combined_orders", "simulate_combined"]
