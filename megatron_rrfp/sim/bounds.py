"""Lower bounds on the makespan of one iteration (no schedule can beat them)."""
from __future__ import annotations

import heapq
import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import Optional

import numpy as np

from ..policy.actions import peak_in_flight
from ..policy.arbiter import ArbiterConfig
from ..policy.plan import Plan
from ..policy.topology import Topology
from .variability import Realization


def lower_bound(realization: Realization, topology: Topology, num_microbatches: int,
                split_backward: bool = False, in_flight_caps: Optional[Sequence[int]] = None) -> float:
    """A makespan no schedule can beat on this realisation, in the realisation's unit (f0).

    Virtual stage v = c * PP + s is chunk c of stage s; microbatch j crosses v = 0 .. V-1
    forward and back. With F[v][j], B[v][j] its forward and full-backward times, b = B/2
    the input-gradient half when the backward is split (else b = B; measured times give b and
    W as timed, and B = b + W), a[v][j] / g[v][j] the
    latency of the activation F[v] sends / the gradient B[v] sends (0 when PP = 1):

      arrive(v, j) = sum_{u<v} (F + a)[u][j]     F[v][j] starts no earlier
      back(v, j)   = sum_{u<v} (g[u+1] + b[u])[j]  after B[v][j] ends, its gradient still
                                                 has to cross every lower virtual stage
      hold(v, j)   = sum_{u>=v} F[u][j] + sum_{v<=u<V-1} a[u][j] + sum_{u>v} (b + g)[u][j]
                                                 F[v][j] starts to its own B starts: the
                                                 least time its activations stay in flight

    and for each stage s (its chunk-0 virtual stage is v = s):

      head_s = min_j arrive(s, j)                no task of s starts earlier
      work_s = sum_{c,j} (F + B)[s][c][j]        s runs all its work, one task at a time
      crit_s = sum_{c,j} (F + b)[s][c][j]        ... of which this precedes its last B
      LB_s   = head_s + max(work_s, crit_s + min_{c,j} back(c PP + s, j))
      mem_s  = head_s + sum_{c,j} hold(c PP + s, j) / cap_s    (with ``in_flight_caps``)

    mem_s is Little's law on the buffer limit: each (microbatch, chunk) forward holds one of
    the stage's cap_s slots (its peak forwards in flight: the limit, at least C, for a
    readiness-first policy; a fixed order's own peak) from its start until its B starts (W
    releases later, when split), and all of it happens after head_s. Also each microbatch's
    round trip: every F, b and latency on its way out and back.

      LB = max(max_s JPS_s, max_s mem_s, max_j round_trip_j)

    JPS_s goes further than LB_s (it is never below it): each task of stage s gets a head r (its
    chain of predecessors: no order starts it earlier) and a tail q (its chain of successors: the
    iteration lasts at least that long after it ends), and JPS_s is the optimum of stage s alone
    as a one-machine problem that may even preempt (``_preemptive_bound``): any schedule, cut
    to stage s, is one of its schedules, so none beats it. Message latencies are charged at
    their sampled values (a FIFO link can only add).
    """
    pp, chunks = topology.num_stages, topology.num_chunks
    stages = pp * chunks
    half = 0.5 if split_backward else 1.0

    def virtual(table) -> np.ndarray:  # [stage][chunk][mb] -> [v][mb]
        array = np.asarray(table, dtype=float).reshape(pp, chunks, num_microbatches)
        return array.transpose(1, 0, 2).reshape(stages, num_microbatches)

    forward, backward = virtual(realization.forward), virtual(realization.backward_total)
    input_grad = half * backward
    if split_backward and realization.backward_input is not None:  # measured: b and W as timed, B = b + W
        input_grad = virtual(realization.backward_input)
        backward = input_grad + virtual(realization.weight)
    linked = 1.0 if pp > 1 else 0.0  # a rank's message to itself arrives at once
    sent_forward = linked * virtual(realization.activation_latency)
    sent_backward = linked * virtual(realization.gradient_latency)
    zero = np.zeros((1, num_microbatches))
    # arrive[v]: the forward chain before v; back[v]: the gradient chain below v
    arrive = np.concatenate([zero, np.cumsum(forward[:-1] + sent_forward[:-1], axis=0)])
    back = np.concatenate([zero, np.cumsum(input_grad[:-1] + sent_backward[1:], axis=0)])
    # hold[v] = suffix sums: F from v on, a from v to V-2, b and g above v
    forward_after = np.cumsum(forward[::-1], axis=0)[::-1]
    latency_after = np.concatenate([np.cumsum(sent_forward[:-1][::-1], axis=0)[::-1], zero])
    returns_above = np.concatenate([np.cumsum((input_grad + sent_backward)[::-1], axis=0)[::-1][1:], zero])
    hold = forward_after + latency_after + returns_above

    best = float(np.max(arrive[-1] + hold[-1] + input_grad[-1] + back[-1]))  # one microbatch's round trip
    heads, tails = _heads_and_tails(forward, input_grad, backward - input_grad, arrive, sent_forward, sent_backward)
    lengths = (forward, input_grad, backward - input_grad)
    for s in range(pp):
        mine = [c * pp + s for c in range(chunks)]
        head = float(np.min(arrive[s]))
        work = float(forward[mine].sum() + backward[mine].sum())
        crit = float(forward[mine].sum() + input_grad[mine].sum())
        tail = float(np.min(back[mine]))
        best = max(best, head + max(work, crit + tail))
        kinds = range(3 if split_backward else 2)  # F, B (input gradient or whole) and W
        best = max(best, _preemptive_bound(*(np.concatenate([table[k][mine].ravel() for k in kinds])
                                             for table in (heads, lengths, tails))))
        if in_flight_caps is not None:
            best = max(best, head + float(hold[mine].sum()) / max(1, in_flight_caps[s]))
    return best


