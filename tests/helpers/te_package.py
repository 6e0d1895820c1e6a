"""The CPU Transformer Engine stand-in importable as ``transformer_engine`` inside one test rank,
so that megatron-core's own TE extension builds ``TEGroupedMLP`` on CPU.

megatron-core defines ``TEGroupedLinear`` (``megatron/core/extensions/transformer_engine.py``)
only where ``import transformer_engine`` and ``from transformer_engine.pytorch.fp8 import ...``
succeed, and derives its TE classes from TE's at import time. ``install(version)`` puts a package
into ``sys.modules`` that gives that module exactly what it touches:

* at import (both 0.16.1 and 0.19.2): ``__version__``; ``pytorch.fp8``'s ``FP8GlobalStateManager``,
  ``fp8_autocast``, ``fp8_model_init``; the base classes ``pytorch.Linear``, ``LayerNormLinear``,
  ``DotProductAttention``, ``RMSNorm``, ``GroupedLinear``, ``common.recipe.DelayedScaling``,
  ``pytorch.distributed.CudaRNGStatesTracker`` (all but ``GroupedLinear`` refuse to be built:
  this package stands in for the grouped experts only); ``pytorch.router``'s three fused kernels
  (imported unguarded for TE >= 2.7; they refuse to run: no router fusion) and two names of
  ``pytorch.ops`` (0.16.1's annotations). Its optional imports (permutation, cross entropy, cpu
  offload, general_gemm, Fp8Padding, ...) fail as ImportError, which it catches.
* at build and run time, ``GroupedLinear``: TE's constructor (module/grouped_linear.py, read at
  v2.8 and v2.14 ... v2.18: ``single_grouped_weight`` / ``single_grouped_bias`` / ``name`` from
  2.14), weights ``weight{i}`` created empty and initialised by ``init_method`` inside
  ``get_rng_state_tracker().fork(rng_tracker_name)`` (base.py ``reset_parameters``), ``bias{i}``
  empty tensors (``bias=False``; a bias is refused), TE's TP attributes on the weights; the
  forward, backward, deferral and ``backward_dw`` are ``te_standin.GroupedLinear``'s (from TE's
  source), its store counts what B queued (``grouped_experts_report``).

The rank's megatron-core modules were imported (by the launcher's fork server) without TE, so
``install`` re-imports the two TE extension modules afterwards and clears megatron's cached TE
version; every other megatron module keeps its TE-free paths (the rest of the model is the
local spec). Test-only: nothing in megatron_rrfp imports this.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import sys
import types

import torch

from . import te_standin

SIGNATURE_VERSIONS = ("2.8", "2.14", "2.15", "2.16", "2.18")
"""Versions whose GroupedLinear constructor this follows (read from the tags)."""

_ROUTER_KERNELS = ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_topk_with_score_function")
_EXTENSIONS = ("megatron.core.extensions.transformer_engine_spec_provider",
               "megatron.core.extensions.transformer_engine")


class _NotStoodIn:
    """A TE class megatron-core derives from at import; building one is outside this stand-in."""

    te_name = ""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"the CPU Transformer Engine stand-in (tests/helpers/te_package.py) provides "
                                  f"GroupedLinear only, not {self.te_name}")


def _not_stood_in(name: str) -> type:
    return type(name, (_NotStoodIn, torch.nn.Module), {"__module__": "transformer_engine.pytorch", "te_name": name})


class FP8GlobalStateManager:
    """quantization.py: only the query megatron-core's forward paths make (no FP8 here)."""

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return False


def fp8_autocast(enabled: bool = True, **_kwargs):
    return te_standin.fp8_autocast(enabled)


def fp8_model_init(enabled: bool = True, **_kwargs):
    if enabled:
        raise NotImplementedError("fp8_model_init: no FP8 weights in the CPU Transformer Engine stand-in")
    return contextlib.nullcontext()


class _CountingStore(te_standin.WeightGradStore):
    """TE's store, counting the entries it was given: a test can see that B really deferred."""

    puts = 0

    def put(self, tensor_list, func) -> None:
        super().put(tensor_list, func)
        self.puts += 1


