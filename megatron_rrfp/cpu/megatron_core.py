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

from .standins import CpuTorch

# megatron-core's schedules run over gloo on CPU except for a few hard-coded CUDA calls (as of 0.16.1):
#   schedules.py          total_num_tokens = torch.zeros([], ..., device="cuda")   (x3)
#   p2p_communication.py  torch.empty(..., device=torch.cuda.current_device())     (recv
#                         buffers, shape exchange) and torch.cuda.synchronize() after
#                         batch_isend_irecv; isend / irecv requests waited on after the
#                         sent output's .data was replaced (CUDA keeps the buffer: standins.py)
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
# gets its own stand-in for its global name `torch` (standins.CpuTorch): identical except
# that "cuda" devices become "cpu", torch.cuda's unconditional calls are CPU-safe and p2p
# requests keep their buffers. Nothing outside those modules sees a difference, and the
# redirection survives edits to the function bodies.

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
    # MoE: the alltoall dispatcher's D2H stream and event, router / expert parameters and
    # aux-loss buffers on current_device(), the per-layer aux-loss tracker on "cuda"
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_layer",
    # combined 1F1B (--overlap-moe-expert-parallel-comm): the schedule plan's CUDA event, its
    # computation and communication streams, NVTX ranges around every node
    "megatron.core.pipeline_parallel.combined_1f1b",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.models.common.model_chunk_schedule_plan",
    "megatron.core.models.common.utils",  # 0.19: the layer nodes
    "megatron.core.models.common.fine_grained_callables",  # 0.19
    "megatron.core.models.gpt.fine_grained_callables",  # 0.16: the layer nodes and callables
)

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
            module.torch = CpuTorch()
            _redirected.append(name)
    _disable_cuda_rng_fork()
    _define_missing_te_names()
    _record_stream_on_cpu_streams()
    _enabled = True
    return True


def _record_stream_on_cpu_streams() -> None:
    """``Tensor.record_stream(stream)`` with a stand-in stream is a no-op (combined 1F1B's schedule
    nodes record the tensors they free on their stream; torch refuses anything but a torch Stream)."""
    from .standins import CpuStream

    record_stream = torch.Tensor.record_stream
    if getattr(record_stream, "_rrfp_cpu", False):
        return

    def record(self, stream):
        return None if isinstance(stream, CpuStream) else record_stream(self, stream)

    record._rrfp_cpu = True
    torch.Tensor.record_stream = record


def runs_on_cuda() -> bool:
    from ..mcore.compat import pipeline_device

    return pipeline_device().type == "cuda"


def cpu_redirected_modules() -> tuple[str, ...]:
    """Modules whose `torch` was redirected (for debugging and tests)."""
    return tuple(_redirected)


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