def _heads_and_tails(forward, input_grad, weight, arrive, sent_forward, sent_backward):
    """Per task kind (F, B, W) and [v][mb]: the head (its predecessors' chain: F's forwards and
    activations before it; B's the whole forward chain and the gradients above it; W's its own B)
    and the tail (its successors' chain: F's the rest of the forward chain and the backward back
    down to v and on to v = 0, with any W after its B; B's the gradient chain below it or its W)."""
    stages = forward.shape[0]
    head_b, tail_b, tail_f = np.zeros_like(forward), np.zeros_like(forward), np.zeros_like(forward)
    head_b[-1] = arrive[-1] + forward[-1]
    for v in range(stages - 2, -1, -1):
        head_b[v] = np.maximum(arrive[v] + forward[v], head_b[v + 1] + input_grad[v + 1] + sent_backward[v + 1])
    tail_b[0] = weight[0]
    for v in range(1, stages):
        tail_b[v] = np.maximum(weight[v], sent_backward[v] + input_grad[v - 1] + tail_b[v - 1])
    tail_f[-1] = input_grad[-1] + tail_b[-1]
    for v in range(stages - 2, -1, -1):
        tail_f[v] = np.maximum(input_grad[v] + tail_b[v], sent_forward[v] + forward[v + 1] + tail_f[v + 1])
    return (arrive, head_b, head_b + input_grad), (tail_f, tail_b, np.zeros_like(forward))


def _preemptive_bound(release, length, tail) -> float:
    """The least max(end + tail) over one machine's tasks when a task may start no earlier than
    its release and may be interrupted: Jackson's preemptive schedule (always run the released
    task with the longest tail), which is optimal for that problem and so below every
    non-preemptive schedule of the same tasks."""
    release, length, tail = (np.asarray(x, dtype=float).tolist() for x in (release, length, tail))
    order = sorted(range(len(release)), key=release.__getitem__)
    ready: list[tuple[float, int, float]] = []  # (-tail, task, remaining)
    now, best, i, n = 0.0, 0.0, 0, len(order)
    while i < n or ready:
        if not ready:
            now = max(now, release[order[i]])
        while i < n and release[order[i]] <= now:
            task = order[i]
            heapq.heappush(ready, (-tail[task], task, length[task]))
            i += 1
        negative_tail, task, remaining = heapq.heappop(ready)
        run = remaining if i == n else min(remaining, release[order[i]] - now)
        now += run
        if run < remaining:
            heapq.heappush(ready, (negative_tail, task, remaining - run))
        else:
            best = max(best, now - negative_tail)
    return best


def in_flight_caps(plan: Plan, stage_limits: Optional[Sequence[Optional[int]]] = None) -> list[int]:
    """Per stage, the most (microbatch, chunk) forwards ``plan`` ever holds in flight: a fixed
    order's own peak (strict), else the buffer limit (``stage_limits`` where a run resolved
    its own per stage, as ``auto`` does; else the plan's), at least the chunk count (the
    arbiter's guarantee, policy/arbiter.py)."""
    if plan.config.strict:
        return [peak_in_flight(order) for order in plan.orders]
    chunks = plan.topology.num_chunks
    if stage_limits is not None and all(stage_limits):
        return [max(int(limit), chunks) for limit in stage_limits]
    return [max(arbiter.buffer_limit, chunks) for arbiter in plan.arbiters()]


def policy_lower_bound(config: ArbiterConfig, topology: Topology, realization: Realization, *,
                       stage_limits: Optional[Sequence[Optional[int]]] = None) -> float:
    """The bound for what ``config`` may do: its split (or not) and its memory."""
    m = len(realization.forward[0][0])
    plan = Plan.build(config, topology, m)
    return lower_bound(realization, topology, m, split_backward=plan.split_backward,
                       in_flight_caps=in_flight_caps(plan, stage_limits))


def median_lower_bound(config: ArbiterConfig, topology: Topology, realizations: Sequence[Realization], *,
                       stage_limits: Optional[Sequence[Optional[int]]] = None,
                       latency: bool = True) -> float:
    """The median over realisations of the bound for the policy ``config`` runs (a split
    backward or not and its buffer limit, as its plan says, or ``stage_limits`` where the run
    resolved its own): what `bench` divides its measured times by. ``latency=False`` where
    the run's messages were not delayed by the realisation's latencies."""
    if not latency:
        realizations = [without_latency(r) for r in realizations]
    return statistics.median(policy_lower_bound(config, topology, r, stage_limits=stage_limits)
                             for r in realizations)


def without_latency(realization: Realization) -> Realization:
    zero = np.zeros_like(np.asarray(realization.activation_latency, dtype=float)).tolist()
    return replace(realization, activation_latency=zero, gradient_latency=zero)
