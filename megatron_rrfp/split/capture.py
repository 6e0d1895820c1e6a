"""B of the split: megatron-core's own linear backward with its weight-gradient GEMM intercepted.

How (B wraps megatron-core, it does not re-implement it): while a ``deferring`` is
active, an installed linear's backward *is* megatron-core's own
``LinearWithGradAccumulationAndAsyncCommunication.backward``, called with its arguments
and returning its tuple (so arguments a release adds pass through), with only the weight
gradient GEMM intercepted. For the duration of that call the module
``megatron.core.tensor_parallel.layers`` sees two replaced names:
``prepare_input_tensors_for_wgrad_compute`` calls the real one and records the prepared
(grad_output, total_input) — W's work — returning total_input wrapped so that the GEMM
``grad_output.t().matmul(total_input)`` on exactly those tensors is answered with a
discarded placeholder instead of being computed; with gradient accumulation fusion,
``fused_weight_gradient_mlp_cuda`` records its call instead of running the kernel.
Everything else — the input gradient, its TP all-reduce, the bias gradient — is
megatron-core's code; B then replaces element 1 of the tuple (the weight gradient) with
``None`` (fused: megatron's own dummy; see wgrad_store.register_b_placeholder). The names are patched under a
lock and restored in a ``finally``; only the patching thread's calls are intercepted
(autograd may run the backward on its device thread). Under sequence parallelism the
recorded total_input is the TP all-gathered input (a view of megatron's global memory
buffer): B keeps only the saved local input and W gathers it again (see "Sequence
parallelism" below).
"""
from __future__ import annotations

import threading
from typing import Optional

import torch
from megatron.core.tensor_parallel import layers as _layers

__all__ = ["Capture", "PREPARE", "megatron_backward_intercepted"]

_MegatronLinearFunction = _layers.LinearWithGradAccumulationAndAsyncCommunication

#
# B is megatron-core's own backward (LinearWithGradAccumulationAndAsyncCommunication.backward,
# whatever its arguments and return tuple are in this release) with its weight-gradient GEMM
# intercepted. That backward hands (grad_output, total_input) to
# ``prepare_input_tensors_for_wgrad_compute`` (a global name of megatron.core.tensor_parallel.layers)
# and then runs ``grad_output.t().matmul(total_input)`` — or, with gradient_accumulation_fusion,
# ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32/fp16(total_input, grad_output, main_grad)``.
# For the duration of the call both names are replaced in that module: the first returns the real
# prepared tensors, except that total_input comes back wrapped (_DeferredInput) so the GEMM on it
# is recognised and answered with a zero-stride placeholder instead of being computed; the second
# records its call instead of running the kernel. Everything else (input gradient, TP all-reduce
# of dgrad, bias gradient, reduce-scatter under sequence parallelism) is megatron-core's code.
# The prepared pair is what W multiplies — except under sequence parallelism, where megatron's
# total_input is the *gathered* input in its global memory buffer (which the next layer
# overwrites): ``_deferred_backward`` then stashes the saved local input and W gathers it again.
# A backward that does not take this path (no prepare call, or a GEMM on other operands) leaves
# megatron-core's weight gradient in place: not deferred, still exact. install() checks once per
# process that the path is taken and bit-exact (_split_self_check).


class Capture:
    """What one intercepted megatron-core backward handed to its weight-gradient GEMM."""

    __slots__ = ("grad_output", "total_input", "gemm", "fused", "main_grad", "skipped_gather")

    def __init__(self) -> None:
        self.grad_output: Optional[torch.Tensor] = None  # prepared (contiguous, 2-D)
        self.total_input: Optional[torch.Tensor] = None
        self.gemm = False  # the non-fused GEMM was answered with a placeholder
        self.fused: Optional[tuple] = None  # (kernel module, method name) of the fused call
        self.main_grad: Optional[torch.Tensor] = None
        self.skipped_gather = False  # SP: megatron's all-gather of the wgrad input was not issued

    def is_weight_gemm(self, left, right) -> bool:
        """``left @ right`` is exactly ``grad_output.t() @ total_input`` of this capture."""
        g = self.grad_output
        return (isinstance(right, _DeferredInput) and getattr(right, "_rrfp_capture", None) is self
                and isinstance(left, torch.Tensor) and left.dim() == 2 and g is not None
                and left.dtype == g.dtype and left.device == g.device and left.data_ptr() == g.data_ptr()
                and tuple(left.shape) == (g.shape[1], g.shape[0]) and left.stride() == (g.stride(1), g.stride(0)))

    @property
    def deferred(self) -> bool:
        return self.gemm or self.fused is not None


_GEMMS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm})


