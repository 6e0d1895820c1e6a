"""Paired forward and backward under rrfp (``overlap_moe_expert_parallel_comm``) against
megatron-core's own schedules: MoE GPT (local spec, 4 SequentialMLP experts, top-2, alltoall,
aux loss) at EP2 x PP2 on 4 gloo ranks, each replica on its own data, random task delays.
Every F and B runs megatron-core's combined-1F1B step; pairs run one forward with another
microbatch's backward in one step. Losses and every gradient must equal Megatron's combined-1F1B
interleaved schedule (with virtual stages: the only layout where Megatron has it) and its plain
1F1B / interleaved schedule, and the executed order must contain pairs; under the default hint
the backwards also split into B and W (a pair's backward or a lone one defers its W).
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


def _check(per_rank: list[list[dict]], references: set[str], split_cases: tuple[int, ...] = ()) -> None:
    """``split_cases``: the cases (default hint) whose backwards split into B and W beside the pairs."""
    for case, case_results in enumerate(zip(*per_rank)):
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
        if case in split_cases:  # W tasks in the order, and some backward (paired or alone) deferred its W
            for r in case_results:
                backwards = [order.count("B") for order in r["orders"]]
                assert all("W" in order for order in r["orders"]), r["orders"]
                assert any(unsplit < n for unsplit, n in zip(r["unsplit"], backwards)), r


@pytest.mark.timeout(400)
def test_paired_rrfp_equals_megatron_combined_1f1b_interleaved_and_plain_interleaved():
    delay = _delay_wgrad_runs_on_the_local_spec()
    cases = [dict(num_microbatches=4, iterations=2, delay_wgrad=delay),
             dict(num_microbatches=4, iterations=1, hint="bf", buffer_limit=5, delay_wgrad=delay)]
    results = launch(compare_combined_cases, world_size=4, pp=2, ep=2, vpp=2, timeout=360, args=(cases,))
    _check(results, {"plain", "combined"}, split_cases=(0,))


@pytest.mark.timeout(400)
def test_paired_rrfp_without_interleaving_equals_megatron_1f1b():
    delay = _delay_wgrad_runs_on_the_local_spec()
    cases = [dict(num_microbatches=6, iterations=2, delay_wgrad=delay),  # default: 1F1B's order at 1x
             dict(num_microbatches=6, iterations=1, hint="bf", buffer_limit=3, delay_wgrad=delay)]
    results = launch(compare_combined_cases, world_size=4, pp=2, ep=2, timeout=360, args=(cases,))
    _check(results, {"plain"}, split_cases=(0,))


def _paired_selfcheck_step_on_cpu() -> tuple[str, str]:
    import torch.distributed as dist

    from megatron_rrfp.selfcheck.equivalence import PRODUCTION_STEPS, gpt_equivalence

    ctx = {"world": dist.get_world_size(), "seed": 0, "stall_timeout_s": 60.0}
    return gpt_equivalence(ctx, iterations=2, num_microbatches=4, device="cpu",
                           **PRODUCTION_STEPS["production-moe-paired-ep2-pp2-chunks2"])


@pytest.mark.timeout(300)
def test_the_gpu_selfchecks_paired_step_runs_on_cpu():
    """The self-check's paired step (``production-moe-paired-ep2-pp2-chunks2``: bf16, EP2 x PP2 x 2
    chunks, every F and B a combined step) on 4 gloo ranks: equal to Megatron's combined-1F1B
    interleaved schedule within the bf16 tolerance, pairs run. On a GPU the same code runs the
    step's two streams; on CPU they are no-ops."""
    for status, detail in launch(_paired_selfcheck_step_on_cpu, world_size=4, pp=2, timeout=240):
        assert status == "PASS", detail
        assert "EP=2 (alltoall)" in detail and "paired F and B" in detail and " 0 pairs run" not in detail, detail


