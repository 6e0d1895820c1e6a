"""Megatron-LM's training loop on CPU, process-wide (``python -m megatron_rrfp.launch --cpu``)."""
from __future__ import annotations

import functools
import importlib
import inspect
import os

import torch

from ..megatron_lm.layout import FUSED_KERNELS_MODULE, INITIALIZE_MODULE, megatron_arguments_module, rebind_loaded
from .megatron_core import cpu_tensor_types_named_as_cuda, enable_cpu_reference_schedules, runs_on_cuda
from .standins import CUDA_CALLS, FACTORIES, CpuDeviceProperties, cpu_factory

# --------------------------------------------------------------------------- CPU training (launcher --cpu)
#
# Megatron-LM's training loop (megatron.training) assumes a CUDA device everywhere: it sets
# the device, seeds CUDA RNG, times with CUDA events, builds tensors with device="cuda" or
# .cuda(), and only initialises model parallelism when torch.cuda.device_count() > 0.
# `python -m megatron_rrfp.launch --cpu` makes an unmodified entry script train on CPU over
# gloo by redirecting those calls *process-wide* (the stand-ins of standins.py, set on
# torch.cuda itself): unlike megatron_core.py's per-module redirects, every megatron.training
# module and lazily imported helper would need them, and the launcher's process runs nothing
# else. One-way on purpose: there is no disable (the process has no CUDA to go back to).
#   torch.cuda.device_count() -> 1        Megatron-LM then initialises model parallelism
#   current_device / set_device           "cpu" / no-op (device= arguments become CPU)
#   synchronize, streams, events          standins.CUDA_CALLS: no-ops; Event times with perf_counter
#   CUDA RNG (manual_seed, get/set_rng_state)  the CPU generator (fork() is a no-op there,
#                                         so dropout draws from it)
#   memory statistics, empty_cache        0 / no-op
#   get_device_properties / _capability   a "cpu" device of compute capability 0.0 (validate_args
#                                         asks for it at TP/CP > 1); CUDA_DEVICE_MAX_CONNECTIONS=1,
#                                         which validate_args then requires, is set if unset
#   torch.<factory>(device="cuda"), Tensor.cuda(), Module.cuda()   stay on CPU
#   initialize_megatron                   called with allow_no_cuda=True
#   fused kernels (<= 0.16)               not built (torch fallbacks are used; pass the
#                                         --no-*-fusion flags)
#   get_megatron_optimizer                built inside cpu_tensor_types_named_as_cuda: the distributed
#                                         (and mixed-precision) optimizer accepts parameters only by
#                                         their 'torch.cuda.*Tensor' type string
#   clip_grad_by_total_norm_fp32          asserts param.grad is a torch.cuda.FloatTensor; called
#                                         through its decoupled_grad path (a dtype check only),
#                                         so --clip-grad > 0 clips and logs the grad norm
#   CLIPViTModel ln_pre/ln_post (no TE)   default torch.nn.LayerNorm is built with config=
#                                         (LLaVA's ViT, pretrain_vlm.py); megatron-core's own
#                                         WrappedTorchNorm, the local specs' norm, takes it

_cpu_training = False


def enable_cpu_training() -> bool:
    """Make Megatron-LM's CUDA assumptions run on CPU (see the section comment).

    Process-wide and idempotent; returns False (and changes nothing) in a process on CUDA
    (``launch --cpu`` hides the devices first). Call before the entry script runs;
    megatron.training hooks apply only if megatron.training is importable.
    """
    global _cpu_training
    if runs_on_cuda():
        return False
    if _cpu_training:
        return True
    enable_cpu_reference_schedules()
    _redirect_torch_cuda()
    _redirect_factories()
    if megatron_arguments_module() is not None:
        _initialize_without_cuda()
        _skip_fused_kernels()
        _optimizer_on_cpu()
        _clip_grads_on_cpu()
        _vit_norm_without_te()
    _cpu_training = True
    return True


def _cpu_seed(seed) -> None:
    torch.default_generator.manual_seed(int(seed))  # not torch.manual_seed: it calls back into cuda


