"""Buffer limits in memory terms (policy/budget.py) against Megatron's own schedule, pure
and fast: ``1x`` is Megatron's warm-up bound, every stage stays within k x Megatron's
memory at ``kx`` whatever the task durations, and ``auto`` fits its budget."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rrfp.policy.arbiter import Arbiter, ArbiterConfig
from megatron_rrfp.policy.budget import AUTO_MARGIN, fit_to_budget, megatron_peak_in_flight, resolve_buffer_limit
from megatron_rrfp.policy.dryrun import run
from megatron_rrfp.policy.topology import Topology

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("pp, m", [(2, 1), (2, 8), (4, 3), (4, 16), (8, 32), (16, 8)])
def test_1x_is_megatrons_1f1b_bound(pp, m):
    """Non-interleaved: stage 0 warms up with PP - 1 forwards, then holds one more: min(PP, M)."""
    assert megatron_peak_in_flight(Topology(pp), m) == min(pp, m)
    assert resolve_buffer_limit("1x", Topology(pp), m) == min(pp, m)


@pytest.mark.parametrize("pp, chunks, m", [(2, 2, 4), (4, 2, 16), (4, 3, 8), (2, 2, 6), (4, 2, 4), (4, 4, 8)])
def test_1x_is_megatrons_interleaved_warmup_bound_plus_one(pp, chunks, m):
    """Interleaved: stage 0 warms up with 2(PP - 1) + (C - 1) x PP forwards (Megatron's
    get_pp_rank_microbatches, microbatch groups of PP), then holds one more; at most M x C."""
    bound = min(2 * (pp - 1) + (chunks - 1) * pp + 1, m * chunks)
    assert megatron_peak_in_flight(Topology(pp, chunks), m) == bound
    assert resolve_buffer_limit("1x", Topology(pp, chunks), m) == bound


def _peaks(hint: str, limit, topology: Topology, m: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    durations: dict = {}

    def duration(stage, task):  # random but fixed per (stage, task): the stages drift apart
        if (stage, task) not in durations:
            durations[(stage, task)] = rng.uniform(0.3, 3.0) * (2.0 if task.kind.value == "B" else 1.0)
        return durations[(stage, task)]

    config = ArbiterConfig(hint=hint, buffer_limit=limit)
    arbiters = [Arbiter(config, stage=s, topology=topology, num_microbatches=m) for s in range(topology.num_stages)]
    return run(arbiters, topology, duration=duration).peak_in_flight


@pytest.mark.parametrize("hint", ["bf", "bfw", "1f1b"])
@pytest.mark.parametrize("pp, chunks, m", [(4, 1, 16), (8, 1, 32), (2, 2, 8), (4, 2, 16)])
@pytest.mark.parametrize("multiple", [1.0, 1.5, 2.0])
def test_every_stage_stays_within_k_times_megatrons_memory(hint, pp, chunks, m, multiple):
    """At ``kx`` no stage ever holds more than floor(k x Megatron's peak) (microbatch, chunk)
    forwards, whatever the durations; bfw counts a forward until its W (W holds its inputs)."""
    topology = Topology(pp, chunks)
    bound = min(int(multiple * megatron_peak_in_flight(topology, m)), m * chunks)
    for seed in range(3):
        peaks = _peaks(hint, f"{multiple:g}x", topology, m, seed)
        assert max(peaks) <= bound, (peaks, bound)


@settings(max_examples=300, deadline=None)
@given(pp=st.integers(2, 16), chunks=st.integers(1, 3), groups=st.integers(1, 6),
       bytes_per_forward=st.floats(1.0, 1e9), budget=st.floats(0.0, 1e12))
def test_auto_fits_its_budget_and_is_the_largest_that_does(pp, chunks, groups, bytes_per_forward, budget):
    """auto: limit x bytes <= AUTO_MARGIN x budget unless held at Megatron's own 1x floor;
    never above M x C; one more forward would not fit (or M x C binds)."""
    topology, m = Topology(pp, chunks), pp * groups
    one_x = megatron_peak_in_flight(topology, m)
    limit = fit_to_budget(one_x, m * chunks, bytes_per_forward=bytes_per_forward, budget_bytes=budget)
    assert one_x <= limit <= m * chunks
    if limit > one_x:
        assert limit * bytes_per_forward <= AUTO_MARGIN * budget * (1 + 1e-12)
    if limit < m * chunks:
        assert (limit + 1) * bytes_per_forward > AUTO_MARGIN * budget * (1 - 1e-12)
    assert resolve_buffer_limit("auto", topology, m, auto=lambda t, mb, x: limit) == limit


def test_auto_needs_a_measurement():
    with pytest.raises(ValueError, match="measured from free memory at run time"):
        resolve_buffer_limit("auto", Topology(4), 16)
