"""The GPU self-check's Transformer Engine steps: rrfp's split on the real TE (the CPU tests run
``tests/helpers/te_standin.py``). Every step drives TE exactly as the executor does: every
forward outside any ``deferring``, B of each microbatch inside it, W in B order, all under
megatron DDP's no_sync; it compares main_grad (and bias gradients) with the unsplit backward.

  te-bfw              te.Linear without bias, fused and not, overlap_grad_reduce on and off;
                      the deferral observed after B (TE >= 2.16 gates the store at forward
                      time), an out-of-order W refused
  te-bias             a bias inside TE's GEMM and a returned one (skip_bias_add), with
                      overlap_grad_reduce (TE's backward_dw bias bug, DDP's assertion in B)
  te-first-microbatch fused accumulation with is_first_microbatch and a full store (B inline
                      before the first W, whose GEMM overwrites main_grad)
  te-fp8              te-bias under fp8_autocast (bias gradient in B), where the GPU has FP8
  te-grouped          te.GroupedLinear experts (megatron's TEGroupedMLP), fused accumulation

Not covered here (SKIP with reason): Userbuffers overlap (refused by ``te_split_reason``:
needs ``initialize_ub``), sequence parallelism (needs TP > 1: run ``equivalence-tp2-pp2``
with --transformer-impl transformer_engine).
"""
from __future__ import annotations

import contextlib

from .result import Result, ensure_model_parallel

TOL = 1e-5


def _te():
    try:
        import transformer_engine.pytorch as te
    except ImportError:
        return None
    return te


