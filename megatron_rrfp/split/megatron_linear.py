"""Split a stage's backward into B (input gradients) and W (deferred weight gradients).

The BFW hint (zero-bubble style) runs, per microbatch and model chunk, B as soon as the
output gradient arrives — only what the upstream stage waits for — and W later, as
filler. This module provides that split for megatron-core's own linear layers::

    wgrad.install(models)                      # once; idempotent
    store = wgrad.WeightGradStore()
    with store.deferring((mb, chunk)):         # B: megatron's backward_step as usual
        input_grad = backward_step(...)
    ...                                        # F and B of other microbatches
    store.run((mb, chunk))                     # W, in any order relative to other keys

What is deferred: the weight gradient ``grad_output^T @ input`` of every
``ColumnParallelLinear`` / ``RowParallelLinear`` (local spec, no Transformer Engine) in
the installed models — in a GPT layer linear_qkv, linear_proj, linear_fc1, linear_fc2,
and the output layer. That is the bulk of a transformer's weight-gradient FLOPs.

What stays in B (computed by autograd during the backward, exactly as before): biases
(cheap, several are added outside the linear's autograd function anyway), LayerNorm weights,
embeddings, any parameter of other modules (``wgrad_coverage.coverage(models)`` lists both).
A weight tied to an embedding (shared output layer) has its output-layer part deferred.

How (B wraps megatron-core, it does not re-implement it): ``capture.py``.

Exactness: ``run(key)`` runs the intercepted GEMM (or fused call) on the same tensors,
under the forward's autocast state, and accumulates it where the unsplit backward would
have (``_accumulate``); outside ``deferring`` the layers run megatron-core's own backward.
A backward that does not take the intercepted path keeps megatron-core's own weight
gradient (not deferred, still exact). ``install`` and ``deferral_blockers`` run
``split_self_check`` once per process: one tiny split and unsplit backward through
megatron-core's linear function (no collectives; with and without bias) whose output,
input, weight and bias gradients must be bit-identical, and whose weight gradient must
really have been deferred. If not (a megatron-core release the interception no longer
fits), ``deferral_blockers`` returns the reason, naming the version — the default policy
then runs unsplit and says so in one line — and ``install`` raises NotImplementedError
(an explicit split hint is refused before its first iteration, ``stage_work``).

Megatron-core DistributedDataParallel (pass the DDP-wrapped chunks to ``install``): ``run``
puts the weight gradient in ``param.grad`` and calls DDP's own per-parameter hook
(``_make_backward_post_hook``), so main_grad receives exactly what the unsplit backward
gives it. DDP's no_sync (``config.no_sync_func``) stays on over every B and W: its hook's
readiness counting would be wrong from B (too early) or from W (B-computed parameters never
counted). With overlap_grad_reduce the executor counts readiness itself
(``grad_sync.SplitReadiness``: each parameter once, after its last W or B of the iteration;
``run(key, after_weight=...)`` reports weights as they complete), B hands the hook what
megatron's own delayed-wgrad path does (an uninitialised ``torch.empty`` with
``grad_added_to_main_grad`` set: its assertion wants a gradient, it adds none;
``wgrad_store.register_b_placeholder``), and this module raises if B or W runs with sync on.
``gradient_accumulation_fusion`` (CUDA + APEX): W makes the fused-kernel call megatron's
backward made in B (recorded, not run), into the same ``main_grad`` (untested: no CUDA here).

MoE: SequentialMLP experts are megatron-core linears and split like any other (their W has
no collective: the all-to-alls stay in F and B).

Transformer Engine modules (``models`` given to the store): their own deferral, driven
from ``deferring`` / ``run`` (``te.py``).

Sequence parallelism: a column-parallel linear's B keeps only the local input autograd saved
(the store and the memory meter count it, as for any linear), and W all-gathers it over the
linear's ``ctx.tp_group`` with megatron-core's own ``dist_all_gather_func`` into its global
"mpu" buffer right before the GEMM (``_gathered_input``) — so the split holds no more than
1F1B does. That TP collective inside W matches across TP ranks because every rank of the
agreement group dispatches the identical task sequence, W included (``runtime/agreement.py``:
the agreed task universe holds every W of a split iteration, each dispatch enters the digest
checked at every exchange), and W runs its works in B's fixed order; on NCCL it is issued on
the compute stream like the TP collectives inside F and B (``runtime/rounds.py``). B skips the
all-gather megatron's backward issues for the GEMM it no longer runs (only that call, on the
saved input, is answered without communicating; ``wgrad_capture``): one TP all-gather per SP
linear and microbatch, not two.

Not supported (explicit errors): GTP-sharded weights (0.19's
``gtp_remat_size > 1``: a reduce-scatter of the weight gradient), legacy grouped-GEMM
experts (GroupedMLP; TE's TEGroupedMLP splits through wgrad_te), Megatron-FSDP parameters,
and the TE cases ``wgrad_te.te_split_reason`` names. Layers
using megatron-core's ``defer_embedding_wgrad_compute`` keep that mechanism.
"""
from __future__ import annotations

