"""Transformer Engine's own B/W split driven by rrfp's W (megatron_rrfp.mcore.wgrad_te).

    python -m pytest tests/test_wgrad_te.py -q

TE needs CUDA: these tests run ``helpers.te_standin`` (a CPU module following TE's
documented WeightGradStore contract) inside a megatron-core module, plain and under
megatron-core DDP (fused accumulation into main_grad, with and without
overlap_grad_reduce), against the same stage's unsplit backward. The real TE path is
checked on a GPU by ``scripts/gpu_selfcheck.py --steps te-bfw``.
"""
from __future__ import annotations

import pytest

from megatron_rrfp.dist.launcher import launch

HIDDEN, FFN, SEQ, MBS, MICROBATCHES = 16, 32, 8, 2, 4


def _stage(ddp: str, *, fused: bool, delay: bool = False):
    from helpers.te_standin import StandInStage
    from megatron_rrfp.train import models

    config = models.tiny_gpt_config()
    stage = StandInStage(config, hidden=HIDDEN, ffn=FFN, seed=5, fused=fused, delay=delay)
    model = stage
    if ddp:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        model = DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=ddp == "overlap"),
                                        stage)
    return stage, model


def _inputs():
    import torch

    gen = torch.Generator().manual_seed(11)
    return [torch.randn(SEQ, MBS, HIDDEN, generator=gen) for _ in range(MICROBATCHES)]


def _grads(stage) -> dict:
    return {n: (p.main_grad if hasattr(p, "main_grad") else p.grad).detach().clone()
            for n, p in stage.named_parameters()}


def _run(ddp: str, fused: bool, split: bool, iterations: int = 2) -> tuple[list, dict]:
    """Per-iteration gradients; split: B of every microbatch deferred (in order), then W in
    the same order, all under no_sync; unsplit: megatron's pattern (sync for the last)."""
    import contextlib

    from megatron_rrfp.mcore import wgrad

    stage, model = _stage(ddp, fused=fused)
    facts = {}
    store = None
    if split:
        wgrad.install([model])
        store = wgrad.WeightGradStore(models=[model])
        facts["deferred"] = sorted(p for p in _names(stage, wgrad.deferred_parameters([model])))
    hook_calls = _count_ddp_hooks(model, stage) if ddp else None
    out = []
    for _ in range(iterations):
        if ddp:
            model.zero_grad_buffer()
        else:
            stage.zero_grad()
        xs = _inputs()
        if split:
            with model.no_sync() if ddp else contextlib.nullcontext():
                for mb, x in enumerate(xs):
                    with store.deferring((mb, 0)):
                        model(x).pow(2).sum().backward()
                facts["after_b_weight_grads"] = {n: (p.grad is not None and bool(p.grad.abs().max() > 0))
                                                 for n, p in stage.named_parameters() if "te" in n}
                facts["pending_bytes_after_b"] = store.pending_bytes()
                for mb in range(MICROBATCHES):
                    store.run((mb, 0))
            facts["pending_after_w"] = store.pending()
        else:
            for mb, x in enumerate(xs):
                sync = model.no_sync() if ddp and mb < MICROBATCHES - 1 else contextlib.nullcontext()
                with sync:
                    model(x).pow(2).sum().backward()
        if ddp:
            model.finish_grad_sync()
        out.append(_grads(stage))
    if hook_calls is not None:
        facts["hooks_with_grad"] = dict(hook_calls)
    return out, facts


def _names(stage, params) -> list[str]:
    ids = {id(p) for p in params}
    return [n for n, p in stage.named_parameters() if id(p) in ids]


def _count_ddp_hooks(ddp, stage):
    """Wrap DDP's hook factory (from outside) to count calls that carried a gradient."""
    import collections

    calls = collections.Counter()
    names = {id(p): n for n, p in stage.named_parameters()}
    make = ddp._make_backward_post_hook

    def counting(param):
        hook = make(param)

        def wrapped(*args):
            if param.grad is not None:
                calls[names[id(param)]] += 1
            return hook(*args)
        return wrapped

    ddp._make_backward_post_hook = counting
    return calls


