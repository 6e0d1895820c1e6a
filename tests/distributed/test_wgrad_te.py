"""Transformer Engine's own B/W split driven by rrfp's W (megatron_rrfp.split.te).

    python -m pytest tests/distributed/test_wgrad_te.py -q

TE needs CUDA: these tests run ``helpers.te_standin`` (a CPU module rebuilt from TE's source,
tagged by version 2.3 ... 2.20) inside a megatron-core module, plain and under megatron-core
DDP (fused accumulation into main_grad or not, overlap_grad_reduce on and off), against the
same stage's unsplit backward. As the executor drives it: every forward outside any
``deferring``, B inside it, W in B order. Each bug found in this path has a case that failed
before its fix: the bias cases, the overlapped-bias cases, every 2.20 case, blockers_ub,
first-store-full, grouped, the SP test. The real TE path is checked on a GPU by
``scripts/gpu_selfcheck.py --steps te-bfw,te-bias,te-first-microbatch,te-fp8,te-grouped``.
"""
from __future__ import annotations

import contextlib

import pytest

from megatron_rrfp.launch.function import launch

HIDDEN, FFN, SEQ, MBS, MICROBATCHES = 16, 32, 8, 2, 4


def _stage(ddp: str, *, fused: bool, delay: bool = False, bias: str = "none", ub: bool = False, experts: int = 0):
    from helpers.te_standin import StandInStage
    from megatron_rrfp.train import models

    config = models.tiny_gpt_config()
    stage = StandInStage(config, hidden=HIDDEN, ffn=FFN, seed=5, fused=fused, delay=delay, bias=bias,
                         ub_bulk_dgrad=ub, experts=experts)
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


def _te_modules(stage):
    mods = [stage.te1, stage.te2]
    if stage.experts is not None:
        mods += [stage.experts.linear_fc1, stage.experts.linear_fc2]
    return mods


def _run(ddp: str, fused: bool, split: bool, *, iterations: int = 2, bias: str = "none", fp8: bool = False,
         first: bool = False, max_pending=None, experts: int = 0) -> tuple[list, dict]:
    """Per-iteration gradients. As the executor drives it: every F outside any deferring, B of
    each microbatch inside ``deferring`` (after all F), then W in B order, all under no_sync;
    unsplit: megatron's pattern (sync for the last). ``first``: megatron's is_first_microbatch
    (set at each iteration's start, as its schedules do)."""
    import contextlib

    from helpers import te_standin
    from megatron_rrfp.split import megatron_linear as wgrad

    stage, model = _stage(ddp, fused=fused, bias=bias, experts=experts)
    facts = {}
    store = None
    if split:
        wgrad.install([model])
        store = wgrad.WeightGradStore(models=[model], max_pending=max_pending)
        facts["deferred"] = sorted(p for p in _names(stage, wgrad.deferred_parameters([model])))
    hook_calls = _count_ddp_hooks(model, stage) if ddp else None
    out = []
    with te_standin.fp8_autocast(fp8):
        for _ in range(iterations):
            if ddp:
                model.zero_grad_buffer()
            else:
                stage.zero_grad()
            stage.is_first_microbatch = True if first else None
            xs = _inputs()
            if split:
                with model.no_sync() if ddp else contextlib.nullcontext():
                    losses = [model(x).pow(2).sum() for x in xs]  # F: outside any deferring
                    for mb, loss in enumerate(losses):
                        with store.deferring((mb, 0)):
                            loss.backward()
                    facts["after_b_weight_grads"] = {n: (p.grad is not None and bool(p.grad.abs().max() > 0))
                                                     for n, p in stage.named_parameters() if "weight" in n
                                                     and "norm" not in n}
                    facts["queued_after_b"] = [m.wgrad_store.context.qsize() for m in _te_modules(stage)]
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


def _compare(ddp, fused, **kw) -> dict:
    ref, _ = _run(ddp, fused, split=False, **kw)
    try:
        got, facts = _run(ddp, fused, split=True, **kw)
    except Exception as exc:  # a crash is a finding: report it, do not hide the others
        return {"error": f"{type(exc).__name__}: {exc}"}
    err = max(float((g[n] - r[n]).abs().max() / max(float(r[n].abs().max()), 1e-30))
              for g, r in zip(got, ref, strict=True) for n in r)
    return dict(facts, max_err=err)


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