import inspect
import logging
import types
import weakref

import torch
from megatron.core.tensor_parallel import layers as _layers

from ..mcore.compat import MEGATRON_CORE_VERSION
from . import store as _store
from .capture import PREPARE as _PREPARE
from .capture import megatron_backward_intercepted as _megatron_backward_intercepted
from .store import (
    _DDP_OF,
    _NAMES,
    WeightGradStore,
    _check_sync_off,
    _ddp_of,
    _is_patchable,
    _trainable_weight,
    _unsupported_reason,
    _Work,
    register_b_placeholder,
)
from .te import is_te_module

__all__ = ["WeightGradStore", "deferral_blockers", "deferred_parameters", "install", "split_self_check"]

log = logging.getLogger(__name__)


_MegatronLinearFunction = _layers.LinearWithGradAccumulationAndAsyncCommunication

# What W uses of megatron-core's DistributedDataParallel (0.16): the hook it registers on
# every parameter's AccumulateGrad node, its config, and the bucket groups' sync state.
_DDP_INTERNALS = ("_make_backward_post_hook", "ddp_config", "param_to_bucket_group")



# --------------------------------------------------------------------------- the store












# --------------------------------------------------------------------------- W










# --------------------------------------------------------------------------- B


class _DeferrableLinear(_MegatronLinearFunction):
    """megatron-core's linear autograd function (same forward); its backward defers the
    weight gradient while a ``WeightGradStore.deferring`` is active."""

    @staticmethod
    def forward(ctx, input, weight, *args):
        ctx.rrfp_weight = weight  # the Parameter: under saved_tensors_hooks, saved_tensors is a copy
        return _MegatronLinearFunction.forward(ctx, input, weight, *args)

    @staticmethod
    def backward(ctx, grad_output):
        active = _store._active  # set by WeightGradStore.deferring
        if active is None or getattr(ctx, "grad_output_buffer", None) is not None:
            # Not deferring, or megatron-core's own embedding-wgrad deferral owns this one.
            return _MegatronLinearFunction.backward(ctx, grad_output)
        return _deferred_backward(ctx, grad_output, active)


def _deferred_backward(ctx, grad_output, active):
    store, key = active
    weight = ctx.rrfp_weight
    name = _NAMES.get(weight, "<unnamed weight>")
    if getattr(ctx, "gtp_remat_size", 1) > 1:
        raise NotImplementedError(f"wgrad: {name} is GTP-sharded (gtp_remat_size={ctx.gtp_remat_size}); its weight "
                                  "gradient needs a reduce-scatter, which W does not issue")
    if hasattr(weight, "__fsdp_param__"):
        raise NotImplementedError(f"wgrad: {name} is a Megatron-FSDP parameter; not supported")
    ddp = _ddp_of(weight)
    if ddp is not None:
        _check_sync_off(ddp, weight, f"B{key}")  # before any work
    # Under SP megatron's total_input is the TP all-gather of the input, a view of its global
    # buffer that the next linear's backward overwrites: W keeps the saved local input (what
    # autograd kept anyway) and gathers it itself (_gathered_input); B skips that gather.
    local_input = ctx.saved_tensors[0] if ctx.sequence_parallel else None
    grads, capture = _megatron_backward_intercepted(ctx, grad_output, skip_gather_of=local_input)
    if not capture.deferred:
        return grads  # megatron-core computed the weight gradient itself: exact, just not deferred
    total_input, grad_output, gather = capture.total_input, capture.grad_output, None
    if local_input is not None:
        total_input, gather = local_input, (ctx.tp_group, tuple(capture.total_input.shape))
    store._stash(key, _Work(
        weight=weight, input=total_input, grad_output=grad_output,
        versions=(total_input._version, grad_output._version), main_grad=capture.main_grad, fused=capture.fused,
        autocast=(bool(getattr(ctx, "_fwd_used_autocast", False)), getattr(ctx, "_dtype", None)), gather=gather))
    # Fused: megatron's own element (its dummy, grad_added_to_main_grad set). Otherwise None;
    # under overlapped DDP the weight's B placeholder (register_b_placeholder) satisfies its hook.
    return (grads[0], grads[1] if capture.fused is not None else None) + tuple(grads[2:])