def _stage(build):
    """(stage, ddp) for ``build()``'s TE modules inside a MegatronModule under megatron DDP."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule


    ensure_model_parallel()
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)

    class Stage(MegatronModule):
        def __init__(self):
            super().__init__(config=config)
            torch.manual_seed(3)
            self.layers, self.run = build()

        def forward(self, x, first=None):
            return self.run(self.layers, x, first)

    def wrap(overlap: bool):
        stage = Stage().cuda()
        return stage, DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=overlap),
                                              stage)
    return wrap


def _compare(wrap, *, overlap: bool, microbatches: int = 3, first: bool = False, max_pending=None,
             fp8: bool = False) -> tuple[float, list[int], str]:
    """(max relative error of every parameter's main_grad, split vs unsplit; TE queue sizes after
    all B; the out-of-order W's error text)."""
    import torch

    from ..split import megatron_linear as wgrad

    te = _te()
    xs = [torch.randn(32, 4, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(i))
          for i in range(microbatches)]
    grads, queued, refused = [], [], ""
    for split in (False, True):
        stage, ddp = wrap(overlap)
        ddp.zero_grad_buffer()
        store = None
        if split:
            wgrad.install([ddp])
            store = wgrad.WeightGradStore(models=[ddp], max_pending=max_pending)
        with ddp.no_sync():
            losses = []
            for mb, x in enumerate(xs):
                with te.fp8_autocast(enabled=True) if fp8 else contextlib.nullcontext():
                    losses.append(ddp(x, first=(mb == 0) if first else None).float().pow(2).sum())
            for mb, loss in enumerate(losses):
                if split:
                    with store.deferring((mb, 0)):
                        loss.backward()
                else:
                    if mb == len(losses) - 1:
                        break
                    loss.backward()
            if split:
                queued = [m.wgrad_store.context.qsize() for m in stage.modules() if getattr(m, "wgrad_store", None)
                          is not None and m.wgrad_store.context is not None]
                if len(store.pending()) > 1:
                    try:
                        store.run(store.pending()[1])
                    except RuntimeError as exc:
                        refused = str(exc)
                for key in store.pending():
                    store.run(key)
        if not split:
            losses[-1].backward()  # megatron's last microbatch, with sync
        ddp.finish_grad_sync()
        torch.cuda.synchronize()
        grads.append([p.main_grad.clone() for p in stage.parameters() if p.requires_grad])
    err = max(float((s - r).abs().max() / r.abs().max().clamp_min(1e-30)) for s, r in zip(grads[1], grads[0]))
    return err, queued, refused


def _result(step: str, problems: list[str], ok: str):

    return Result(step, "FAIL", "; ".join(problems)) if problems else Result(step, "PASS", ok)


def _skip(step: str, why: str):

    return Result(step, "SKIP", why)


def _split_reason(te) -> str:
    from ..split.te import te_split_reason

    return te_split_reason(te.Linear(64, 64, bias=False))


def _two_linears(te, *, bias: bool, fused: bool):
    import torch

    def build():
        a = te.Linear(64, 128, bias=bias, fuse_wgrad_accumulation=fused)  # bias inside the GEMM
        b = te.Linear(128, 64, bias=bias, return_bias=bias, fuse_wgrad_accumulation=fused)  # skip_bias_add
        return torch.nn.ModuleList([a, b]), _run_two

    return build


def _run_two(layers, x, first):
    import torch

    a, b = layers
    kwargs = {} if first is None else {"is_first_microbatch": first}
    out = b(torch.nn.functional.gelu(a(x, **kwargs)), **kwargs)
    if isinstance(out, tuple):
        out = out[0] + out[1]
    return out


def step_te_bfw(ctx):
    te = _te()
    if te is None:
        return _skip("te-bfw", "Transformer Engine is not installed")
    reason = _split_reason(te)
    if reason:
        return _skip("te-bfw", f"this Transformer Engine cannot be split by rrfp: {reason}")
    problems = []
    for fused in (True, False):
        for overlap in (False, True):
            err, queued, refused = _compare(_stage(_two_linears(te, bias=False, fused=fused)), overlap=overlap)
            case = f"fused={fused} overlap_grad_reduce={overlap}"
            if err > TOL:
                problems.append(f"{case}: split main_grad differs from unsplit (max rel err {err:.2e})")
            if not queued or min(queued) < 3:
                problems.append(f"{case}: TE queued {queued} entries after 3 B (forward outside deferring): W not "
                                "deferred")
            if "FIFO" not in refused:
                problems.append(f"{case}: an out-of-order W was not refused ({refused or 'no error'})")
    return _result("te-bfw", problems, f"te.Linear {te.__name__} split, forward outside deferring: W deferred "
                   "(queued after B), main_grad equal to unsplit (fused / not, overlap on / off), W order enforced")


def step_te_bias(ctx, *, fp8: bool = False):
    step = "te-fp8" if fp8 else "te-bias"
    te = _te()
    if te is None:
        return _skip(step, "Transformer Engine is not installed")
    if fp8:
        check = getattr(getattr(te, "fp8", None), "check_fp8_support", None)
        if check is None:
            return _skip(step, "this Transformer Engine has no fp8.check_fp8_support to ask")
        available, why = check()
        if not available:
            return _skip(step, f"no FP8 on this GPU: {why}")
    reason = _split_reason(te)
    if reason:
        return _skip(step, f"this Transformer Engine cannot be split by rrfp: {reason}")
    problems = []
    tol = 1e-3 if fp8 else TOL  # FP8: same quantisation both ways; the GEMM order may differ
    for overlap in (False, True):
        err, queued, _ = _compare(_stage(_two_linears(te, bias=True, fused=True)), overlap=overlap, fp8=fp8)
        if err > tol:
            problems.append(f"overlap_grad_reduce={overlap}: split gradients differ (max rel err {err:.2e})")
        if not queued or min(queued) < 3:
            problems.append(f"overlap_grad_reduce={overlap}: W not deferred (queued {queued})")
    return _result(step, problems, "bias inside the GEMM and returned (skip_bias_add), overlap on / off: split equal "
                   "to unsplit (TE's backward_dw bias bug worked around)")


def step_te_fp8(ctx):
    return step_te_bias(ctx, fp8=True)


def step_te_first_microbatch(ctx):
    te = _te()
    if te is None:
        return _skip("te-first-microbatch", "Transformer Engine is not installed")
    problems = []
    for max_pending in (None, 1):
        err, _, _ = _compare(_stage(_two_linears(te, bias=False, fused=True)), overlap=False, first=True,
                             max_pending=max_pending)
        if err > TOL:
            problems.append(f"max_pending={max_pending}: split main_grad differs (max rel err {err:.2e})")
    return _result("te-first-microbatch", problems, "fused accumulation with is_first_microbatch (GEMM overwrites "
                   "main_grad), in order and with a full store: split equal to unsplit")


def step_te_grouped(ctx):
    te = _te()
    if te is None:
        return _skip("te-grouped", "Transformer Engine is not installed")
    if not hasattr(te, "GroupedLinear"):
        return _skip("te-grouped", "this Transformer Engine has no GroupedLinear")
    import torch

    def build():
        fc1 = te.GroupedLinear(2, 64, 128, bias=False, fuse_wgrad_accumulation=True)
        fc2 = te.GroupedLinear(2, 128, 64, bias=False, fuse_wgrad_accumulation=True)
        return torch.nn.ModuleList([fc1, fc2]), _run_grouped

    problems = []
    for overlap in (False, True):
        err, queued, _ = _compare(_stage(build), overlap=overlap)
        if err > TOL:
            problems.append(f"overlap_grad_reduce={overlap}: split main_grad differs (max rel err {err:.2e})")
        if not queued or min(queued) < 3:
            problems.append(f"overlap_grad_reduce={overlap}: W not deferred (queued {queued})")
    return _result("te-grouped", problems, "te.GroupedLinear experts (2 GEMMs), fused: W deferred, equal to unsplit")


def _run_grouped(layers, x, first):
    import torch

    fc1, fc2 = layers
    flat = x.reshape(-1, x.shape[-1])
    splits = [flat.shape[0] // 2, flat.shape[0] - flat.shape[0] // 2]
    return fc2(torch.nn.functional.gelu(fc1(flat, splits)), splits).reshape(x.shape)


TE_STEPS = {"te-bfw": step_te_bfw, "te-bias": step_te_bias, "te-first-microbatch": step_te_first_microbatch,
            "te-fp8": step_te_fp8, "te-grouped": step_te_grouped}

__all__ = ["TE_STEPS"]
