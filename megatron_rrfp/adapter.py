"""The one place that knows megatron-core's version differences and CUDA assumptions.

Everything else in megatron_rrfp imports megatron-core through plain public names and
passes process groups and devices explicitly; whatever has to differ by megatron-core
release, or be bent to run on a CPU-only host, lives here in its own section.

Supported: megatron-core 0.15 - 0.19 (0.16.1 is what CPU CI installs; PyPI has no newer
release for Python 3.11).
"""
from __future__ import annotations

import contextlib
import importlib
import types

import torch
from packaging.version import Version

__all__ = ["MEGATRON_CORE_VERSION", "cpu_redirected_modules", "enable_cpu_reference_schedules"]


# --------------------------------------------------------------------------- versions


def _installed_version() -> Version:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return Version(version("megatron-core"))
    except PackageNotFoundError:  # e.g. a source checkout on PYTHONPATH
        from megatron.core import package_info

        return Version(package_info.__version__)


MEGATRON_CORE_VERSION: Version = _installed_version()


# --------------------------------------------------------------------------- CPU reference
#
# megatron-core's schedules are the reference our executor is checked against. They run
# over gloo on CPU except for a few hard-coded CUDA calls (as of 0.16.1):
#   schedules.py          total_num_tokens = torch.zeros([], ..., device="cuda")   (x3)
#   p2p_communication.py  torch.empty(..., device=torch.cuda.current_device())     (recv
#                         buffers, shape exchange) and torch.cuda.synchronize() after
#                         batch_isend_irecv
#   transformer/utils.py  get_default_causal_mask(): torch.ones(..., device="cuda"), used
#                         by local attention when attention_mask is None (middle stages)
#   utils.py              GlobalMemoryBuffer.get_tensor(): device=torch.cuda.current_device(),
#                         the baddbmm buffer of local DotProductAttention
#   tensor_parallel/mappings.py  torch.empty(..., device=torch.cuda.current_device()) for
#                         TP all-gather / reduce-scatter outputs (gather_output=True, SP)
#   tensor_parallel.random CudaRNGStatesTracker.fork(): swaps CUDA RNG states around
#                         dropout; GPTModel enters it in attention and transformer block
# Rather than patch functions (their bodies change every release), each affected module
# gets its own stand-in for its global name `torch`: identical except that "cuda" devices
# become "cpu" and torch.cuda.current_device/synchronize are CPU-safe. Nothing outside
# those modules sees a difference, and the patch survives edits to the function bodies.

# Modules whose module-level `torch` is replaced; missing ones (other releases) are skipped.
_CPU_REDIRECTED_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.transformer.utils",  # get_default_causal_mask: attention_mask=None
    "megatron.core.utils",  # GlobalMemoryBuffer.get_tensor: local attention's matmul buffer
    "megatron.core.tensor_parallel.mappings",  # TP gather / reduce-scatter output buffers
    "megatron.core.distributed.param_and_grad_buffer",  # DDP's grad buffers on current_device()
    "megatron.core.timers",  # Timer.start/stop synchronize CUDA; min/max gather on current_device()
)
# torch functions that take `device=`; only these are wrapped, so classes such as
# torch.Tensor stay real classes (isinstance checks keep working).
_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn",
              "randint", "empty_like", "zeros_like", "ones_like", "full_like", "as_tensor")

_enabled = False
_redirected: list[str] = []


def enable_cpu_reference_schedules() -> bool:
    """Let megatron-core's own pipeline schedules and GPTModel run over gloo on CPU.

    Covers ``forward_backward_no_pipelining``,
    ``forward_backward_pipelining_without_interleaving`` and
    ``forward_backward_pipelining_with_interleaving``. Process-local and idempotent;
    does nothing (returns False) when CUDA is available. Returns True once active.

    Interleaved schedule at PP=2: use ``config.batch_p2p_comm=False`` (or
    ``overlap_p2p_comm=True``); with batched p2p it silently computes wrong gradients.
    """
    global _enabled
    if torch.cuda.is_available():
        return False
    if _enabled:
        return True
    for name in _CPU_REDIRECTED_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if isinstance(getattr(module, "torch", None), types.ModuleType):
            module.torch = _CpuTorch()
            _redirected.append(name)
    _disable_cuda_rng_fork()
    _enabled = True
    return True


def cpu_redirected_modules() -> tuple[str, ...]:
    """Modules whose `torch` was redirected (for debugging and tests)."""
    return tuple(_redirected)


def _to_cpu_device(device):
    """'cuda', 'cuda:1', torch.device('cuda') and bare CUDA ordinals become 'cpu'."""
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
        return "cpu"
    return device