# --------------------------------------------------------------------------- install


def _bind_arguments():
    """Map megatron-core's ``linear_with_grad_accumulation_and_async_allreduce``
    arguments to its autograd function's forward parameters, by name (releases move
    and add arguments)."""
    wrapper = inspect.signature(_layers.linear_with_grad_accumulation_and_async_allreduce)
    forward = [p for p in inspect.signature(_MegatronLinearFunction.forward).parameters if p != "ctx"]
    resolve_tp = getattr(_layers, "get_tensor_model_parallel_group_if_none", lambda group: group)

    def apply(*args, **kwargs):
        bound = wrapper.bind(*args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        if "tp_group" in values:
            values["tp_group"] = resolve_tp(values["tp_group"])
        return _DeferrableLinear.apply(*(values[name] for name in forward))

    return apply


_apply_deferrable = _bind_arguments()


def _deferrable_forward_impl(self, input, weight, *args, **kwargs):
    """Replaces ``_forward_impl`` of an installed Column/RowParallelLinear instance."""
    if not weight.requires_grad:
        return _layers.linear_with_frozen_weight(input, weight, *args, **kwargs)
    return _apply_deferrable(input, weight, *args, **kwargs)




def _is_installed(module) -> bool:
    impl = module.__dict__.get("_forward_impl")
    return isinstance(impl, types.MethodType) and impl.__func__ is _deferrable_forward_impl


_SELF_CHECK: list[str] = []  # once per process: '' (exact) or why the split cannot be used


def split_self_check() -> str:
    """Why the B/W split cannot be used with this megatron-core ('' when it can), found
    once per process by ``_check_split``; the reason names the megatron-core version."""
    if not _SELF_CHECK:
        try:
            problem = _check_split()
        except Exception as exc:  # a split that raises is exactly what this must catch
            problem = f"its split backward raised {type(exc).__name__}: {exc}"
        _SELF_CHECK.append(f"megatron-core {MEGATRON_CORE_VERSION}: the B/W split self-check failed: {problem}"
                           if problem else "")
    return _SELF_CHECK[0]


def _check_split() -> str:
    """One tiny backward through megatron-core's own linear function, unsplit and split
    (no collectives), with and without bias: outputs, input, weight and bias gradients
    must be bit-identical, and the weight gradient must really have been deferred."""
    wrapper = inspect.signature(_layers.linear_with_grad_accumulation_and_async_allreduce)
    forward = [p for p in inspect.signature(_MegatronLinearFunction.forward).parameters if p != "ctx"]
    gen = torch.Generator().manual_seed(0)
    x, w, b, g = (torch.randn(*shape, generator=gen) for shape in ((3, 2, 4), (5, 4), (5,), (3, 2, 5)))
    for with_bias in (True, False):
        results = []
        for split in (False, True):
            inputs = x.clone().requires_grad_()
            weight = torch.nn.Parameter(w.clone())
            bias = torch.nn.Parameter(b.clone()) if with_bias else None
            bound = wrapper.bind(inputs, weight, bias, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                                 sequence_parallel=False)
            bound.apply_defaults()
            args = [bound.arguments[name] for name in forward]
            store = WeightGradStore()
            with torch.enable_grad():
                if split:
                    out = _DeferrableLinear.apply(*args)
                    with store.deferring((0, 0)):
                        out.backward(g)
                    if weight.grad is not None or not store.pending_bytes():
                        return ("its linear backward did not run its weight-gradient GEMM on what "
                                f"{_PREPARE} returned, so the split cannot intercept it")
                    store.run((0, 0))
                else:
                    out = _MegatronLinearFunction.apply(*args)
                    out.backward(g)
            results.append((out, inputs.grad, weight.grad, None if bias is None else bias.grad))
        names = ("output", "input gradient", "weight gradient", "bias gradient")
        differ = [name for name, a, c in zip(names, *results, strict=True) if not _identical(a, c)]
        if differ:
            return f"split and unsplit {', '.join(differ)} differ{'' if with_bias else ' (no bias)'}"
    return ""


def _identical(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def install(models: list[torch.nn.Module]) -> None:
    """Prepare megatron-core's Column/RowParallelLinear layers in ``models`` (the model
    chunks, DDP-wrapped or not) for ``WeightGradStore.deferring``. Idempotent.

    Every other parameter keeps getting its gradient in B (exact, just not deferred);
    ``wgrad_coverage.coverage`` names them. Raises NotImplementedError for layers whose
    deferral is not supported (GTP-sharded weights; the TE cases of wgrad_te.te_split_reason),
    and ValueError if a linear's weight has a main_grad but no megatron DDP is among
    ``models``.
    """
    from megatron.core.distributed import DistributedDataParallel

    problem = split_self_check()
    if problem:
        raise NotImplementedError(f"wgrad: {problem}")
    to_patch, unsupported = [], []
    for index, model in enumerate(models):
        for module_name, module in model.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                _NAMES[param] = f"model[{index}].{module_name}.{param_name}".replace("..", ".")
            if isinstance(module, DistributedDataParallel):
                missing = [a for a in _DDP_INTERNALS if not hasattr(module, a)]
                if missing:
                    raise NotImplementedError(f"wgrad: this megatron-core DistributedDataParallel lacks {missing}, "
                                              "which W uses to account a deferred gradient like DDP's own hook")
                for param in module.module.parameters():
                    _DDP_OF[param] = weakref.ref(module)
            reason = _unsupported_reason(module)
            if reason:
                unsupported.append(_blocker(index, module_name, module, reason))
            elif _is_patchable(module):
                to_patch.append(module)
    if unsupported:  # nothing patched yet: all or nothing
        raise NotImplementedError("wgrad: cannot defer the weight gradients of:\n  " + "\n  ".join(unsupported))
    orphans = [_NAMES[m.weight] for m in to_patch if _trainable_weight(m) is not None
               and hasattr(m.weight, "main_grad") and _ddp_of(m.weight) is None]
    if orphans:
        raise ValueError(f"wgrad: weights with main_grad but no megatron DDP among the models: {orphans}; "
                         "pass the DDP-wrapped model chunks to install()")
    for module in to_patch:
        if not _is_installed(module):
            # An instance attribute: ColumnParallelLinear/RowParallelLinear.forward call
            # self._forward_impl at run time; other instances are left alone.
            module._forward_impl = types.MethodType(_deferrable_forward_impl, module)
        if _trainable_weight(module) is not None:
            register_b_placeholder(module.weight)
    log.info("wgrad: the weight gradients of %d linears deferred to W (wgrad_coverage names them)", len(to_patch))


def deferral_blockers(models: list[torch.nn.Module]) -> list[str]:
    """Why splitting the backward would not work or not pay (one line each), changing
    nothing: layers ``install`` refuses, or no megatron-core linear to defer at all (e.g.
    only Transformer Engine layers). The default policy splits the backward only if empty."""
    _note_ddps(models)
    modules = [(index, name, module) for index, model in enumerate(models) for name, module in model.named_modules()]
    problem = split_self_check()
    blockers = [problem] if problem else []
    blockers += [_blocker(index, name, module, reason) for index, name, module in modules
                if (reason := _unsupported_reason(module))]
    if not any((_is_patchable(module) and _trainable_weight(module) is not None) or is_te_module(module)
               for _, _, module in modules):
        blockers.append("no trainable megatron-core ColumnParallelLinear / RowParallelLinear or Transformer Engine "
                        "module whose weight gradient could be deferred")
    return blockers


def _blocker(index: int, name: str, module, reason: str) -> str:
    return f"model[{index}].{name} ({type(module).__name__}): {reason}"


def _note_ddps(models) -> None:
    """Remember which megatron DDP owns each parameter (W and the refusals need it)."""
    from megatron.core.distributed import DistributedDataParallel

    for model in models:
        for module in model.modules():
            if isinstance(module, DistributedDataParallel):
                for param in module.module.parameters():
                    _DDP_OF[param] = weakref.ref(module)




def deferred_parameters(models) -> set:
    """Parameters whose gradient W completes (installed linears' weights, TE modules' own
    parameters); every other trainable parameter is complete after its B."""
    out = set()
    for model in models:
        for module in model.modules():
            if _is_installed(module) and _trainable_weight(module) is not None:
                out.add(module.weight)
            elif is_te_module(module) and not _unsupported_reason(module):
                out.update(p for p in module.parameters(recurse=False) if p.requires_grad)
    return out


