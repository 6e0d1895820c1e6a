"""megatron-core's HybridModel (0.18+) with the project's local stack spec (mcore/hybrid_spec.py).

RRFP against megatron-core's interleaved schedule on model chunks (2 chunks, PP=2, random
delays; losses and every gradient within 1e-5), and ``megatron-rrfp train --model hybrid``
at PP=2: rrfp's logged losses equal 1f1b's. On releases without HybridModel (leg A:
0.16.1) the tests skip with the version needed, and ``train --model hybrid`` is refused.
"""
from __future__ import annotations

import pytest
from test_executor import _check
from test_train import TINY, losses, train

from helpers.interleaved import compare_interleaved_transports
from megatron_rrfp.dist.launcher import launch
from megatron_rrfp.mcore.compat import hybrid_model_unavailable

MISSING = hybrid_model_unavailable()
needs_hybrid = pytest.mark.skipif(bool(MISSING), reason=MISSING)
HYBRID = [*TINY, "--model", "hybrid", "--hybrid-layer-pattern", "*-|*-"]


@needs_hybrid
@pytest.mark.timeout(400)
@pytest.mark.parametrize("hint", [None, "bf"], ids=["default", "bf"])
def test_hybrid_chunks_match_megatron_interleaved(hint):
    results = launch(compare_interleaved_transports, world_size=2, vpp=2, timeout=360, args=(("threads",),),
                     kwargs={"model": "hybrid", "iterations": 2, "hint": hint})
    _check(results)


@needs_hybrid
@pytest.mark.timeout(400)
def test_train_hybrid_rrfp_losses_equal_1f1b():
    rrfp = losses(train(*HYBRID, "--pipeline-schedule", "rrfp"))
    reference = losses(train(*HYBRID, "--pipeline-schedule", "1f1b"))
    assert sorted(rrfp) == sorted(reference) == [1, 2, 3, 4, 5, 6]
    for iteration, loss in reference.items():
        assert rrfp[iteration] == pytest.approx(loss, rel=1e-5, abs=1e-6), (iteration, rrfp, reference)
    assert rrfp[6] < rrfp[1] - 0.05, rrfp  # it learns


@pytest.mark.skipif(not MISSING, reason="refused only where megatron-core has no HybridModel")
def test_train_hybrid_is_refused_naming_the_release_needed():
    result = train(*HYBRID, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "megatron-core >= 0.18" in result.stderr, result.stderr