BASE_CASES = (("", False), ("ddp", True), ("ddp", False), ("overlap", True), ("overlap", False))
VERSIONS = ("2.3", "2.15", "2.20")  # 2.3: 4-tuple pop, no hooks; 2.15: no forward gating; 2.16+: gated
BIAS_CASES = (  # (ddp, fused, fp8): a bias in the GEMM (te1) and a returned one (te2)
    ("", False, False), ("ddp", True, True), ("overlap", True, False), ("overlap", False, True))


def te_split_suite() -> dict:
    from helpers import te_standin
    from megatron_rrfp.cpu import enable_cpu_reference_schedules
    from megatron_rrfp.split import megatron_linear as wgrad

    enable_cpu_reference_schedules()

    results = {}
    for version in VERSIONS:
        with te_standin.te_version(version):
            for ddp, fused in BASE_CASES:
                results[f"{version}:{ddp or 'plain'}-{'fused' if fused else 'unfused'}"] = _compare(ddp, fused)
    for version in ("2.3", "2.20"):
        with te_standin.te_version(version):
            for ddp, fused, fp8 in BIAS_CASES:
                name = f"{version}:bias:{ddp or 'plain'}-{'fused' if fused else 'unfused'}{'-fp8' if fp8 else ''}"
                results[name] = _compare(ddp, fused, bias="both", fp8=fp8)
    for version in ("2.15", LATEST):  # 2.15: no forward-time gating, so only the overwrite is tested
        with te_standin.te_version(version):
            # is_first_microbatch with fused accumulation: in order, and with the store full (B2, B3
            # computed inline before W0, whose GEMM overwrites main_grad).
            results[f"{version}:first"] = _compare("ddp", True, first=True)
            results[f"{version}:first-store-full"] = _compare("ddp", True, first=True, max_pending=2)
    with te_standin.te_version(LATEST):
        # Grouped-GEMM experts (TE GroupedLinear inside megatron's TEGroupedMLP shape).
        results["grouped-ddp"] = _compare("ddp", True, experts=2)
        results["grouped-overlap"] = _compare("overlap", True, experts=2)

    try:
        results.update(_fifo_and_failed_b())
    except Exception as exc:  # recorded: the assertions name it
        results["fifo_error"] = f"{type(exc).__name__}: {exc}"

    # Refusals: one line each, and the default policy's blocker list names them.
    results["blockers_delayed"] = wgrad.deferral_blockers([_stage("", fused=False, delay=True)[1]])
    results["blockers_ub"] = wgrad.deferral_blockers([_stage("", fused=True, ub=True)[1]])
    results["blockers_grouped_unfused"] = wgrad.deferral_blockers([_stage("", fused=False, experts=2)[1]])
    _, fused_impl = _stage("", fused=True, experts=2)
    fused_impl.experts._with_fused_impl = True
    results["blockers_op_fuser"] = wgrad.deferral_blockers([fused_impl])
    results["blockers_grouped_fused"] = wgrad.deferral_blockers([_stage("ddp", fused=True, experts=2)[1]])
    results["blockers_unfused_overlap"] = wgrad.deferral_blockers([_stage("overlap", fused=False)[1]])
    return results


LATEST = "2.20"


def _fifo_and_failed_b() -> dict:
    from megatron_rrfp.split import megatron_linear as wgrad

    results = {}
    # Out-of-order W: refused before any gradient changes, then the right order works.
    stage, model = _stage("", fused=False)
    wgrad.install([model])
    store = wgrad.WeightGradStore(models=[model])
    losses = [model(x).pow(2).sum() for x in _inputs()[:2]]
    for mb, loss in enumerate(losses):
        with store.deferring((mb, 0)):
            loss.backward()
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
    loss = model(_inputs()[0]).pow(2).sum()
    try:
        with with_error.deferring((7, 0)):
            loss.backward()
            raise ValueError("boom")
    except ValueError:
        pass
    results["after_failed_b"] = [m.wgrad_store.context.qsize() for m in (stage.te1, stage.te2)]

    return results


