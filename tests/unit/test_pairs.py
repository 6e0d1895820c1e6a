"""Paired forward and backward (``ArbiterConfig.pair_forward_backward``): the arbiter dispatches a
ready F and a ready B of one stage together, as megatron-core's combined forward-backward step
runs them (the MoE all-to-all overlap). Plans with pairs complete, respect every dependency and
the memory rule, and the simulator times a pair from its halves' compute and all-to-all."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_policy import _megatron_accepts

from megatron_rrfp.policy.actions import B, F, Kind, all_tasks
from megatron_rrfp.policy.arbiter import Arbiter, ArbiterConfig
from megatron_rrfp.policy.budget import resolve_buffer_limit
from megatron_rrfp.policy.dryrun import constant_durations, run
from megatron_rrfp.policy.plan import Plan
from megatron_rrfp.policy.topology import Topology
from megatron_rrfp.sim import Variability, sample_realization, simulate


def check_pairs(result, topology: Topology) -> None:
    """test_policy's dependency check, a pair's two tasks (one shared span) counted as one span."""
    end = {(stage, task): finish for stage, task, _, finish in result.trace}
    for stage, task, start, _ in result.trace:  # every task, paired or not, after what it consumes
        mb, chunk = task.microbatch, task.chunk
        needs = []
        if task.kind is Kind.F and topology.upstream(stage, chunk) is not None:
            up = topology.upstream(stage, chunk)
            needs.append((up[0], F(mb, up[1])))
        if task.kind is Kind.B:
            needs.append((stage, F(mb, chunk)))
            if topology.downstream(stage, chunk) is not None:
                down = topology.downstream(stage, chunk)
                needs.append((down[0], B(mb, down[1])))
        for need in needs:
            assert start >= end[need] - 1e-9, (stage, task, need)
    by_stage: dict[int, set] = {}  # one span at a time per stage (a pair's two tasks share one)
    for stage, _, start, finish in result.trace:
        by_stage.setdefault(stage, set()).add((start, finish))
    for spans in by_stage.values():
        spans = sorted(spans)
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:]))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pp=st.integers(1, 6), microbatches=st.integers(1, 12), chunks=st.integers(1, 3),
       limit=st.one_of(st.integers(1, 6), st.sampled_from(["1x", "1.5x"])),
       hint=st.sampled_from(["bf", "1f1b", "default"]), sigma=st.floats(0, 1.0), c50=st.floats(0, 1.0),
       a2a=st.floats(0, 0.5), split=st.booleans(), seed=st.integers(0, 2**16))
def test_plans_with_pairs_complete_in_dependency_order_within_memory(pp, microbatches, chunks, limit, hint, sigma,
                                                                     c50, a2a, split, seed):
    topology = Topology(pp, chunks)
    if not _megatron_accepts(pp, microbatches, chunks) and (hint != "bf" or isinstance(limit, str)):
        return  # Megatron's interleaved order (and so 1x) is undefined there: refused elsewhere
    v = Variability(sigma_compute=sigma, c50=c50, num_experts=8, expert_parallel=2, a2a_time=a2a)
    realization = sample_realization(v, topology, microbatches, seed)
    config = ArbiterConfig(hint=hint, buffer_limit=limit, split_backward_ok=split, pair_forward_backward=True)
    plan = Plan.build(config, topology, microbatches)
    result = simulate(config, topology, microbatches, realization, record_trace=True)  # raises on deadlock
    expected = set(all_tasks(microbatches, chunks, split_backward=plan.split_backward))
    for order, pairs in zip(result.orders, result.pairs):
        assert len(order) == len(expected) and set(order) == expected
        for forward, backward in pairs:
            assert forward.kind is Kind.F and backward.kind is Kind.B
            assert (forward.microbatch, forward.chunk) != (backward.microbatch, backward.chunk)
    check_pairs(result, topology)
    assert max(result.peak_in_flight) <= max(resolve_buffer_limit(limit, topology, microbatches), chunks)


def test_pairs_form_in_the_steady_state_and_never_without_the_option():
    topology, m = Topology(4), 8
    plan = Plan.build(ArbiterConfig(hint="bf", buffer_limit="1x", pair_forward_backward=True), topology, m)
    paired = run(plan.arbiters(), topology, duration=constant_durations(False))
    assert paired.pairs[0] and paired.pairs[-1]  # stage 0 pairs its steady state at 1x, the last stage F(k+1) with B(k)
    unpaired = run(Plan.build(ArbiterConfig(hint="bf", buffer_limit="1x"), topology, m).arbiters(), topology,
                   duration=constant_durations(False))
    assert not any(unpaired.pairs)
    # pairs in series take exactly as long as the tasks alone; so the makespan cannot be shorter
    assert paired.makespan >= unpaired.makespan - 1e-9


def test_partner_is_admitted_after_the_backward_and_the_same_for_the_same_ready_set():
    topology = Topology(2)
    config = ArbiterConfig(hint="bf", buffer_limit=2, pair_forward_backward=True)

    def at_limit() -> Arbiter:
        arbiter = Arbiter(config, stage=0, topology=topology, num_microbatches=6)
        arbiter.record(F(0))
        arbiter.record(F(1))
        return arbiter

    arbiter, twin = at_limit(), at_limit()
    ready = {B(0), F(2), F(3)}
    # at the limit no forward runs alone; B(0)'s release admits one, which pairs with it
    assert arbiter.choose({F(2), F(3)}) is None
    assert arbiter.choose(ready) == B(0) and arbiter.take_partner(B(0)) == F(2)
    assert twin.choose(ready) == B(0) and twin.take_partner(B(0)) == F(2)  # same ready set, same pair
    assert twin.take_partner(B(0)) is None  # taken once
    assert arbiter.in_flight == 2 and arbiter.admission_frontier() == -1  # choose() changed nothing
    arbiter.record_pair(B(0), F(2))
    assert arbiter.pairs == [(F(2), B(0))] and arbiter.in_flight == 2 and arbiter.peak_in_flight == 2
    assert not arbiter.split_backward and arbiter.unsplit_backwards == 0  # bf: nothing to split, nothing counted
    assert arbiter.dispatched[-2:] == [B(0), F(2)]


def test_strict_never_pairs():
    topology = Topology(2)
    plan = Plan.build(ArbiterConfig(hint="1f1b", strict=True, pair_forward_backward=True), topology, 4)
    assert not any(run(plan.arbiters(), topology, duration=constant_durations(False)).pairs)


def test_with_the_split_a_pair_keeps_it_where_the_forward_fits_beside_and_runs_whole_where_it_needs_the_release():
    topology = Topology(2)
    config = ArbiterConfig(hint="default", buffer_limit=2, pair_forward_backward=True)

    def holding(*forwards) -> Arbiter:
        arbiter = Arbiter(config, stage=0, topology=topology, num_microbatches=6)
        assert arbiter.split_backward
        for mb in forwards:
            arbiter.record(F(mb))
        return arbiter

    room = holding(0)  # one slot free: F(1) runs beside the split B(0), whose W releases later
    assert room.choose({B(0), F(1)}) == B(0) and room.take_partner(B(0)) == F(1)
    room.record_pair(B(0), F(1))
    assert room.defers_weight(B(0)) and room.in_flight == 2 and room.unsplit_backwards == 0
    full = holding(0, 1)  # at the limit: only B(0)'s release admits F(2), so B(0) runs whole
    assert full.choose({B(0), F(2)}) == B(0) and full.take_partner(B(0)) == F(2)
    full.record_pair(B(0), F(2))
    assert not full.defers_weight(B(0)) and full.in_flight == 2 and full.unsplit_backwards == 1
    # both pairs in the simulator: a kept split costs the pair B alone, W runs later; a whole one B and W
    v = Variability(sigma_compute=0.0, num_experts=8, expert_parallel=2, a2a_time=0.3, moe_skew=0.0,
                    moe_concentration=1e9)
    r = sample_realization(v, topology, 6, seed=0)
    split, whole = r.pair_duration(0, F(1), B(0), True), r.pair_duration(0, F(1), B(0), False)
    comm = r.backward_comm[0][0][1] + r.backward_comm[0][0][0]
    compute = r.duration(0, F(1), False) + r.duration(0, B(0), True) - comm
    assert split == pytest.approx(max(compute, comm)) and split < whole


def test_simulated_pair_hides_the_smaller_resource():
    topology = Topology(2)
    v = Variability(sigma_compute=0.0, num_experts=8, expert_parallel=2, a2a_time=0.3, moe_skew=0.0,
                    moe_concentration=1e9)
    r = sample_realization(v, topology, 4, seed=0)
    f, b = F(1), B(0)
    alone = r.duration(0, f, False) + r.duration(0, b, False)
    comm = r.backward_comm[0][0][1] + r.backward_comm[0][0][0]
    assert r.pair_duration(0, f, b) == pytest.approx(max(alone - comm, comm))
    assert r.pair_duration(0, f, b) < alone
    dense = sample_realization(Variability(sigma_compute=0.0), topology, 4, seed=0)
    assert dense.pair_duration(0, f, b) == pytest.approx(dense.duration(0, f, False) + dense.duration(0, b, False))


def test_combined_steps_pair_and_refuse_what_they_cannot_run():
    import types

    from megatron_rrfp.mcore.config import RRFPConfig
    from megatron_rrfp.mcore.stage_work import with_combined_steps
    from megatron_rrfp.train.models import gpt_forward_step

    config = types.SimpleNamespace(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=False)
    paired = with_combined_steps(RRFPConfig.of(), config, [], gpt_forward_step, forward_only=False)
    assert paired.arbiter.pair_forward_backward and paired.arbiter.split_backward_ok  # split where it can
    import torch

    te_like = torch.nn.Sequential(torch.nn.Linear(2, 2))
    te_like[0].wgrad_store = object()  # what split/te.py recognises a Transformer Engine layer by
    whole = with_combined_steps(RRFPConfig.of(), config, [te_like], gpt_forward_step, forward_only=False)
    assert whole.arbiter.pair_forward_backward and not whole.arbiter.split_backward_ok  # TE: pairs run whole
    assert not with_combined_steps(RRFPConfig.of(), config, [], gpt_forward_step,
                                   forward_only=True).arbiter.pair_forward_backward  # evaluation: plain forwards
    with pytest.raises(ValueError, match="overlap-moe-expert-parallel-comm.*return_schedule_plan"):
        with_combined_steps(RRFPConfig.of(), config, [], lambda data_iterator, model: None, forward_only=False)
    with pytest.raises(ValueError, match="hint 'bfw'.*not built for pairs"):
        with_combined_steps(RRFPConfig.of(hint="bfw"), config, [], gpt_forward_step, forward_only=False)
    off = types.SimpleNamespace(overlap_moe_expert_parallel_comm=False)
    assert not with_combined_steps(RRFPConfig.of(), off, [], gpt_forward_step,
                                   forward_only=False).arbiter.pair_forward_backward


def test_megatron_combined_order_runs_one_warmup_forward_more_and_pairs_the_steady_state():
    from megatron_rrfp.policy.hints import megatron_1f1b_order
    from megatron_rrfp.sim.combined import combined_orders, simulate_combined

    topology, m = Topology(2, 2), 4
    steps = combined_orders(topology, m)
    plain = megatron_1f1b_order(0, topology, m)
    warmup = next(i for i, step in enumerate(steps[0]) if len(step) == 2)
    assert warmup == next(i for i, t in enumerate(plain) if t.kind is Kind.B)  # interleaved warm-up + 1
    assert sorted(str(t) for step in steps[0] for t in step) == sorted(map(str, plain))
    assert all(step[0].kind is Kind.F and step[1].kind is Kind.B for step in steps[0] if len(step) == 2)
    with pytest.raises(ValueError, match="virtual stages"):
        combined_orders(Topology(2), m)
    v = Variability(sigma_compute=0.0, num_experts=8, expert_parallel=2, a2a_time=0.5)
    run_ = simulate_combined(topology, m, sample_realization(v, topology, m, seed=0))
    assert run_.pairs > 0 and run_.makespan > 0


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pp=st.integers(2, 6), chunks=st.integers(1, 2), groups=st.integers(1, 3), bytes_seed=st.integers(0, 2**16),
       a2a=st.floats(0, 0.5), seed=st.integers(0, 2**16))
def test_pairs_with_the_split_complete_under_byte_budgets(pp, chunks, groups, bytes_seed, a2a, seed):
    """The default hint at 1x with byte budgets (what the runtime runs under the flag): a pair's backward
    keeps its split only where the forward is admitted on the state that split leaves (its stash can
    weigh more or less than the forward it replaces), and every plan still completes in dependency order."""
    import random

    from megatron_rrfp.policy.membytes import StageBytes, calibrated_budgets

    topology, microbatches = Topology(pp, chunks), pp * groups
    rng = random.Random(bytes_seed)
    weights = [rng.uniform(0.5, 2.0) for _ in range(pp)]
    stages = [StageBytes(forward=w, forward_peak=w * rng.uniform(1.0, 1.5), pending=w * rng.uniform(0.3, 1.5),
                         split_peak=w * rng.uniform(1.0, 1.6)) for w in weights]
    config = ArbiterConfig(buffer_limit="1x", pair_forward_backward=True,
                           memory_bytes=calibrated_budgets(stages, topology, microbatches))
    v = Variability(sigma_compute=0.3, c50=0.1, num_experts=8, expert_parallel=2, a2a_time=a2a)
    result = simulate(config, topology, microbatches, sample_realization(v, topology, microbatches, seed),
                      record_trace=True)  # raises on deadlock
    split = Plan.build(config, topology, microbatches).split_backward
    expected = set(all_tasks(microbatches, chunks, split_backward=split))
    assert all(set(order) == expected and len(order) == len(expected) for order in result.orders)
    check_pairs(result, topology)


def test_simulate_pairs_under_the_flag_as_the_runtime_and_runs_megatron_combined_beside():
    """``simulate --overlap-moe-expert-parallel-comm``: the readiness-first policies are the paired
    arbiters the runtime builds, Megatron's combined 1F1B runs beside them (virtual stages), /LB is left out."""
    from megatron_rrfp.sim.combined import simulate_combined
    from megatron_rrfp.sim.study import COMBINED, StudyConfig, format_report, run_study

    topology, m = Topology(2, 2), 4
    v = Variability(sigma_compute=0.3, c50=0.1, num_experts=4, expert_parallel=2, a2a_time=0.6)
    config = StudyConfig(pipeline_size=2, num_chunks=2, num_microbatches=m, policies=["default", "bf"], seeds=2,
                         variability=v, overlap_moe_expert_parallel_comm=True)
    report = run_study(config, progress=False)
    for seed in (0, 1):
        r = sample_realization(v, topology, m, seed)
        paired = simulate(ArbiterConfig(hint="default", pair_forward_backward=True), topology, m, r)
        assert any(paired.pairs)
        assert report["policies"]["default"]["makespan_per_seed"][seed] == paired.makespan
        assert report["policies"][COMBINED]["makespan_per_seed"][seed] == simulate_combined(topology, m, r).makespan
    assert all(p["makespan_over_lower_bound"] != p["makespan_over_lower_bound"] for p in report["policies"].values())
    assert COMBINED in format_report(report)
    without = StudyConfig(pipeline_size=2, num_microbatches=m, policies=["default"], seeds=1, variability=v,
                          overlap_moe_expert_parallel_comm=True)
    assert "not simulated" in format_report(run_study(without, progress=False))  # no virtual stages: no combined