def _redirect_torch_cuda() -> None:
    cuda = torch.cuda
    redirects = {
        **CUDA_CALLS,
        "device_count": lambda: 1,
        "set_device": lambda device: None,
        "set_stream": lambda s: None,
        "empty_cache": lambda: None,
        "manual_seed": _cpu_seed,
        "manual_seed_all": _cpu_seed,
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "set_rng_state": lambda state, device="cuda": torch.set_rng_state(state),
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "memory_reserved": lambda device=None: 0,
        "max_memory_reserved": lambda device=None: 0,
        "memory_stats": lambda device=None: {},
        "reset_peak_memory_stats": lambda device=None: None,
        "get_device_properties": lambda device=None: CpuDeviceProperties(),
        "get_device_capability": lambda device=None: (0, 0),
        "get_device_name": lambda device=None: "cpu",
    }
    for name, fn in redirects.items():
        setattr(cuda, name, fn)
    # Megatron-LM's validate_args requires it at TP/CP > 1 on pre-Blackwell devices; no meaning on CPU
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self


def _redirect_factories() -> None:
    """torch.zeros(..., device="cuda") and friends build CPU tensors instead."""
    for name in FACTORIES:
        if hasattr(torch, name):
            setattr(torch, name, cpu_factory(getattr(torch, name)))


def _initialize_without_cuda() -> None:
    initialize = importlib.import_module(INITIALIZE_MODULE)
    original = initialize.initialize_megatron
    if getattr(original, "_rrfp_cpu", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize_megatron(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["allow_no_cuda"] = True
        return original(*bound.args, **bound.kwargs)

    initialize_megatron._rrfp_cpu = True
    importlib.import_module("megatron.training.training")  # load the modules that bind it by name
    rebind_loaded("initialize_megatron", original, initialize_megatron)


def _skip_fused_kernels() -> None:
    try:
        fused_kernels = importlib.import_module(FUSED_KERNELS_MODULE)
    except ImportError:  # 0.19+: nothing is built
        return
    fused_kernels.load = lambda args: None


def _optimizer_on_cpu() -> None:
    """get_megatron_optimizer builds while CPU tensors answer ``type()`` with CUDA names: the
    distributed optimizer (--use-distributed-optimizer) and the mixed-precision one sort and
    accept parameters by that string alone."""
    optimizer = importlib.import_module("megatron.core.optimizer")
    original = optimizer.get_megatron_optimizer
    if getattr(original, "_rrfp_cpu", False):
        return

    @functools.wraps(original)
    def get_megatron_optimizer(*args, **kwargs):
        with cpu_tensor_types_named_as_cuda():
            return original(*args, **kwargs)

    get_megatron_optimizer._rrfp_cpu = True
    importlib.import_module("megatron.training.training")  # load the modules that bind it by name
    rebind_loaded("get_megatron_optimizer", original, get_megatron_optimizer)


def _clip_grads_on_cpu() -> None:
    """megatron-core's clipping on CPU grads: its only CUDA check is the type assertion on
    ``param.grad``; the decoupled_grad branch checks the dtype instead and scales the
    same tensors in place (grad and decoupled_grad are one tensor here)."""
    clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
    original = clip_grads.clip_grad_by_total_norm_fp32
    if getattr(original, "_rrfp_cpu", False):
        return

    @functools.wraps(original)
    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if use_decoupled_grad:
            return original(parameters, max_norm, total_norm, use_decoupled_grad=True)
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        lent = [p for p in params if p.grad is not None and getattr(p, "decoupled_grad", None) is None]
        for param in lent:
            param.decoupled_grad = param.grad
        try:
            return original(lent, max_norm, total_norm, use_decoupled_grad=True)
        finally:
            for param in lent:
                del param.decoupled_grad

    clip_grad_by_total_norm_fp32._rrfp_cpu = True
    importlib.import_module("megatron.core.optimizer")  # load the modules that bind it by name
    rebind_loaded("clip_grad_by_total_norm_fp32", original, clip_grad_by_total_norm_fp32)


def _vit_norm_without_te() -> None:
    """CLIPViTModel's ln_pre/ln_post default (torch.nn.LayerNorm without TE) becomes
    megatron-core's WrappedTorchNorm, which takes the config= it is built with."""
    try:
        clip_vit = importlib.import_module("megatron.core.models.vision.clip_vit_model")
    except ImportError:  # a megatron-core without the vision models
        return
    model = clip_vit.CLIPViTModel
    original = model.__init__
    if getattr(original, "_rrfp_cpu", False):
        return
    wrapped_norm = importlib.import_module("megatron.core.transformer.torch_norm").WrappedTorchNorm
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        for name in ("ln_pre_impl", "ln_post_impl"):
            if bound.arguments.get(name) is torch.nn.LayerNorm:
                bound.arguments[name] = wrapped_norm
        return original(*bound.args, **bound.kwargs)

    __init__._rrfp_cpu = True
    model.__init__ = __init__