def ub_aliasing_breaks_the_split() -> float:
    """What the Userbuffers refusal prevents: forced through, the split's W reads a UB buffer a
    later layer overwrote (relative error of te1's weight gradient vs the unsplit one)."""
    import torch

    from helpers import te_standin
    from megatron_rrfp.split import te as wgrad_te

    results = []
    for split in (False, True):
        stage, _ = _stage("", fused=False, ub=True)  # te1 of microbatch 1 overwrites microbatch 0's UB input
        stage.te_version = te_standin.te_version("2.15")  # no forward-time gating: TeSplit is driven directly
        stage.te_version.__enter__()
        te = wgrad_te.TeSplit([("te1", stage.te1), ("te2", stage.te2)], ddp_of=lambda p: None,
                              hold=lambda key, t: None)
        losses = [stage(x).pow(2).sum() for x in _inputs()[:2]]
        for mb, loss in enumerate(losses):
            if split:
                te.begin((mb, 0))
            loss.backward()
            if split:
                te.end((mb, 0), ok=True)
        if split:
            te.run((0, 0))
            te.run((1, 0))
        results.append(stage.te1.weight.grad.clone())
        stage.te_version.__exit__(None, None, None)
    return float((results[1] - results[0]).abs().max() / results[0].abs().max()) if torch.isfinite(
        results[1]).all() else float("inf")


def missing_attribute_blocker() -> list[str]:
    from helpers.te_standin import Linear as StandInTELinear
    from megatron_rrfp.split import megatron_linear as wgrad

    class OldStore:  # a store without the run-time switch (older TE)
        def delay_wgrad_compute(self):
            return False

    module = StandInTELinear(4, 4)
    module.wgrad_store = OldStore()
    return wgrad.deferral_blockers([module])


@pytest.fixture(scope="module")
def suite() -> dict:
    return launch(te_split_suite, world_size=1, timeout=170)[0]


def _ok(out, case, deferred=("te1.weight", "te2.weight")):
    r = out[case]
    assert "error" not in r, (case, r)
    assert r["max_err"] <= 1e-6, (case, r)
    assert all(name in r["deferred"] for name in deferred), (case, r)
    assert r["pending_after_w"] == [] and r["pending_bytes_after_b"] > 0, (case, r)
    return r


@pytest.mark.timeout(180)
def test_te_split_equals_unsplit_on_every_te_version_with_f_outside_deferring(suite):
    """Finding 3 (TE >= 2.16 Linear keeps its store only if the deferral is on at forward time)
    and the overlap_grad_reduce + unfused case (was refused): split == unsplit, W deferred."""
    for version in VERSIONS:
        for ddp, fused in BASE_CASES:
            r = _ok(suite, f"{version}:{ddp or 'plain'}-{'fused' if fused else 'unfused'}")
            assert r["queued_after_b"] == [MICROBATCHES, MICROBATCHES], r  # W really deferred
            assert not any(r["after_b_weight_grads"].values()), r
    # W handed DDP's hook each TE weight's gradient once per W (2 iterations x 4 microbatches) and
    # nothing else; fused accumulation writes main_grad directly, with no gradient to hand over.
    hooks = suite[f"{LATEST}:ddp-unfused"]["hooks_with_grad"]
    assert hooks == {"te1.weight": 2 * MICROBATCHES, "te2.weight": 2 * MICROBATCHES}, hooks
    assert "te1.weight" not in suite[f"{LATEST}:ddp-fused"]["hooks_with_grad"]


@pytest.mark.timeout(180)  # may be the test that launches the suite
def test_te_bias_in_gemm_returned_and_fp8_split(suite):
    """Findings 1 (TE's backward_dw crashes on a bias whose gradient came in B: returned bias,
    FP8) and 2 (overlap_grad_reduce with a bias TE folds into its deferred GEMM: DDP's hook
    asserts in B), on TE 2.3 and the 2.20 line."""
    for version in ("2.3", LATEST):
        for ddp, fused, fp8 in BIAS_CASES:
            name = f"{version}:bias:{ddp or 'plain'}-{'fused' if fused else 'unfused'}{'-fp8' if fp8 else ''}"
            _ok(suite, name)


@pytest.mark.timeout(180)  # may be the test that launches the suite
def test_te_first_microbatch_overwrite_stays_exact(suite):
    """Finding 5: with fused accumulation the first-forwarded microbatch's GEMM overwrites
    main_grad; with the store full (B2, B3 inline before W0) that would drop their gradient."""
    for version in ("2.15", LATEST):
        _ok(suite, f"{version}:first")
        r = _ok(suite, f"{version}:first-store-full")
        assert r["queued_after_b"] == [2, 2], r