def _cpu_factory(factory):
    def call(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    call.__name__ = factory.__name__
    call.__doc__ = f"torch.{factory.__name__} with CUDA devices mapped to CPU."
    return call


class _CpuCuda(types.ModuleType):
    """Stand-in for torch.cuda: the calls megatron makes unconditionally are CPU-safe."""

    def __init__(self):
        super().__init__("torch.cuda")

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return "cpu"  # only ever used as a device= argument by the redirected modules

    @staticmethod
    def synchronize(device=None):
        return None  # CPU ops and gloo waits are already synchronous


class _CpuTorch(types.ModuleType):
    """Stand-in for the module `torch` inside one megatron module (see section comment)."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            if hasattr(torch, name):
                setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):  # only reached for names not set in __init__
        return getattr(torch, name)


def _disable_cuda_rng_fork() -> None:
    """Make the CUDA RNG tracker's fork() a no-op context.

    It saves/restores CUDA RNG states (and raises unless model_parallel_cuda_manual_seed,
    which needs CUDA, added them). On CPU, dropout inside it simply draws from the CPU
    generator; our reference configs use dropout 0, so results do not depend on it.
    Patched on the class, so trackers created later (force_reset) are covered too.
    """
    from megatron.core.tensor_parallel import random as tp_random

    def fork(self, name=None):
        return contextlib.nullcontext()

    tp_random.CudaRNGStatesTracker.fork = fork


# --------------------------------------------------------------------------- schedule calls
#
# The executor runs each microbatch through megatron-core's own forward_step /
# backward_step, so loss scaling, per-token loss and MoE aux-loss scaling stay Megatron's.
# Their signatures move between releases (0.19's backward_step drops model_type); these
# wrappers pass only what the installed release accepts.

import inspect  # noqa: E402
from dataclasses import dataclass as _dataclass  # noqa: E402
from typing import Any, Optional  # noqa: E402


def _schedules():
    from megatron.core.pipeline_parallel import schedules

    return schedules


def _accepted(func, kwargs: dict) -> dict:
    params = inspect.signature(func).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def pipeline_device() -> torch.device:
    """Where activations live: the current CUDA device, else CPU (gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def get_model_config(model):
    from megatron.core.utils import get_model_config as _get

    return _get(model)


def model_type(model):
    from megatron.core.utils import get_model_type

    return get_model_type(model)


def forward_step(forward_step_func, data_iterator, model, num_microbatches, input_tensor, forward_data_store,
                 config, **kwargs):
    fn = _schedules().forward_step
    return fn(forward_step_func, data_iterator, model, num_microbatches, input_tensor, forward_data_store, config,
              **_accepted(fn, kwargs))


def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
    fn = _schedules().backward_step
    if "model_type" in inspect.signature(fn).parameters:  # <= 0.18
        return fn(input_tensor, output_tensor, output_tensor_grad, model_type, config)
    return fn(input_tensor, output_tensor, output_tensor_grad, config)


def first_val_step(first_val_step_flag, forward_only: bool, cond: bool) -> bool:
    return _schedules().check_first_val_step(first_val_step_flag, forward_only, cond)


def deallocate_output_tensor(out, deallocate_pipeline_outputs: bool) -> None:
    _schedules().deallocate_output_tensor(out, deallocate_pipeline_outputs)


def clear_embedding_activation_buffer(config, model, is_last_stage: bool):
    fn = getattr(_schedules(), "clear_embedding_activation_buffer", None)
    return fn(config, model, is_last_stage) if fn is not None else None


def finish_embedding_wgrad_compute(config, embedding_module, is_last_stage: bool, tp_group) -> None:
    fn = getattr(_schedules(), "finish_embedding_wgrad_compute", None)
    if fn is not None:
        params = list(inspect.signature(fn).parameters)
        fn(*(config, embedding_module, is_last_stage, tp_group)[: len(params)])


def finalize_model_grads(config, models, num_tokens, *, pg_collection, force_all_reduce) -> None:
    fn = config.finalize_model_grads_func
    kwargs = _accepted(fn, dict(pg_collection=pg_collection, force_all_reduce=force_all_reduce))
    fn(models, num_tokens, **kwargs)


def expert_parallel_size() -> int:
    from megatron.core import parallel_state

    try:
        return parallel_state.get_expert_model_parallel_world_size()
    except (AssertionError, AttributeError, RuntimeError):
        return 1


@_dataclass
class ScheduleGroups:
    pp: Any
    tp: Any
    cp: Any
    agreement_ranks: list
    collection: Optional[Any]  # what to hand to finalize_model_grads (None: Megatron's globals)


def process_groups(*, pg_collection=None, p2p_communicator=None) -> ScheduleGroups:
    """The groups the schedule needs, from an explicit ProcessGroupCollection (0.15+) or
    from megatron's parallel_state. Agreement spans tensor x context parallel ranks: both
    run collectives inside every forward and backward."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if pg_collection is not None:
        pp, tp, cp = pg_collection.pp, pg_collection.tp, pg_collection.cp
        tp_cp = getattr(pg_collection, "tp_cp", None)
        if tp_cp is None and cp.size() > 1:
            raise ValueError("megatron_rrfp: pg_collection with context parallelism must carry 'tp_cp' "
                             "(the tensor x context parallel group) for the TP agreement")
        agreement = dist.get_process_group_ranks(tp_cp if tp_cp is not None else tp)
    else:
        pp = p2p_communicator.pp_group if p2p_communicator is not None else \
            parallel_state.get_pipeline_model_parallel_group()
        tp = parallel_state.get_tensor_model_parallel_group()
        cp = parallel_state.get_context_parallel_group()
        agreement = dist.get_process_group_ranks(parallel_state.get_tensor_and_context_parallel_group())
    return ScheduleGroups(pp=pp, tp=tp, cp=cp, agreement_ranks=sorted(agreement), collection=pg_collection)


def pipeline_parallel_size(schedule_pg_collection=None) -> int:
    if schedule_pg_collection is not None and getattr(schedule_pg_collection, "pp", None) is not None:
        return schedule_pg_collection.pp.size()
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_world_size()
