"""megatron-core's HybridModel (0.18+) with the project's local stack spec (mcore/hybrid_spec.py).

RRFP against megatron-core's interleaved schedule on model chunks (2 chunks, PP=2, random
delays; losses and every gradient within 1e-5), and ``megatron-rrfp train --model hybrid``
(attention, MLP and MoE layers, EP2 x PP2): rrfp's logged losses equal 1f1b's. On releases
without HybridModel (leg A: 0.16.1) the tests skip with the version needed, and ``train
--model hybrid`` is refused.
"""
from __future__ import annotations

import pytest
from test_executor import _check

from helpers.interleaved import compare_interleaved_transports
from helpers.train_cli import TINY, losses, train
from megatron_rrfp.launch.function import launch
from megatron_rrfp.mcore.compat import hybrid_model_unavailable

MISSING = hybrid_model_unavailable()
needs_hybrid = pytest.mark.skipif(bool(MISSING), reason=MISSING)
HYBRID = [*TINY, "--model", "hybrid", "--hybrid-layer-pattern", "*-|*-"]


@needs_hybrid
@pytest.mark.timeout(400)
@pytest.mark.parametrize("hint", ["default", "bf"])
def test_hybrid_chunks_match_megatron_interleaved(hint):
    results = launch(compare_interleaved_transports, world_size=2, vpp=2, timeout=360, args=(("threads",),),
                     kwargs={"model": "hybrid", "iterations": 2, "hint": hint})
    _check(results)


@needs_hybrid
@pytest.mark.timeout(400)
def test_train_hybrid_with_moe_layers_ep2_pp2_rrfp_losses_equal_1f1b():
    """``train --model hybrid`` with attention, MLP and E (MoE) layers in
    --hybrid-layer-pattern and train's MoE flags, at EP2 x PP2 (4 ranks: DP2 = EP2): the default
    policy (B/W split active: no fallback line) logs Megatron's 1F1B losses; --num-experts
    without an E layer is refused before any rank starts."""
    from test_moe import MOE_TRAIN

    from megatron_rrfp.train.config import TrainConfig, validate

    flags = [*MOE_TRAIN, "--model", "hybrid", "--hybrid-layer-pattern", "*-E|*-E", "--train-iters", "6",
             "--seq-length", "32", "--micro-batch-size", "2"]  # test_train's TINY data: the loss falls
    ours = train(*flags, "--pipeline-schedule", "rrfp", timeout=170)
    rrfp = losses(ours)
    megatron = losses(train(*flags, "--pipeline-schedule", "1f1b", timeout=170))
    assert "without the B/W split" not in ours.stdout, ours.stdout[-2000:]
    assert rrfp.keys() == megatron.keys() == {1, 2, 3, 4, 5, 6}
    for iteration, loss in megatron.items():
        assert rrfp[iteration] == pytest.approx(loss, rel=1e-5, abs=1e-6), (iteration, rrfp, megatron)
    assert rrfp[6] < rrfp[1] - 0.05, rrfp  # it learns
    with pytest.raises(ValueError, match="no E \\(MoE\\) layer to give experts"):
        validate(TrainConfig(model="hybrid", hybrid_layer_pattern="*-|*-", num_experts=4,
                             pipeline_model_parallel_size=2, cpu=True))


@pytest.mark.skipif(not MISSING, reason="refused only where megatron-core has no HybridModel")
def test_train_hybrid_is_refused_naming_the_release_needed():
    result = train(*HYBRID, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "megatron-core >= 0.18" in result.stderr, result.stderr


@needs_hybrid
@pytest.mark.parametrize("pattern, pp, cpu, message", [
    (None, 2, True, "--model hybrid needs --hybrid-layer-pattern (e.g. '*-|*-'"),
    ("*-*-", 2, True, "has 1 pipeline segment(s) but --pipeline-model-parallel-size is 2"),
    ("*-|*-|*-", 2, True, "(e.g. '*-*|-*-')"),
    ("*-|", 2, True, "pipeline stage 1 has no layers"),
    ("*M|*-", 2, True, "M (Mamba) layers need CUDA kernels"),
    ("*G|*-", 2, True, "G (Gated DeltaNet) layers need CUDA kernels"),
    ("*E|*-", 2, False, "E (MoE) layers need --num-experts N"),
    ("*x|*-", 2, True, "unknown layer symbol 'x'"),
    ("*-|*-/*-", 2, True, "multi-token prediction"),
])
def test_bad_patterns_are_refused_naming_the_flag(pattern, pp, cpu, message):
    from megatron_rrfp.train.config import TrainConfig, validate

    with pytest.raises(ValueError) as err:
        validate(TrainConfig(model="hybrid", hybrid_layer_pattern=pattern, pipeline_model_parallel_size=pp, cpu=cpu))
    assert message in str(err.value), str(err.value)
    assert "--hybrid-layer-pattern" in str(err.value) or "--model hybrid" in str(err.value)


@needs_hybrid
def test_pattern_sets_the_layer_count_and_needs_model_hybrid():
    from megatron_rrfp.train.config import TrainConfig, from_args, validate
    from megatron_rrfp.train.driver import build_parser

    args = build_parser().parse_args(["--model", "hybrid", "--hybrid-layer-pattern", "*-*|-*-", "--num-layers", "4",
                                      "--pipeline-model-parallel-size", "2"])
    assert from_args(args).num_layers == 6  # as Megatron-LM: the pattern's count wins
    with pytest.raises(ValueError, match="--hybrid-layer-pattern needs --model hybrid"):
        validate(TrainConfig(hybrid_layer_pattern="*-"))


def test_bench_accepts_hybrid_only_where_megatron_core_has_it():
    from megatron_rrfp.bench.run import BenchConfig

    config = BenchConfig(model="hybrid", pipeline_size=2, num_chunks=2, num_microbatches=4)
    if MISSING:
        with pytest.raises(ValueError, match=r"HybridModel needs megatron-core >= 0\.18"):
            config.validate()
    else:
        config.validate()
