"""Megatron-core's own schedules, models and optimizer on a CPU-only host (gloo).

They are the reference the executor is checked against and what ``bench`` measures RRFP
against; a few hard-coded CUDA calls stand in the way (listed below, per module).
Process-local and idempotent; nothing happens in a rank that runs on CUDA (an NCCL group).
"""
from __future__ import annotations

import contextlib
import importlib
import types

import torch

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
#   distributed/param_and_grad_buffer.py (0.19) torch.cuda.current_stream() in
#                         start_grad_sync (waits for CUDA-graph wgrad events)
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
    "megatron.core.tensor_parallel.layers",  # sequence parallel: the linear backward's all-gather buffer
    "megatron.core.distributed.param_and_grad_buffer",  # DDP's grad buffers on current_device()
    "megatron.core.timers",  # Timer.start/stop synchronize CUDA; min/max gather on current_device()
    "megatron.core.optimizer.optimizer",  # FP32Optimizer._scale = torch.tensor([1.0], device='cuda')
    "megatron.core.optimizer.clip_grads",  # get_grad_norm_fp32: torch.zeros(1, device='cuda') buffers
    # dist_checkpointing (--ckpt-format torch_dist): torch.cuda.synchronize() before and after
    # writing, 'cuda' flag tensors in the save's collectives
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.tensor_aware_state_dict",
    # MoE (see the MoE section below): the alltoall dispatcher's D2H stream and event,
    # router / expert parameters and aux-loss buffers on current_device(), the per-layer
    # aux-loss tracker on "cuda"
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_layer",
)
# torch functions that take `device=`; only these are wrapped, so classes such as
# torch.Tensor stay real classes (isinstance checks keep working).
FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn",
              "randint", "empty_like", "zeros_like", "ones_like", "full_like", "as_tensor")

_enabled = False
_redirected: list[str] = []


def enable_cpu_reference_schedules() -> bool:
    """Let megatron-core's own pipeline schedules and GPTModel run over gloo on CPU.

    Covers ``forward_backward_no_pipelining``,
    ``forward_backward_pipelining_without_interleaving`` and
    ``forward_backward_pipelining_with_interleaving``. Process-local and idempotent;
    does nothing (returns False) in a rank that runs on CUDA (``compat.pipeline_device``:
    an NCCL group, or a visible device before any group). Returns True once active.

    Interleaved schedule at PP=2: use ``config.batch_p2p_comm=False`` (or
    ``overlap_p2p_comm=True``); with batched p2p it silently computes wrong gradients.
    """
    global _enabled
    if runs_on_cuda():
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
    _define_missing_te_names()
    _enabled = True
    return True


def runs_on_cuda() -> bool:
    from .compat import pipeline_device

    return pipeline_device().type == "cuda"


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


def cpu_factory(factory):
    def call(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    call.__name__ = factory.__name__
    call.__doc__ = f"torch.{factory.__name__} with CUDA devices mapped to CPU."
    return call


class _CpuCuda(types.ModuleType):
    """Stand-in for torch.cuda: the calls megatron makes unconditionally are CPU-safe.

    On a CUDA build of torch without a GPU these calls would otherwise try to initialise the
    driver (and, in a rank forked from the launcher's server, fail as 'Cannot re-initialize
    CUDA in forked subprocess', since importing megatron-core already asked for the device count)."""

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

    # MoE's alltoall dispatcher copies its split sizes to the host on a side stream and
    # waits on an event before the all-to-all: on CPU every op has finished when it returns.
    Stream = None  # set below (the classes refer to each other)
    Event = None

    @staticmethod
    def current_stream(device=None):
        return _CPU_STREAM  # also 0.19's bucket finish_grad_sync, waiting on CUDA-graph wgrad events

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()


class _CpuEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        return None

    def synchronize(self):
        return None

    def wait(self, stream=None):
        return None

    def query(self):
        return True


class _CpuStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return event if event is not None else _CpuEvent()

    def synchronize(self):
        return None

    def query(self):
        return True


_CpuCuda.Stream, _CpuCuda.Event = _CpuStream, _CpuEvent
_CPU_STREAM = _CpuStream()


def _host_splits(splits):
    """gloo's all_to_all_single takes split sizes as a list of ints (megatron passes numpy
    arrays or tensors)."""
    return None if splits is None else [int(n) for n in splits]


class _CpuDistributed(types.ModuleType):
    """Stand-in for torch.distributed: all-to-all split sizes as lists (what gloo accepts)."""

    def __init__(self):
        super().__init__("torch.distributed")

    def __getattr__(self, name):
        return getattr(torch.distributed, name)

    @staticmethod
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        return torch.distributed.all_to_all_single(output, input, output_split_sizes=_host_splits(output_split_sizes),
                                                   input_split_sizes=_host_splits(input_split_sizes), group=group,
                                                   async_op=async_op)


def _define_missing_te_names() -> None:
    """moe_utils imports te_general_gemm from Transformer Engine inside a try block and reads
    the name unconditionally (the router's gating matmul checks ``is not None``); without TE
    it is undefined. None selects megatron-core's torch path."""
    try:
        moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    except ImportError:
        return
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class _CpuTorch(types.ModuleType):
    """Stand-in for the module `torch` inside one megatron module (see section comment)."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()
        self.distributed = _CpuDistributed()
        for name in FACTORIES:
            if hasattr(torch, name):
                setattr(self, name, cpu_factory(getattr(torch, name)))

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


# --------------------------------------------------------------------------- CPU optimizer
#
# megatron-core 0.16.1's optimizer runs on CPU once its modules are in the redirect list
# above, except clip_grad_by_total_norm_fp32, which asserts 'torch.cuda.FloatTensor': on
# CPU the optimizer module gets the same arithmetic without the device assertion.


def enable_cpu_optimizer() -> None:
    """megatron-core's get_megatron_optimizer (and grad clipping) on a CPU-only host."""
    if not enable_cpu_reference_schedules():
        return  # a rank on CUDA: nothing to bend
    importlib.import_module("megatron.core.optimizer.optimizer").clip_grad_by_total_norm_fp32 = \
        _clip_grad_by_total_norm


@contextlib.contextmanager
def cpu_tensor_types_named_as_cuda():
    """While building megatron-core's mixed-precision (bf16/fp16) optimizer on CPU.

    Its constructor sorts parameters by their ``param.type()`` string and accepts only
    'torch.cuda.FloatTensor' / 'torch.cuda.BFloat16Tensor' / 'torch.cuda.HalfTensor'; a CPU
    parameter's string lacks 'cuda.'. For the duration, ``Tensor.type()`` (no arguments) of a
    CPU tensor answers with the CUDA name; nothing else changes. A no-op in a rank on CUDA.
    """
    if runs_on_cuda():
        yield
        return
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


@torch.no_grad()
def _clip_grad_by_total_norm(parameters, max_norm: float, total_norm: float, use_decoupled_grad: bool = False):
    """grad *= max_norm / (total_norm + 1e-6) when that is < 1 (megatron-core's rule)."""
    coefficient = max_norm / (total_norm + 1.0e-6)
    if coefficient < 1.0:
        for param in parameters:
            grad = getattr(param, "decoupled_grad" if use_decoupled_grad else "grad", None)
            if grad is not None:
                grad.mul_(coefficient)
