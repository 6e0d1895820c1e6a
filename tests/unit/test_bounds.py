"""The lower bound's one-machine term (megatron_rrfp/sim/bounds.py): Jackson's preemptive schedule is
never above any order of one stage's tasks, and on small interleaved cases it meets the proven optimum
where the stage's work and a microbatch's round trip alone stay well below it."""
from __future__ import annotations

import importlib.util
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rrfp.policy.topology import Topology
from megatron_rrfp.sim import REFERENCE_J3, Variability, lower_bound, policy, sample_realization, simulate
from megatron_rrfp.sim.bounds import _preemptive_bound

needs_solver = pytest.mark.skipif(importlib.util.find_spec("ortools") is None,
                                  reason="pip install megatron-rrfp[optimal]")


def _best_order(release, length, tail) -> float:
    """max(end + tail) of the best non-preemptive order, by trying them all."""
    best = float("inf")
    for order in itertools.permutations(range(len(release))):
        now, worst = 0.0, 0.0
        for task in order:
            now = max(now, release[task]) + length[task]
            worst = max(worst, now + tail[task])
        best = min(best, worst)
    return best


times = st.lists(st.tuples(st.integers(0, 20), st.integers(0, 8), st.integers(0, 20)), min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(tasks=times)
def test_the_preemptive_schedule_is_never_above_the_best_order(tasks):
    release, length, tail = (np.array(column, dtype=float) / 4 for column in zip(*tasks))
    bound = _preemptive_bound(release, length, tail)
    assert bound <= _best_order(release, length, tail) + 1e-9
    # and never below what any single task, or all of them from the first release, force
    assert bound >= max(release + length + tail) - 1e-9
    assert bound >= release.min() + length.sum() + tail.min() - 1e-9


def test_the_preemptive_schedule_runs_the_longest_tail_first():
    # A (release 0, 3 long, tail 0) is interrupted at 1 by B (1 long, tail 10): B ends at 2, A at 4
    assert _preemptive_bound(np.array([0.0, 1.0]), np.array([3.0, 1.0]), np.array([0.0, 10.0])) == 12.0
    # nothing released at 0: the machine idles until 5
    assert _preemptive_bound(np.array([5.0, 6.0]), np.array([2.0, 2.0]), np.array([1.0, 0.0])) == 9.0


@needs_solver
@pytest.mark.parametrize("seed, split", [(3, True), (12, True), (3, False)])
def test_on_small_interleaved_cases_the_bound_meets_the_proven_optimum(seed, split):
    """PP 2 x 2 chunks, M 2, j3 on the solver's grid: the bound is the optimum, where a stage's work
    from its first arrival and the longest round trip are at least 5% below it."""
    from test_optimal import on_grid, solve

    topology, m = Topology(2, 2), 2
    realization = on_grid(sample_realization(Variability(**REFERENCE_J3), topology, m, seed))
    optimum = solve(realization, topology, 4, split)
    assert optimum.proven
    bound = lower_bound(realization, topology, m, split_backward=split)
    assert bound == pytest.approx(optimum.makespan, abs=1e-9)
    forward, backward = (np.asarray(t) for t in (realization.forward, realization.backward_total))
    work = max(forward[s].sum() + backward[s].sum() for s in range(2)) + forward[0, 0].min()
    latency = np.asarray(realization.activation_latency) + np.asarray(realization.gradient_latency)
    trip = max(sum(forward[s, c, j] + backward[s, c, j] * (0.5 if split else 1) + latency[s, c, j]
                   for s in range(2) for c in range(2)) for j in range(m))
    assert max(work, trip) < 0.95 * bound
    for name in ("default", "bf", "1f1b-strict"):  # and below every policy, as any bound
        assert bound <= simulate(policy(name, 4), topology, m, realization).makespan + 1e-9
