"""Paired forward and backward under rrfp (``overlap_moe_expert_parallel_comm``) against
megatron-core's own schedules: MoE GPT (local spec, 4 SequentialMLP experts, top-2, alltoall,
aux loss) at EP2 x PP2 on 4 gloo ranks, each replica on its own data, random task delays.
Every F and B runs megatron-core's combined-1F1B step; pairs run one forward with another
microbatch's backward in one step. Losses and every gradient must equal Megatron's combined-1F1B
interleaved schedule (with virtual stages: the only layout where Megatron has it) and its plain
1F1B / interleaved schedule, and the executed order must contain pairs.
"""
from __future__ import annotations

import pytest

from helpers.combined_steps import compare_combined_cases
from megatron_rrfp.launch.function import launch

TOL = 1e-5


def _delay_wgrad_runs_on_the_local_spec() -> bool:
    """megatron-core >= 0.19 gives its own linears a (no-op) backward_dw; 0.16 only TE's have one."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    return hasattr(RowParallelLinear, "backward_dw")


def _check(per_rank: list[list[dict]], references: set[str]) -> None:
    for case_results in zip(*per_rank):
        for r in case_results:
            assert set(r["errors"]) == references, r
            for name, (loss_err, grad_err) in r["errors"].items():
                assert loss_err <= TOL and grad_err <= TOL, (name, r)
        assert sum(r["num_losses"] for r in case_results) > 0
        assert any(pairs for r in case_results for pairs in r["pairs"]), "no forward ran paired with a backward"
        for r in case_results:
            for pairs, order in zip(r["pairs"], r["orders"]):
                for pair in pairs:  # a pair's halves are both in the executed order, backward first
                    forward, backward = pair.split("+")
                    tasks = order.split(",")
                    assert tasks.index(backward) + 1 == tasks.index(forward), (pair, order)


@pytest.mark.timeout(400)
def test_paired_rrfp_equals_megatron_combined_1f1b_interleaved_and_plain_interleaved():
    delay = _delay_wgrad_runs_on_the_local_spec()
    cases = [dict(num_microbatches=4, iterations=2, delay_wgrad=delay),
             dict(num_microbatches=4, iterations=1, hint="bf", buffer_limit=5, delay_wgrad=delay)]
    results = launch(compare_combined_cases, world_size=4, pp=2, ep=2, vpp=2, timeout=360, args=(cases,))
    _check(results, {"plain", "combined"})


@pytest.mark.timeout(400)
def test_paired_rrfp_without_interleaving_equals_megatron_1f1b():
    delay = _delay_wgrad_runs_on_the_local_spec()
    cases = [dict(num_microbatches=6, iterations=2, delay_wgrad=delay),  # default: 1F1B's order at 1x
             dict(num_microbatches=6, iterations=1, hint="bf", buffer_limit=3, delay_wgrad=delay)]
    results = launch(compare_combined_cases, world_size=4, pp=2, ep=2, timeout=360, args=(cases,))
    _check(results, {"plain"})
