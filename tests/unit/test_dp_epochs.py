"""The DP epoch rule's simulated form (sim/dp_epochs.py; docs/design/dp-epochs.md): its static
timeline's epochs, and one replica's iteration under the rule over random draws."""
from __future__ import annotations

import pytest

from megatron_rrfp.policy.actions import Kind, Task
from megatron_rrfp.policy.topology import Topology
from megatron_rrfp.sim.dp_comm import DPChannel, DPComm, iteration_time, replicas_iteration_time
from megatron_rrfp.sim.dp_epochs import policy_orders, run_with_epochs, static_timeline
from megatron_rrfp.sim.simulator import policy
from megatron_rrfp.sim.variability import VARIABILITY_LEVELS, Variability, sample_realization

LAYOUTS = [(2, 2), (3, 2), (4, 3), (4, 4)]


@pytest.mark.parametrize("pp,chunks", LAYOUTS)
@pytest.mark.parametrize("split", [False, True])
def test_static_timeline_puts_a_dp_points_own_messages_on_the_right_side(pp, chunks, split):
    topology, m = Topology(pp, chunks), 2 * pp
    timeline = static_timeline(topology, m, split)
    closing = Kind.W if split else Kind.B
    assert sum(p.what == "reduce" for p in timeline.points) == pp * chunks
    assert sum(p.what == "gather" for p in timeline.points) == pp * max(0, chunks - 2)
    for g, point in enumerate(timeline.points):
        task = point.task
        if point.what == "reduce":
            assert task.kind is closing
            if task.kind is Kind.B and topology.upstream(point.stage, task.chunk) is not None:
                assert timeline.epoch[(point.stage, task)] > g  # the task's own gradient follows its reductions
        else:  # the forward's input precedes its all-gathers
            up = topology.upstream(point.stage, task.chunk)
            assert timeline.epoch[(up[0], Task(Kind.F, task.microbatch, up[1]))] <= g
    # every task before a stage's own DP point sends messages of an epoch no later than that point's
    for g, point in enumerate(timeline.points):
        limit = timeline.index[(point.stage, point.task)]
        for task in timeline.orders[point.stage][:limit]:
            if (point.stage, task) in timeline.epoch:
                assert timeline.epoch[(point.stage, task)] <= g


@pytest.mark.parametrize("pp,chunks", LAYOUTS)
@pytest.mark.parametrize("source", ["megatron", "policy"])
def test_replicas_complete_under_the_rule_with_dp_tasks_pinned(pp, chunks, source):
    topology, m, config = Topology(pp, chunks), 2 * pp, policy("default")
    orders = policy_orders(config, topology, m) if source == "policy" else None
    timeline = static_timeline(topology, m, True, orders)
    for level in ("j0", "j3"):
        for seed in range(4):
            realization = sample_realization(Variability(**VARIABILITY_LEVELS[level]), topology, m, seed)
            run = run_with_epochs(config, topology, m, realization, timeline)
            for point in timeline.points:
                order = run.orders[point.stage]
                at = order.index(point.task)
                limit = timeline.index[(point.stage, point.task)]
                before = {t for t in timeline.orders[point.stage][:limit]}
                assert set(order[:at]) == before, f"{level} seed {seed}: {point} not pinned"


def test_replicas_iteration_time_waits_for_the_slower_replica():
    fast = [(0, Task(Kind.F, 0, 0), 0.0, 1.0), (0, Task(Kind.B, 0, 0), 1.0, 3.0)]
    slow = [(0, Task(Kind.F, 0, 0), 0.0, 2.0), (0, Task(Kind.B, 0, 0), 2.0, 6.0)]
    comm = DPComm(reduce_per_bucket=1.0, gather_per_bucket=0.5, buckets_per_chunk=2)
    one = iteration_time(slow, 1, 1, comm, overlap_grad_reduce=True, overlap_param_gather=True)
    assert one == pytest.approx(6.0 + 2.0 + 0.5)
    both = replicas_iteration_time([fast, slow], 1, 1, comm, overlap_grad_reduce=True, overlap_param_gather=True)
    assert both == pytest.approx(one)
    channel = DPChannel(1.0)
    assert channel.queue(0.0, 2.0) == 3.0 and channel.queue(5.0, 1.0) == 6.0


@pytest.mark.parametrize("pp,chunks", LAYOUTS)
def test_chunks_reduced_after_the_loop_hold_no_dp_point_and_the_rest_keep_theirs(pp, chunks):
    from megatron_rrfp.policy.epochs import candidate_variants, timeline_for

    topology, m, config = Topology(pp, chunks), 2 * pp, policy("default")
    variants = candidate_variants(chunks)
    assert len(set(variants)) == 2 * (chunks + 1) + (chunks > 2)
    for variant in variants:
        timeline = timeline_for(config, topology, m, True, variant)
        assert timeline.deferred == variant.deferred and timeline.gathers_before == variant.gathers_before
        reduced = {(p.stage, p.chunk) for p in timeline.points if p.what == "reduce"}
        assert reduced == {(s, c) for s in range(pp) for c in range(chunks) if c not in variant.deferred}
        gathers = 0 if variant.gathers_before else pp * max(0, chunks - 2)
        assert sum(p.what == "gather" for p in timeline.points) == gathers