MOE_TRAIN = ["--cpu", "--nproc", "4", "--pipeline-model-parallel-size", "2", "--hidden-size", "32",
             "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "64", "--micro-batch-size", "1",
             "--global-batch-size", "8", "--lr", "0.01", "--min-lr", "0.001", "--lr-warmup-iters", "0",
             "--train-iters", "3", "--log-interval", "1", "--num-experts", "4", "--expert-model-parallel-size", "2",
             "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "0.01"]


def _logged(result) -> dict[int, tuple[float, float]]:
    """(lm loss, grad norm) per logged iteration."""
    from helpers.train_cli import LOSS_LINE, losses

    losses(result)  # asserts the run succeeded
    return {int(m.group(1)): (float(m.group(7)), float(m.group(8))) for m in LOSS_LINE.finditer(result.stdout)}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() == {1, 2, 3} and all(
        abs(x - y) <= 1e-5 * max(1.0, abs(x)) for i in a for x, y in zip(a[i], b[i]))


def _trace_pairs(trace_dir) -> set[str]:
    import json

    names = set()
    for path in trace_dir.glob("*.json"):
        events = json.loads(path.read_text())
        events = events["traceEvents"] if isinstance(events, dict) else events
        names |= {e["name"] for e in events if "+" in str(e.get("name", ""))}
    return names


def _combined_flags() -> list[str]:
    return ["--overlap-moe-expert-parallel-comm"] + (["--delay-wgrad-compute"]
                                                     if _delay_wgrad_runs_on_the_local_spec() else [])


@pytest.mark.timeout(400)
def test_train_combined_rrfp_without_virtual_stages_logs_megatron_1f1b(tmp_path):
    from helpers.train_cli import train

    flags = [*MOE_TRAIN, "--num-layers", "2"]
    rrfp = _logged(train(*flags, "--pipeline-schedule", "rrfp", *_combined_flags(), "--rrfp-trace-dir",
                         str(tmp_path), timeout=200))
    megatron = _logged(train(*flags, "--pipeline-schedule", "1f1b", timeout=200))
    assert _same(rrfp, megatron), (rrfp, megatron)
    assert _trace_pairs(tmp_path), "the executed order holds no pair"


@pytest.mark.timeout(600)
def test_train_combined_rrfp_interleaved_logs_megatron_combined_1f1b_and_interleaved(tmp_path):
    from helpers.train_cli import train

    flags = [*MOE_TRAIN, "--num-layers", "4", "--virtual-pipeline-model-parallel-size", "2"]
    rrfp = _logged(train(*flags, "--pipeline-schedule", "rrfp", *_combined_flags(), "--rrfp-trace-dir",
                         str(tmp_path), timeout=200))
    combined = _logged(train(*flags, "--pipeline-schedule", "1f1b", *_combined_flags(), timeout=200))
    interleaved = _logged(train(*flags, "--pipeline-schedule", "1f1b", timeout=200))
    assert _same(rrfp, combined) and _same(combined, interleaved), (rrfp, combined, interleaved)
    assert _trace_pairs(tmp_path), "the executed order holds no pair"


def test_train_refuses_what_combined_steps_cannot_run_before_any_rank_starts():
    from megatron_rrfp.train.config import TrainConfig, validate

    moe = dict(num_experts=4, expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall", cpu=True,
               pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match="needs --virtual-pipeline-model-parallel-size.*rrfp pairs without it"):
        validate(TrainConfig(**moe, overlap_moe_expert_parallel_comm=True, pipeline_schedule="1f1b"))
    with pytest.raises(ValueError, match="--rrfp-hint bfw places W tasks by its own order"):
        validate(TrainConfig(**moe, overlap_moe_expert_parallel_comm=True, pipeline_schedule="rrfp", rrfp_hint="bfw"))
    with pytest.raises(ValueError, match="--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm"):
        validate(TrainConfig(**moe, delay_wgrad_compute=True, pipeline_schedule="rrfp"))
    with pytest.raises(ValueError, match="alltoall"):
        validate(TrainConfig(**{**moe, "moe_token_dispatcher_type": "allgather"}, overlap_moe_expert_parallel_comm=True,
                             pipeline_schedule="rrfp"))
    validate(TrainConfig(**moe, overlap_moe_expert_parallel_comm=True, pipeline_schedule="rrfp"))  # accepted
    if not _delay_wgrad_runs_on_the_local_spec():
        with pytest.raises(ValueError, match="backward_dw"):
            validate(TrainConfig(**moe, overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True,
                                 pipeline_schedule="rrfp"))


def test_megatron_lm_flags_accept_the_overlap_with_virtual_stages_and_say_why_not_without():
    import argparse

    from megatron_rrfp.megatron_lm.flags import add_rrfp_arguments, validate_rrfp_arguments

    parser = add_rrfp_arguments(argparse.ArgumentParser())
    base = ["--pipeline-schedule", "rrfp"]
    args = parser.parse_args(base)
    args.__dict__.update(overlap_moe_expert_parallel_comm=True, pipeline_model_parallel_size=2,
                         virtual_pipeline_model_parallel_size=2, transformer_impl="transformer_engine")
    assert validate_rrfp_arguments(args) is not None
    args.virtual_pipeline_model_parallel_size = None
    with pytest.raises(ValueError, match="under Megatron-LM needs --virtual-pipeline-model-parallel-size"):
        validate_rrfp_arguments(args)
