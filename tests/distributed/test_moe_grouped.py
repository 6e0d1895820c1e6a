"""Grouped-GEMM experts (``--moe-grouped-gemm``: megatron-core's TEGroupedMLP) split by rrfp.

megatron-core's MoE GPTModel at EP2 x PP2 on 4 gloo ranks (alltoall dispatcher, 4 experts, top-2,
aux loss) with its experts from the TE backend spec (``get_moe_module_spec_for_backend(TESpecProvider(),
moe_grouped_gemm=True)``: TEGroupedMLP of TEColumnParallelGroupedLinear / TERowParallelGroupedLinear,
2 local experts per GroupedLinear), built by megatron-core's own TE extension over the CPU stand-in
importable as ``transformer_engine`` (helpers/te_package.py, as TE 2.8 and as TE 2.15, one after
the other in each rank). The rest of the layer is the local spec. rrfp's default policy (the
split) against megatron-core's 1F1B on the same data and seeds, each replica on its own data,
random task delays: losses and every gradient
(the experts' main_grads included) equal, and the experts' weight gradients really deferred to W
through TE's own store (entries queued in B, all popped by W).
"""
from __future__ import annotations

import importlib.util

import pytest

from helpers.equivalence import Case, grouped_gemm_cases
from megatron_rrfp.launch.function import launch

TOL = 1e-5
TE_VERSIONS = ("2.8", "2.15")  # megatron-core passes single_grouped_weight / _bias to TE >= 2.14 only


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                    reason="a real Transformer Engine is installed: the stand-in would shadow it "
                           "(scripts/gpu_selfcheck.py --steps te-grouped runs the real one)")
@pytest.mark.timeout(300)
def test_moe_grouped_gemm_ep2_pp2_default_split_like_megatron_1f1b():
    cases = [Case(model="moe_grouped", iterations=2, num_microbatches=4, hint="default", buffer_limit="1x")]
    results = launch(grouped_gemm_cases, world_size=4, pp=2, ep=2, timeout=240, args=(cases, TE_VERSIONS))
    assert all([r["te_version"] for r in rank] == list(TE_VERSIONS) for rank in results)
    runs = [list(run) for run in zip(*results)]  # per TE version: the 4 ranks' results
    for r in (r for run in runs for r in run):
        assert r["loss_rel_err"] <= TOL and r["grad_rel_err"] <= TOL, r
        te = r["grouped_te"]
        assert te["classes"] == [("TEGroupedMLP", "TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear")], te
        # 2 layers per stage x (fc1, fc2): every deferred B put one entry per module, its W popped them;
        # a B the 1x byte budget ran unsplit (docs/memory.md) queued nothing and its W was a no-op
        w_tasks = sum(task[1] == "W" for order in r["orders"] for task in order.split(","))
        deferred = w_tasks - r["unsplit_backwards"]
        assert te["modules"] == 4 and deferred > 0 and te["queued"] == 4 * deferred and te["left"] == 0, \
            (te, r["orders"], r["unsplit_backwards"])
        assert te["main_grad_abs"] > 0, te
    for run in runs:
        assert sum(r["num_losses"] for r in run) > 0
        assert any(order != r["megatron_order"] for r in run for order in r["orders"])