def test_without_any_dp_point_the_rule_is_void():
    """Two chunks, both reduced after the loop: no DP point, every message of epoch 0, so the
    book holds nothing back and the rule's iteration is the policy's own on every draw."""
    from megatron_rrfp.policy.epochs import EpochBook, EpochVariant, timeline_for
    from megatron_rrfp.sim.simulator import simulate

    topology, m, config = Topology(4, 2), 8, policy("default")
    timeline = timeline_for(config, topology, m, True, EpochVariant("megatron", frozenset({0, 1})))
    assert timeline.points == [] and set(timeline.epoch.values()) == {0}
    for stage in range(4):
        book = EpochBook(timeline, topology, stage)
        assert book.allowed(set(timeline.orders[stage])) == set(timeline.orders[stage]) and book.may_issue(0)
    for seed in range(4):
        realization = sample_realization(Variability(**VARIABILITY_LEVELS["j3"]), topology, m, seed)
        free = simulate(config, topology, m, realization, record_trace=True)
        ruled = run_with_epochs(config, topology, m, realization, timeline)
        assert ruled.orders == free.orders and ruled.makespan == pytest.approx(free.makespan)


def test_a_deferred_chunks_reductions_start_after_the_last_task():
    trace = [(0, Task(Kind.F, 0, 0), 0.0, 1.0), (0, Task(Kind.F, 0, 1), 1.0, 2.0),
             (0, Task(Kind.B, 0, 1), 2.0, 4.0), (0, Task(Kind.B, 0, 0), 4.0, 6.0)]
    comm = DPComm(reduce_per_bucket=1.0, gather_per_bucket=0.0, buckets_per_chunk=1)

    def time(deferred):
        return replicas_iteration_time([trace], 1, 2, comm, overlap_grad_reduce=True, overlap_param_gather=True,
                                       deferred=frozenset(deferred))
    assert time(()) == pytest.approx(7.0)  # chunk 1's reduction hides behind chunk 0's backward
    assert time({1}) == pytest.approx(8.0)  # both after the last task


@pytest.mark.parametrize("comm_f0,buckets,light", [(0.25, 1, True), (2.0, 8, False)])
def test_the_simulator_keeps_reductions_in_the_loop_only_where_communication_is_heavy(comm_f0, buckets, light):
    """PP8 x 2 chunks under the reference jitter: light DP communication is cheaper after the
    loop than the rule's pins; heavy communication keeps chunk 1's reductions (the earlier to
    complete) in the loop. Within the tolerance the fewest DP points win."""
    from megatron_rrfp.sim.dp_epochs import CHOICE_TOLERANCE, choose_variant

    comm = DPComm(reduce_per_bucket=comm_f0, gather_per_bucket=comm_f0, buckets_per_chunk=buckets)
    chosen, times = choose_variant(policy("default"), Topology(8, 2), 16, Variability(**VARIABILITY_LEVELS["j3"]),
                                   comm)
    assert times[chosen] <= min(times.values()) * (1 + CHOICE_TOLERANCE)
    assert (1 in chosen.deferred) is light, (chosen, times)


@pytest.mark.parametrize("pp,chunks,m,seeds", [(8, 4, 32, range(4)), (16, 4, 64, range(2))])
def test_long_interleaved_jobs_complete_under_every_variant(pp, chunks, m, seeds):
    """Many microbatches per stage: a stage that ran ahead on one chunk's forwards (their messages
    held to a later epoch) must not take the memory an earlier epoch's forward needs — that
    stalled PP8 x 4 chunks at M=32 before forwards ran in epoch order."""
    from megatron_rrfp.policy.epochs import candidate_variants, timeline_for

    topology, config = Topology(pp, chunks), policy("default")
    variants = candidate_variants(chunks) if pp <= 8 else candidate_variants(chunks)[:1]
    for variant in variants:
        timeline = timeline_for(config, topology, m, True, variant)
        for seed in seeds:
            realization = sample_realization(Variability(**VARIABILITY_LEVELS["j3"]), topology, m, seed)
            run = run_with_epochs(config, topology, m, realization, timeline)  # raises DeadlockError on a stall
            assert sorted(map(len, run.orders)) == [3 * chunks * m] * pp


def test_the_trial_keeps_the_rule_only_where_it_measured_faster_beyond_the_noise():
    """mcore/epoch_tuning.py, step 3: seconds per training call, the rule's and the variant's without DP points."""
    from megatron_rrfp.mcore.epoch_tuning import rule_measured_faster

    assert rule_measured_faster([2.0, 2.1, 2.05], [2.6, 2.5, 2.55])[0]  # 20% faster, tight: kept
    assert not rule_measured_faster([2.5, 2.6, 2.55], [2.5, 2.6, 2.55])[0]  # a tie: the variant without points
    assert not rule_measured_faster([2.9, 2.5, 2.7], [2.4, 3.1, 2.9])[0]  # 3% faster in noise of ~10%
    assert not rule_measured_faster([2.6, 2.7, 2.65], [2.0, 2.1, 2.05])[0]  # slower
    faster, rule_s, fallback_s, error_s = rule_measured_faster([1.0, 1.0], [2.0, 2.0])
    assert faster and (rule_s, fallback_s, error_s) == (1.0, 2.0, 0.0)