class _DeferredInput(torch.Tensor):
    """megatron's prepared ``total_input`` during an intercepted backward: a plain tensor
    for every operation except the weight-gradient GEMM of its capture, which returns a
    zero-stride zero of the result's shape (discarded: B hands autograd the placeholder)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _GEMMS and not kwargs and len(args) == 2:
            left, right = args
            capture = getattr(right, "_rrfp_capture", None)
            if capture is not None and not capture.gemm and capture.is_weight_gemm(left, right):
                capture.gemm = True
                dtype = torch.promote_types(left.dtype, right.dtype)
                return torch.zeros((), dtype=dtype, device=right.device).expand(left.shape[0], right.shape[1])
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _wrap(total_input: torch.Tensor, capture: Capture) -> _DeferredInput:
    wrapped = total_input.as_subclass(_DeferredInput)  # same storage, no copy
    wrapped._rrfp_capture = capture
    return wrapped


def _plain(tensor):
    return tensor.as_subclass(torch.Tensor) if isinstance(tensor, _DeferredInput) else tensor


class _FusedKernelRecorder:
    """Stands in for APEX's fused_weight_gradient_mlp_cuda during an intercepted backward:
    the call on the capture's tensors is recorded for W; any other call runs the kernel."""

    def __init__(self, kernel, capture: Capture) -> None:
        self._kernel, self._capture = kernel, capture

    def _call(self, method: str, total_input, grad_output, main_grad):
        capture = self._capture
        if (capture.fused is None and getattr(total_input, "_rrfp_capture", None) is capture
                and grad_output is capture.grad_output):
            capture.fused, capture.main_grad = (self._kernel, method), main_grad
            return None
        if self._kernel is None:
            raise RuntimeError("wgrad: gradient_accumulation_fusion needs APEX's fused_weight_gradient_mlp_cuda")
        return getattr(self._kernel, method)(_plain(total_input), grad_output, main_grad)

    def wgrad_gemm_accum_fp32(self, total_input, grad_output, main_grad):
        return self._call("wgrad_gemm_accum_fp32", total_input, grad_output, main_grad)

    def wgrad_gemm_accum_fp16(self, total_input, grad_output, main_grad):
        return self._call("wgrad_gemm_accum_fp16", total_input, grad_output, main_grad)

    def __getattr__(self, name):
        return getattr(self._kernel, name)


class _NoWork:
    """The handle of a skipped async all-gather."""

    def wait(self) -> None:
        return None


PREPARE, _FUSED, _GATHER = ("prepare_input_tensors_for_wgrad_compute", "fused_weight_gradient_mlp_cuda",
                            "dist_all_gather_func")
_MISSING = object()
_intercepting = threading.Lock()  # one intercepted backward at a time patches the module
_thread = threading.local()  # the capture of the backward this thread is running


def megatron_backward_intercepted(ctx, grad_output, *, skip_gather_of=None) -> tuple[tuple, Capture]:
    """megatron-core's backward, its weight-gradient GEMM recorded instead of computed.
    Autograd may run the backward on its device thread: the module names are patched
    under a lock and only the patching thread's calls are intercepted.

    ``skip_gather_of`` (sequence parallelism: the saved local input): megatron's all-gather of
    exactly that tensor — the input of the GEMM this backward no longer runs; W gathers it
    itself — is not issued (its buffer keeps stale data only that GEMM would read)."""
    capture = Capture()
    with _intercepting:
        prepare = getattr(_layers, PREPARE)
        fused = _layers.__dict__.get(_FUSED, _MISSING)
        gather = getattr(_layers, _GATHER)

        def skipping_gather(output, input_, *args, **kwargs):
            # The backward's one gather of its saved input (under saved_tensors_hooks a copy: matched by
            # shape and dtype, the first call only).
            if (getattr(_thread, "capture", None) is capture and not capture.skipped_gather
                    and isinstance(input_, torch.Tensor) and input_.shape == skip_gather_of.shape
                    and input_.dtype == skip_gather_of.dtype):
                capture.skipped_gather = True
                return _NoWork() if kwargs.get("async_op") else None
            return gather(output, input_, *args, **kwargs)

        def capturing_prepare(grad_output, total_input):
            grad_output, total_input = prepare(grad_output, total_input)
            if getattr(_thread, "capture", None) is not capture or capture.grad_output is not None:
                return grad_output, total_input  # another thread's backward, or a second call
            capture.grad_output, capture.total_input = grad_output, total_input
            return grad_output, _wrap(total_input, capture)

        _thread.capture = capture
        setattr(_layers, PREPARE, capturing_prepare)
        if ctx.gradient_accumulation_fusion:
            setattr(_layers, _FUSED, _FusedKernelRecorder(None if fused is _MISSING else fused, capture))
        if skip_gather_of is not None:
            setattr(_layers, _GATHER, skipping_gather)
        try:
            grads = _MegatronLinearFunction.backward(ctx, grad_output)
        finally:
            setattr(_layers, PREPARE, prepare)
            setattr(_layers, _GATHER, gather)
            if fused is _MISSING:
                _layers.__dict__.pop(_FUSED, None)
            else:
                setattr(_layers, _FUSED, fused)
            _thread.capture = None
    if capture.skipped_gather and not capture.deferred:
        raise RuntimeError("wgrad: megatron-core's backward used its gathered input for something other than the "
                           "weight-gradient GEMM the split defers (a release the interception no longer fits); "
                           "its weight gradient would be wrong")
    return grads, capture