@pytest.mark.timeout(180)  # may be the test that launches the suite
def test_te_grouped_experts_split(suite):
    """Finding 6: TE GroupedLinear experts (TEGroupedMLP) split; the op-fuser path and unfused
    GroupedLinear are refused with one line each."""
    experts = ("experts.linear_fc1.weight0", "experts.linear_fc1.weight1", "experts.linear_fc2.weight1")
    for case in ("grouped-ddp", "grouped-overlap"):
        r = _ok(suite, case, deferred=experts)
        assert r["queued_after_b"] == [MICROBATCHES] * 4, r
    assert suite["blockers_grouped_fused"] == [], suite["blockers_grouped_fused"]
    assert any("use_transformer_engine_op_fuser" in b for b in suite["blockers_op_fuser"])
    assert any("GroupedLinear without gradient_accumulation_fusion" in b for b in suite["blockers_grouped_unfused"])


@pytest.mark.timeout(180)  # may be the test that launches the suite
def test_te_refusals_fifo_and_failed_b(suite):
    out = suite
    assert "fifo_error" not in out, out["fifo_error"]
    assert "FIFO" in out["out_of_order"] and "(0, 0)" in out["out_of_order"] and out["untouched_after_refusal"]
    assert out["queues_empty"] == [0, 0] and out["after_failed_b"] == [0, 0]
    assert any("delay_wgrad_compute=True" in b for b in out["blockers_delayed"])
    assert out["blockers_unfused_overlap"] == [], out["blockers_unfused_overlap"]
    # Finding 4: Userbuffers overlap refused (ub_bulk_dgrad: TE's own check only covers the wgrad ones).
    assert any("Userbuffers" in b and "ub_bulk_dgrad" in b for b in out["blockers_ub"]), out["blockers_ub"]


@pytest.mark.timeout(70)
def test_te_userbuffers_aliasing_is_what_the_refusal_prevents():
    err = launch(ub_aliasing_breaks_the_split, world_size=1, timeout=60)[0]
    assert err > 1e-3, err


def test_te_module_missing_attribute_is_a_blocker():
    blockers = missing_attribute_blocker()
    assert len(blockers) == 1 and "lacks" in blockers[0] and "enable_delay_wgrad_compute" in blockers[0]


def _te_sequence_parallel() -> dict:
    import torch
    from megatron.core import parallel_state

    from helpers import te_standin
    from megatron_rrfp.split import megatron_linear as wgrad

    group = parallel_state.get_tensor_model_parallel_group()
    tp = torch.distributed.get_world_size(group)
    gen = torch.Generator().manual_seed(3 + torch.distributed.get_rank())
    xs = [torch.randn(SEQ // tp, MBS, HIDDEN, generator=gen) for _ in range(MICROBATCHES)]
    grads, held = [], 0
    for split in (False, True):
        torch.manual_seed(1)
        layer = te_standin.Linear(HIDDEN, FFN, parallel_mode="column", sequence_parallel=True, tp_group=group)
        store = wgrad.WeightGradStore(models=[layer]) if split else None
        if split:
            wgrad.install([layer])
        losses = [layer(x).pow(2).sum() for x in xs]
        for mb, loss in enumerate(losses):
            with store.deferring((mb, 0)) if split else contextlib.nullcontext():
                loss.backward()
        if split:
            held = store.pending_bytes()
            queued = layer.wgrad_store.context.qsize()
            for mb in range(MICROBATCHES):
                store.run((mb, 0))
        grads.append(layer.weight.grad.clone())
    local = xs[0].numel() * xs[0].element_size()
    dy = SEQ * MBS * (FFN // 1) * xs[0].element_size()
    return {"held": held, "expected": MICROBATCHES * (local + dy), "gathered": MICROBATCHES * (tp * local + dy),
            "queued": queued, "max_err": float((grads[1] - grads[0]).abs().max() / grads[0].abs().max())}


def te_sequence_parallel_suite() -> dict:
    """Finding 7: a column-parallel SP TE layer queues the TP-gathered input for W; the split
    keeps this rank's shard and W gathers it again, so W holds what autograd saved anyway
    (the local input) plus the output gradient, and the gradients equal the unsplit ones.
    On 2.15 (no forward gating: only this finding) and the 2.20 line."""
    from helpers import te_standin

    out = {}
    for version in ("2.15", LATEST):
        with te_standin.te_version(version):
            out[version] = _te_sequence_parallel()
    return out


@pytest.mark.timeout(120)
def test_te_sequence_parallel_w_holds_the_local_input_only():
    for by_version in launch(te_sequence_parallel_suite, world_size=2, tp=2, pp=1, timeout=110):
        for out in by_version.values():
            assert out["queued"] == MICROBATCHES and out["max_err"] <= 1e-6, by_version
            assert out["held"] == out["expected"] < out["gathered"], by_version