class GroupedLinear(te_standin.GroupedLinear):
    """TE's ``GroupedLinear`` constructor over the stand-in's grouped GEMM (see the module docstring)."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1, get_rng_state_tracker=None,
                 rng_tracker_name=None, init_method=None, bias: bool = True, return_bias: bool = False,
                 params_dtype=None, parallel_mode=None, device="cuda", ub_overlap_rs: bool = False,
                 ub_overlap_ag: bool = False, ub_name=None, delay_wgrad_compute: bool = False,
                 save_original_input: bool = False, **since_2_14):
        allowed = {"single_grouped_weight", "single_grouped_bias", "name"} if te_standin.version() >= (2, 14) else set()
        unknown = sorted(set(since_2_14) - allowed)
        if unknown:
            raise TypeError(f"GroupedLinear.__init__() got unexpected keyword arguments {unknown} "
                            f"(Transformer Engine {'.'.join(map(str, te_standin.version()))})")
        if since_2_14.get("single_grouped_weight") or since_2_14.get("single_grouped_bias"):
            raise NotImplementedError("single_grouped_weight / single_grouped_bias (one GroupedTensor parameter): "
                                      "not in the CPU stand-in")
        if bias:
            raise NotImplementedError("GroupedLinear bias: the stand-in's grouped GEMM has none; build the experts "
                                      "with add_bias_linear=False")
        if ub_overlap_rs or ub_overlap_ag:
            raise ValueError("GroupedLinear doesn't support Userbuffer overlap.")
        torch.nn.Module.__init__(self)
        self.params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.use_bias, self.return_bias, self.apply_bias = bias, return_bias, bias and not return_bias
        self.ub_overlap_rs, self.ub_overlap_ag, self.ub_name = ub_overlap_rs, ub_overlap_ag, ub_name
        self.save_original_input = save_original_input
        self.init_method, self.get_rng_state_tracker = init_method, get_rng_state_tracker
        self.rng_tracker_name = rng_tracker_name
        if tp_size > 1 or (tp_group is not None and torch.distributed.get_world_size(tp_group) > 1):
            raise NotImplementedError("GroupedLinear with TP > 1 inside TE: megatron-core's experts pass tp_size=1 "
                                      "(the dispatcher handles expert TP), the stand-in only that")
        self.tp_size, self.tp_group, self.parallel_mode = 1, None, parallel_mode
        self.sequence_parallel = False  # (tp_size > 1) and sequence_parallel
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(
                torch.empty(out_features, in_features, device=device, dtype=self.params_dtype)))
            setattr(self, f"bias{i}", torch.Tensor().to(dtype=self.params_dtype, device=device))
        self._reset_parameters()
        self._init_store(delay_wgrad_compute, False)
        self.wgrad_store = _CountingStore(delay_wgrad_compute)

    def _reset_parameters(self) -> None:
        """base.py reset_parameters, then set_tensor_parallel_attributes."""
        init = self.init_method or functools.partial(torch.nn.init.normal_, mean=0.0, std=0.023)
        for i in range(self.num_gemms):
            weight = getattr(self, f"weight{i}")
            with torch.no_grad():
                if self.get_rng_state_tracker is None:
                    init(weight)
                else:
                    tracker = self.get_rng_state_tracker()
                    with tracker.fork(self.rng_tracker_name) if self.rng_tracker_name else tracker.fork():
                        init(weight)
            weight.tensor_model_parallel = True
            weight.partition_dim = 1 if self.parallel_mode == "row" else 0
            weight.partition_stride = 1

    def _trigger_wgrad_accumulation_and_reduce_hooks(self) -> None:
        self._trigger_hooks()  # TE's name for it (megatron-core 0.19's fused path calls it)


GroupedLinear.__module__ = "transformer_engine.pytorch.module.grouped_linear"


def _unfused(name: str, *args, **kwargs):
    raise NotImplementedError(f"transformer_engine.pytorch.router.{name}: no fused router kernels in the CPU "
                              "stand-in (moe_router_fusion=False)")


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def install(version: str = "2.15"):
    """Make ``transformer_engine`` (this stand-in, behaving as TE ``version``) importable in this
    process and re-import megatron-core's TE extension over it; returns its ``TESpecProvider``.
    Call once per rank, before building the model."""
    if version not in SIGNATURE_VERSIONS:
        raise ValueError(f"te_package.install({version!r}): GroupedLinear's constructor was read at "
                         f"{SIGNATURE_VERSIONS}")
    present = sys.modules.get("transformer_engine")
    if present is not None and not getattr(present, "IS_CPU_STAND_IN", False):
        raise RuntimeError("a real transformer_engine is imported in this process; the stand-in would shadow it")
    te_standin.set_version(version)
    recipe = _module("transformer_engine.common.recipe", DelayedScaling=type("DelayedScaling", (), {}))
    common = _module("transformer_engine.common", recipe=recipe)
    fp8 = _module("transformer_engine.pytorch.fp8", FP8GlobalStateManager=FP8GlobalStateManager,
                  fp8_autocast=fp8_autocast, fp8_model_init=fp8_model_init)
    distributed = _module("transformer_engine.pytorch.distributed",
                          CudaRNGStatesTracker=type("CudaRNGStatesTracker", (), {}))
    ops = _module("transformer_engine.pytorch.ops",  # 0.16's TEFusedMLP names these in annotations
                  Sequential=_not_stood_in("Sequential"), FusibleOperation=_not_stood_in("FusibleOperation"))
    router = _module("transformer_engine.pytorch.router",  # imported unguarded for TE >= 2.7 (router fusion)
                     **{name: functools.partial(_unfused, name) for name in _ROUTER_KERNELS})
    pytorch = _module("transformer_engine.pytorch", fp8=fp8, distributed=distributed, ops=ops, router=router,
                      GroupedLinear=GroupedLinear,
                      **{name: _not_stood_in(name) for name in ("Linear", "LayerNormLinear", "DotProductAttention",
                                                                 "LayerNorm", "RMSNorm")})
    package = _module("transformer_engine", __version__=f"{version}.0", pytorch=pytorch, common=common,
                      IS_CPU_STAND_IN=True)
    modules = (package, common, recipe, pytorch, fp8, distributed, ops, router)
    for module in modules:
        module.__path__ = []  # packages: submodules not listed here fail as ImportError
        sys.modules[module.__name__] = module
    from megatron.core import utils

    utils._te_version = None  # cached as "no TE" by whatever asked before
    for name in _EXTENSIONS:
        sys.modules.pop(name, None)
    extension = importlib.import_module(_EXTENSIONS[1])
    if not extension.HAVE_TE or extension.TEColumnParallelGroupedLinear is None:
        raise RuntimeError(f"megatron-core's TE extension did not take the stand-in (HAVE_TE={extension.HAVE_TE})")
    return importlib.import_module(_EXTENSIONS[0]).TESpecProvider


class _FusedAccumulationExperts:
    """megatron-core's TEGroupedMLP, built with ``gradient_accumulation_fusion`` on in *its* config
    copy only: as with ``--gradient-accumulation-fusion`` in an all-TE model (TE's own fused wgrad
    accumulation into main_grad, which rrfp's split needs for GroupedLinear), while this model's
    local-spec attention linears keep megatron's unfused path (theirs would need APEX's kernel)."""

    def __new__(cls, num_local_experts, config, *args, **kwargs):
        from megatron.core.transformer.moe.experts import TEGroupedMLP

        fused = dataclasses.replace(config, gradient_accumulation_fusion=True)
        return TEGroupedMLP(num_local_experts, fused, *args, **kwargs)


def grouped_moe_layer_spec(provider, config):
    """megatron-core's local GPT layer spec with its MoE MLP from the TE backend
    (``get_moe_module_spec_for_backend(TESpecProvider(), moe_grouped_gemm=True)``: TEGroupedMLP of
    TEColumnParallelGroupedLinear / TERowParallelGroupedLinear), experts as ``_FusedAccumulationExperts``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    moe = get_moe_module_spec_for_backend(backend=provider(), num_experts=config.num_moe_experts,
                                          moe_grouped_gemm=True)
    # 0.16: ModuleSpec(module=MoELayer, submodules=...); 0.19: partial(MoELayer, submodules=...)
    submodules = moe.submodules if isinstance(moe, ModuleSpec) else moe.keywords["submodules"]
    experts = submodules.experts
    if isinstance(experts, ModuleSpec):
        assert experts.module is TEGroupedMLP, experts
        experts = dataclasses.replace(experts, module=_FusedAccumulationExperts)
    else:
        assert experts.func is TEGroupedMLP, experts
        experts = functools.partial(_FusedAccumulationExperts, *experts.args, **experts.keywords)
    submodules = dataclasses.replace(submodules, experts=experts)
    if isinstance(moe, ModuleSpec):
        moe = dataclasses.replace(moe, submodules=submodules)
    else:
        moe = functools.partial(moe.func, *moe.args, **{**moe.keywords, "submodules": submodules})
    layer = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, mlp=moe))


