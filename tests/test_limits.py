"""Buffer limits in memory terms (policy/limits.py), pure and fast: the forms and their
errors, ``1x`` = Megatron's own warm-up bound, resolved limits that really keep every
stage within k x Megatron's memory (dry runs), and ``auto`` within its budget."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rrfp.policy.arbiter import Arbiter, ArbiterConfig
from megatron_rrfp.policy.dryrun import run
from megatron_rrfp.policy.limits import (
    AUTO_MARGIN,
    BufferLimit,
    auto_target,
    megatron_peak_in_flight,
)
from megatron_rrfp.policy.topology import Topology

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("text, expected", [(16, "16"), ("16", "16"), ("1x", "1x"), ("1.5x", "1.5x"),
                                            (" 2X ", "2x"), (".5x", "0.5x"), ("auto", "auto"), ("AUTO", "auto")])
def test_forms_parse_and_print_back(text, expected):
    limit = BufferLimit.parse(text)
    assert str(limit) == expected and BufferLimit.parse(str(limit)) == limit


@pytest.mark.parametrize("bad", [0, -3, "0", "0x", "-1x", "x", "1.5", "auto:5", "", True, None, 2.0])
def test_bad_forms_name_the_option(bad):
    with pytest.raises(ValueError, match="--buffer-limit must be an integer >= 1.*1x.*auto"):
        BufferLimit.parse(bad, option="--buffer-limit")


@pytest.mark.parametrize("pp, m", [(2, 1), (2, 8), (4, 3), (4, 16), (8, 32), (16, 8)])
def test_1x_is_megatrons_1f1b_bound(pp, m):
    """Non-interleaved: stage 0 warms up with PP - 1 forwards, then holds one more: min(PP, M)."""
    topology = Topology(pp)
    assert megatron_peak_in_flight(topology, m) == min(pp, m)
    assert BufferLimit.parse("1x").resolve(topology, m) == min(pp, m)
    assert BufferLimit.parse("2x").resolve(topology, m) == min(2 * min(pp, m), m)


@pytest.mark.parametrize("pp, chunks, m, group", [(2, 2, 4, None), (4, 2, 16, None), (4, 3, 8, None),
                                                  (2, 2, 6, None), (4, 2, 16, 8), (4, 2, 4, None)])
def test_1x_is_megatrons_interleaved_warmup_bound_plus_one(pp, chunks, m, group):
    """Interleaved: stage 0 warms up with 2(PP - 1) + (C - 1) x group forwards (Megatron's
    get_pp_rank_microbatches), then holds one more; never more than its M x C forwards."""
    topology = Topology(pp, chunks)
    bound = min(2 * (pp - 1) + (chunks - 1) * (group or pp) + 1, m * chunks)
    assert megatron_peak_in_flight(topology, m, group_size=group) == bound
    # the arbiter may run C - 1 focus forwards past its limit: 1x leaves room for them
    assert BufferLimit.parse("1x").resolve(topology, m, group_size=group) == bound - (chunks - 1)


def _dry_run(hint: str, limit: int, topology: Topology, m: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    durations: dict = {}

    def duration(stage, task):  # random but fixed per (stage, task): stages drift apart
        key = (stage, task)
        if key not in durations:
            durations[key] = rng.uniform(0.3, 3.0) * (2.0 if task.kind.value == "B" else 1.0)
        return durations[key]

    config = ArbiterConfig(hint=hint, buffer_limit=limit)
    arbiters = [Arbiter(config, stage=s, topology=topology, num_microbatches=m) for s in range(topology.num_stages)]
    return run(arbiters, topology, duration=duration).peak_in_flight


@pytest.mark.parametrize("hint", ["bf", "bfw", "1f1b"])
@pytest.mark.parametrize("pp, chunks, m", [(4, 1, 16), (8, 1, 32), (2, 2, 8), (4, 2, 16)])
@pytest.mark.parametrize("multiple", ["1x", "1.5x", "2x"])
def test_resolved_multiples_keep_every_stage_within_k_times_megatron(hint, pp, chunks, m, multiple):
    """The arbiter at ``kx`` never holds more than floor(k x Megatron's peak) forwards on any
    stage, whatever the task durations (W still holds its forward: bfw counts until W)."""
    topology = Topology(pp, chunks)
    spec = BufferLimit.parse(multiple)
    bound = spec.target(topology, m)
    assert bound == min(int(spec.multiple * megatron_peak_in_flight(topology, m)), m * chunks)
    for seed in range(4):
        peaks = _dry_run(hint, spec.resolve(topology, m), topology, m, seed)
        assert max(peaks) <= bound, (peaks, bound)


@settings(max_examples=300, deadline=None)
@given(pp=st.integers(2, 16), chunks=st.integers(1, 3), m_groups=st.integers(1, 6),
       bytes_per_forward=st.floats(1.0, 1e9), budget=st.floats(0.0, 1e12))
def test_auto_fits_its_budget_and_is_the_largest_that_does(pp, chunks, m_groups, bytes_per_forward, budget):
    """auto: target x bytes <= AUTO_MARGIN x budget unless held at Megatron's own 1x floor;
    never above M x C; one more forward would not fit (or the cap binds)."""
    topology = Topology(pp, chunks)
    m = pp * m_groups
    one_x = megatron_peak_in_flight(topology, m)
    target = auto_target(topology, m, bytes_per_forward=bytes_per_forward, budget_bytes=budget)
    assert one_x <= target <= m * chunks
    if target > one_x:
        assert target * bytes_per_forward <= AUTO_MARGIN * budget * (1 + 1e-12)
    if target < m * chunks:
        assert (target + 1) * bytes_per_forward > AUTO_MARGIN * budget * (1 - 1e-12)
    limit = BufferLimit.parse("auto").resolve(topology, m, bytes_per_forward=bytes_per_forward, budget_bytes=budget)
    assert limit + chunks - 1 == max(target, chunks) or limit == 1


def test_auto_needs_a_measurement():
    with pytest.raises(ValueError, match="measured at run time"):
        BufferLimit.parse("auto").resolve(Topology(4), 16)