def te_split_suite() -> dict:
    from megatron_rrfp.mcore import wgrad
    from megatron_rrfp.mcore.cpu import enable_cpu_reference_schedules

    enable_cpu_reference_schedules()

    results = {}
    for ddp, fused in (("", False), ("ddp", True), ("ddp", False), ("overlap", True)):
        ref, _ = _run(ddp, fused, split=False)
        got, facts = _run(ddp, fused, split=True)
        err = max(float((g[n] - r[n]).abs().max() / r[n].abs().max()) for g, r in zip(got, ref) for n in r)
        results[f"{ddp or 'plain'}-{'fused' if fused else 'unfused'}"] = dict(facts, max_err=err)

    # Out-of-order W: refused before any gradient changes, then the right order works.
    stage, model = _stage("", fused=False)
    wgrad.install([model])
    store = wgrad.WeightGradStore(models=[model])
    for mb, x in enumerate(_inputs()[:2]):
        with store.deferring((mb, 0)):
            model(x).pow(2).sum().backward()
    before = {n: None if p.grad is None else p.grad.clone() for n, p in stage.named_parameters()}
    try:
        store.run((1, 0))
    except RuntimeError as exc:
        results["out_of_order"] = str(exc)
    results["untouched_after_refusal"] = all(
        (before[n] is None and p.grad is None) or (before[n] is not None and bool((p.grad == before[n]).all()))
        for n, p in stage.named_parameters())
    store.run((0, 0))
    store.run((1, 0))
    results["queues_empty"] = [m.wgrad_store.context.qsize() for m in (stage.te1, stage.te2)]

    # A B that raises leaves nothing queued.
    with_error = wgrad.WeightGradStore(models=[model])
    try:
        with with_error.deferring((7, 0)):
            model(_inputs()[0]).pow(2).sum().backward()
            raise ValueError("boom")
    except ValueError:
        pass
    results["after_failed_b"] = [m.wgrad_store.context.qsize() for m in (stage.te1, stage.te2)]

    # Refusals: one line each, and the default policy's blocker list names them.
    _, built_delayed = _stage("", fused=False, delay=True)
    _, unfused_overlap = _stage("overlap", fused=False)
    results["blockers_delayed"] = wgrad.deferral_blockers([built_delayed])
    results["blockers_unfused_overlap"] = wgrad.deferral_blockers([unfused_overlap])
    return results


def missing_attribute_blocker() -> list[str]:
    from helpers.te_standin import StandInTELinear
    from megatron_rrfp.mcore import wgrad

    class OldStore:  # a store without the run-time switch (older TE)
        def delay_wgrad_compute(self):
            return False

    module = StandInTELinear(4, 4)
    module.wgrad_store = OldStore()
    return wgrad.deferral_blockers([module])


@pytest.mark.timeout(150)
def test_te_standin_split_equals_unsplit_fifo_and_refusals():
    out = launch(te_split_suite, world_size=1, timeout=140)[0]
    for case in ("plain-unfused", "ddp-fused", "ddp-unfused", "overlap-fused"):
        r = out[case]
        assert r["max_err"] <= 1e-6, (case, r)
        assert r["deferred"] == ["te1.weight", "te2.weight"], r
        assert r["pending_after_w"] == [] and r["pending_bytes_after_b"] > 0
    # In B the TE weights got nothing (unfused: None; fused: a dummy, nothing in main_grad yet).
    assert not any(out["plain-unfused"]["after_b_weight_grads"].values())
    # W handed DDP's hook each TE weight's gradient once per W (2 iterations x 4 microbatches) and
    # nothing else (the counter wraps DDP's hook factory after DDP made its autograd hooks: W's calls
    # only); fused accumulation writes main_grad directly, with no gradient to hand over.
    hooks = out["ddp-unfused"]["hooks_with_grad"]
    assert hooks == {"te1.weight": 2 * MICROBATCHES, "te2.weight": 2 * MICROBATCHES}, hooks
    assert "te1.weight" not in out["ddp-fused"]["hooks_with_grad"]
    assert "FIFO" in out["out_of_order"] and "(0, 0)" in out["out_of_order"] and out["untouched_after_refusal"]
    assert out["queues_empty"] == [0, 0] and out["after_failed_b"] == [0, 0]
    assert any("delay_wgrad_compute=True" in b for b in out["blockers_delayed"])
    assert any("gradient_accumulation_fusion" in b for b in out["blockers_unfused_overlap"])


def test_te_module_missing_attribute_is_a_blocker():
    blockers = missing_attribute_blocker()
    assert len(blockers) == 1 and "lacks" in blockers[0] and "enable_delay_wgrad_compute" in blockers[0]
