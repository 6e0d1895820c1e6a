"""Mixture-of-Experts with expert parallelism against megatron-core's own schedules.

megatron-core's MoE GPTModel (local spec: 4 SequentialMLP experts, top-2 router with aux loss,
alltoall dispatcher) at EP2 x PP2 on 4 gloo ranks: the expert all-to-alls span the two
data-parallel replicas, so both pipelines' stage ranks must issue one sequence of tasks
(the agreement group is stage x expert-parallel). Each replica draws its own data (the
experts' loads and the all-to-all splits differ) and its own random task delays (the
orders depart from 1F1B). Losses and every gradient (router, experts, aux-loss scaling
through MoEAuxLossAutoScaler) must equal megatron-core's 1F1B / interleaved schedule.
"""
from __future__ import annotations

import pytest

from helpers.equivalence import Case, run_cases
from helpers.interleaved import compare_interleaved_cases
from megatron_rrfp.launch.function import launch

TOL = 1e-5


def _check(per_rank: list[list[dict]]) -> None:
    for case_results in zip(*per_rank):
        for r in case_results:
            assert r["loss_rel_err"] <= TOL and r["grad_rel_err"] <= TOL, r
        assert sum(r["num_losses"] for r in case_results) > 0
        assert any(order != r["megatron_order"] for r in case_results for order in r["orders"]), \
            "injected delays should have changed the order somewhere"


@pytest.mark.timeout(400)
def test_moe_ep2_pp2_like_megatron_1f1b_bf_split_rounds_and_a_late_replica():
    cases = [
        Case(model="moe", iterations=3, num_microbatches=6),
        Case(model="moe", iterations=2, num_microbatches=6, hint="bfw"),  # experts' local linears deferred to W
        Case(model="moe", iterations=2, num_microbatches=6, hint="default", buffer_limit="1x"),
        Case(model="moe", iterations=2, num_microbatches=6, transport="rounds"),  # device protocol over gloo
        Case(model="moe", iterations=2, num_microbatches=6, late_rank=1),  # one replica's stage 0 hears late
    ]
    results = launch(run_cases, world_size=4, pp=2, ep=2, timeout=360, args=(cases,))
    _check(results)
    for r in (rank[0] for rank in results):
        assert r["agree_rounds"] > 0, r  # stage ranks of the two replicas agreed on every decision
    last_stage = [rank[0] for rank in results if rank[0]["num_losses"]]
    assert len(last_stage) == 2 and last_stage[0]["losses_rrfp"] != last_stage[1]["losses_rrfp"]  # distinct data
    assert all(rank[1]["peak_deferred_wgrad_bytes"] > 0 for rank in results)  # BFW deferred the experts' W
    assert any("W" in order for rank in results for order in rank[1]["orders"])


@pytest.mark.timeout(400)
def test_moe_ep2_pp2_two_chunks_like_megatron_interleaved():
    cases = [dict(model="moe", num_microbatches=4, iterations=2, hint="bf"),
             dict(model="moe", num_microbatches=4, iterations=2, hint="bfw")]
    results = launch(compare_interleaved_cases, world_size=4, pp=2, ep=2, vpp=2, timeout=360, args=(cases,))
    _check(results)


MOE_TRAIN = ["--cpu", "--nproc", "4", "--pipeline-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "32",
             "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "64", "--micro-batch-size", "1",
             "--global-batch-size", "8", "--lr", "0.01", "--min-lr", "0.001", "--lr-warmup-iters", "0",
             "--train-iters", "3", "--log-interval", "1", "--num-experts", "4", "--expert-model-parallel-size", "2",
             "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "0.01"]


@pytest.mark.timeout(300)
def test_train_ep2_pp2_rrfp_logs_the_losses_of_1f1b():
    from helpers.train_cli import losses, train

    rrfp = losses(train(*MOE_TRAIN, "--pipeline-schedule", "rrfp", "--rrfp-hint", "bf", timeout=140))
    megatron = losses(train(*MOE_TRAIN, "--pipeline-schedule", "1f1b", timeout=140))
    assert rrfp.keys() == megatron.keys() == {1, 2, 3}
    assert all(abs(rrfp[i] - megatron[i]) <= 1e-5 for i in rrfp), (rrfp, megatron)


def test_train_moe_flags_are_checked_before_any_rank_starts():
    from megatron_rrfp.train.config import TrainConfig, validate

    with pytest.raises(ValueError, match="--num-experts 3 is not divisible by --expert-model-parallel-size 2"):
        validate(TrainConfig(num_experts=3, expert_model_parallel_size=2))
    with pytest.raises(ValueError, match="--expert-model-parallel-size 2 needs --num-experts"):
        validate(TrainConfig(expert_model_parallel_size=2))
    with pytest.raises(ValueError, match="--expert-model-parallel-size 4 does not divide the data-parallel size 2"):
        validate(TrainConfig(num_experts=4, expert_model_parallel_size=4, pipeline_model_parallel_size=2),
                 world_size=4)


def test_agreement_groups_join_overlapping_tp_and_expert_groups():
    from megatron_rrfp.runtime.agreement import joined_groups

    # TP {0,1} and {2,3}; expert groups {0,2} join them into one stage-wide group; {4,5} stays apart
    assert joined_groups([[0, 1], [0, 2], [2, 3], [4, 5], [6]]) == [(0, 1, 2, 3), (4, 5), (6,)]


def test_moe_variability_slowest_expert_rank_sets_the_time_and_a2a_stays_in_b():
    import numpy as np

    from megatron_rrfp.policy.actions import Kind, Task
    from megatron_rrfp.policy.topology import Topology
    from megatron_rrfp.sim.variability import Variability, moe_load_factor, sample_realization

    rng = np.random.default_rng(0)
    balanced = moe_load_factor(Variability(num_experts=8, expert_parallel=2, moe_skew=0.0, moe_concentration=1e6),
                               (2, 1, 16), rng)
    skewed = moe_load_factor(Variability(num_experts=8, expert_parallel=2, moe_skew=1.5, moe_concentration=5),
                             (2, 1, 16), rng)
    assert np.all(balanced >= 1.0) and balanced.mean() < 1.02  # multinomial noise only
    assert skewed.mean() > 1.1 and skewed.std() > 0.01  # hot experts, varying per microbatch
    v = Variability(num_experts=8, expert_parallel=2, a2a_time=0.2)
    r = sample_realization(v, Topology(2), 4, seed=1)
    b, w = r.duration(0, Task(Kind.B, 1, 0), True), r.duration(0, Task(Kind.W, 1, 0), True)
    assert abs((b - w) - r.backward_comm[0][0][1]) < 1e-12 and r.backward_comm[0][0][1] >= 0.2 * 0.99
    dense = sample_realization(Variability(), Topology(2), 4, seed=1)
    assert dense.backward_comm is None and r.forward != dense.forward