def build_grouped_moe_stage(config, *, vocab_size: int, seq_length: int, seed: int):
    """This rank's GPTModel stage with grouped TE experts, initialised like models.build_gpt_stage."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megatron_rrfp.train import models

    provider = sys.modules[_EXTENSIONS[0]].TESpecProvider if _EXTENSIONS[0] in sys.modules else None
    if provider is None or not getattr(sys.modules.get("transformer_engine"), "IS_CPU_STAND_IN", False):
        raise RuntimeError("call te_package.install() in this rank before building grouped TE experts")
    pre_process, post_process = models.stage_roles(None, None, None)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(models.stage_seed(seed, pp_rank, None))
        return GPTModel(config=config, transformer_layer_spec=grouped_moe_layer_spec(provider, config),
                        vocab_size=vocab_size, max_sequence_length=seq_length, pre_process=pre_process,
                        post_process=post_process, share_embeddings_and_output_weights=False)


def grouped_experts_report(model) -> dict:
    """What ``model`` (after its run) holds in grouped TE experts: the classes megatron-core built
    (experts / fc1 / fc2), how many GroupedLinear modules, the entries their stores were given in B
    (deferred weight gradients), the entries still queued, and the summed |main_grad| of their weights."""
    classes, stores, grad = set(), [], 0.0
    for module in model.modules():
        fc1, fc2 = getattr(module, "linear_fc1", None), getattr(module, "linear_fc2", None)
        if isinstance(fc1, GroupedLinear) and isinstance(fc2, GroupedLinear):
            classes.add((type(module).__name__, type(fc1).__name__, type(fc2).__name__))
        if isinstance(module, GroupedLinear):
            stores.append(module.wgrad_store)
            grad += sum(float(p.main_grad.abs().sum()) for p in module.parameters() if hasattr(p, "main_grad"))
    return {"classes": sorted(classes), "modules": len(stores), "queued": sum(s.puts for s in stores),
            "left": sum(s.context.qsize() for s in stores if s.context is not None), "main_grad_abs": grad}
