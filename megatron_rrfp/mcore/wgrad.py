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
``None`` (a zero under DDP overlap_grad_reduce, see below). The names are patched under a
lock and restored in a ``finally``; only the patching thread's calls are intercepted
(autograd may run the backward on its device thread). Under sequence parallelism the
recorded total_input is the TP all-gathered input (a view of megatron's global memory
buffer): B keeps only the saved local input and W gathers it again (see "Sequence
parallelism" below).

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

Megatron-core DistributedDataParallel (pass the DDP-wrapped chunks to ``install``):
  * Unsplit, DDP's per-parameter hook (on the AccumulateGrad node) adds ``param.grad``
    into ``param.main_grad`` and, with ``overlap_grad_reduce``, marks the parameter
    ready. ``run`` puts the weight gradient in ``param.grad`` and calls that same hook
    (``DistributedDataParallel._make_backward_post_hook``), so main_grad receives
    exactly what it would have.
  * During a deferred B autograd still fires the hook for each deferred weight (with no
    gradient). Without ``overlap_grad_reduce`` that is a no-op. With it, B hands the hook
    a zero gradient (its assertion wants one), and the hook's readiness counting would
    go wrong whether it ran from B (too early) or from W (B-computed parameters are
    never counted; DDP asserts on the partial count at the next zero_grad_buffer).
  * So the executor's contract is: **keep DDP's no_sync() (``config.no_sync_func``)
    active over every B and every W of the iteration and leave it only after the last
    W**; ``finalize_model_grads`` (``finish_grad_sync``) then launches and finishes the
    reduction — with overlap_grad_reduce DDP does so because no readiness was ever
    counted. With overlap_grad_reduce the executor counts readiness itself
    (``grad_sync.SplitReadiness``: each parameter once, when its last W or B of the
    iteration ran; ``run(key, after_weight=...)`` reports weights as they complete), so
    buckets reduce while the remaining W/B compute runs, not after the last W. With
    overlap_grad_reduce this module raises if B or W runs with sync enabled; without
    it, sync during W is harmless. (Megatron's schedules, and rrfp's BF path, enable
    sync before the *last backward*; with the split that point is after the last W.)
  * ``gradient_accumulation_fusion`` (CUDA + APEX): W makes the fused-kernel call
    megatron-core's backward made in B (recorded, not run), into the same ``main_grad``.
    Untested here (no CUDA on CI; the self-check covers the non-fused path only).

MoE: SequentialMLP experts are megatron-core linears and split like any other (their W has
no collective: the all-to-alls stay in F and B).

Transformer Engine modules (``models`` given to the store): their own deferral, driven
from ``deferring`` / ``run`` (``wgrad_te.py``).

Sequence parallelism: a column-parallel linear's B keeps only the local input autograd saved
(the store and the memory meter count it, as for any linear), and W all-gathers it over the
linear's ``ctx.tp_group`` with megatron-core's own ``dist_all_gather_func`` into its global
"mpu" buffer right before the GEMM (``_gathered_input``) — so the split holds no more than
1F1B does. That TP collective inside W matches across TP ranks because every rank of the
agreement group dispatches the identical task sequence, W included (``runtime/agreement.py``:
the agreed task universe holds every W of a split iteration, each dispatch enters the digest
checked at every exchange), and W runs its works in B's fixed order; on NCCL it is issued on
the compute stream like the TP collectives inside F and B (``runtime/rounds.py``). Known
cost: megatron's backward in B still does its own all-gather for the GEMM that B then skips —
one wasted TP all-gather per SP linear and microbatch, kept so that B stays megatron's code.

Not supported (explicit errors): GTP-sharded weights (0.19's
``gtp_remat_size > 1``: a reduce-scatter of the weight gradient), grouped-GEMM experts
(GroupedMLP, TEGroupedMLP), Megatron-FSDP parameters,
and the TE cases ``wgrad_te.te_split_reason`` names. Layers
using megatron-core's ``defer_embedding_wgrad_compute`` keep that mechanism.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import operator
import threading
import types
import weakref
from collections.abc import Iterator
from typing import Optional

import torch
from megatron.core.tensor_parallel import layers as _layers
from torch.utils.weak import WeakIdKeyDictionary

from .compat import MEGATRON_CORE_VERSION
from .wgrad_te import TeSplit, is_te_module, te_split_reason

__all__ = ["WeightGradStore", "deferral_blockers", "deferred_parameters", "install", "split_self_check"]

log = logging.getLogger(__name__)

Key = tuple[int, int]  # (microbatch, model chunk)

_LINEAR_CLASSES = (_layers.ColumnParallelLinear, _layers.RowParallelLinear)
_MegatronLinearFunction = _layers.LinearWithGradAccumulationAndAsyncCommunication

# What W uses of megatron-core's DistributedDataParallel (0.16): the hook it registers on
# every parameter's AccumulateGrad node, its config, and the bucket groups' sync state.
_DDP_INTERNALS = ("_make_backward_post_hook", "ddp_config", "param_to_bucket_group")

# Parameter -> qualified name (for errors and coverage) and -> weakref to its megatron DDP.
_NAMES: WeakIdKeyDictionary = WeakIdKeyDictionary()
_DDP_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()


# --------------------------------------------------------------------------- the store


@dataclasses.dataclass(slots=True)
class _Work:
    """One deferred weight-gradient GEMM: everything the unsplit backward would have used."""

    weight: torch.nn.Parameter
    input: torch.Tensor  # megatron's prepared total_input (2-D); under SP this rank's saved local input
    grad_output: torch.Tensor  # megatron's prepared grad_output (contiguous, 2-D)
    versions: tuple[int, int]  # input._version, grad_output._version when stashed
    main_grad: Optional[torch.Tensor]  # what megatron's fused call accumulates into
    fused: Optional[tuple]  # (kernel, method) of megatron's fused call (gradient_accumulation_fusion)
    autocast: tuple[bool, Optional[torch.dtype]]  # forward's autocast state (custom_fwd)
    gather: Optional[tuple] = None  # SP: (tp_group, shape of megatron's prepared total_input); W re-gathers


@dataclasses.dataclass(slots=True)
class _Pending:
    works: list = dataclasses.field(default_factory=list)
    storages: set = dataclasses.field(default_factory=set)  # (device, data_ptr) counted
    nbytes: int = 0
    held: list = dataclasses.field(default_factory=list)  # one tensor per counted storage


_active: Optional[tuple[WeightGradStore, Key]] = None  # set by deferring()


class WeightGradStore:
    """Per-stage store of deferred weight-gradient work, keyed by (microbatch, chunk).

    ``max_pending``: at most this many keys hold stashed tensors. A ``deferring`` entered
    when that many are pending does not defer: its backward computes the weight
    gradients inline (megatron-core's unsplit backward) and the later ``run`` of that
    key is a no-op. It bounds memory, like megatron-core's ``wgrad_deferral_limit``.

    ``peak_pending_bytes``: the largest ``pending_bytes()`` seen since construction.
    ``memory``: an optional ``runtime.memory.ActivationMeter`` told what W keeps alive.
    Not thread-safe: one compute thread runs B and W (autograd's own device threads may
    run the backward itself; the active key is process-global for that reason).
    """

    def __init__(self, *, max_pending: Optional[int] = None, memory=None, models=None):
        if max_pending is not None and max_pending < 1:
            raise ValueError(f"max_pending must be >= 1 or None, got {max_pending}")
        self.max_pending = max_pending
        self.memory = memory
        # Transformer Engine modules of ``models`` (installed): their own store defers, driven from here.
        self._te = TeSplit(_te_modules(models or []), ddp_of=_ddp_of, hold=self._hold)
        self._pending: dict[Key, _Pending] = {}  # in the order B ran
        self._inline: set[Key] = set()  # keys whose W ran inside B (max_pending reached)
        self._bytes = 0
        self.peak_pending_bytes = 0

    @contextlib.contextmanager
    def deferring(self, key: Key) -> Iterator[None]:
        """Inside: the backward of installed megatron linears computes only input (and
        bias) gradients; their weight-gradient work is stashed under ``key``."""
        global _active
        key = _check_key(key)
        if key in self._pending or key in self._inline:
            raise ValueError(f"wgrad: B of {key} was already deferred and its W has not run; "
                             f"pending: {self.pending()}")
        if _active is not None:
            raise RuntimeError(f"wgrad: deferring({key}) entered while deferring({_active[1]}) is active; "
                               "one backward at a time")
        if self.max_pending is not None and len(self._pending) >= self.max_pending:
            self._inline.add(key)  # store full: this backward runs unsplit
            try:
                yield
            except BaseException:
                self._inline.discard(key)
                raise
            return
        self._pending[key] = _Pending()
        _active = (self, key)
        self._te.begin(key)
        ok = False
        try:
            yield
            ok = True
        except BaseException:
            self._drop(key)  # a half-run backward leaves nothing usable behind
            raise
        finally:
            _active = None
            self._te.end(key, ok=ok)

    def run(self, key: Key, *, after_weight=None) -> None:
        """Compute the stashed weight gradients of ``key`` and accumulate them where the
        unsplit backward would have (param.main_grad via DDP's hook or the fused kernel,
        else param.grad). Releases the stashed tensors. ``after_weight(param)`` is called
        as each weight's gradient of this key is complete (overlapped DP reductions)."""
        key = _check_key(key)
        if key in self._inline:
            self._inline.discard(key)
            return
        if key not in self._pending:
            raise KeyError(f"wgrad: no deferred B for {key}; pending: {self.pending()}")
        if _active == (self, key):
            raise RuntimeError(f"wgrad: run({key}) inside its own deferring({key})")
        for work in self._pending[key].works:  # before touching any gradient
            ddp = _ddp_of(work.weight)
            if ddp is not None:
                _check_sync_off(ddp, work.weight, f"W{key}")
        self._te.check(key)
        entry = self._pending.pop(key)
        self._bytes -= entry.nbytes
        with torch.no_grad():
            for work in entry.works:
                _run_work(work, key)
                if after_weight is not None:
                    after_weight(work.weight)
            self._te.run(key, after_weight)
        self._release(entry)

    def pending(self) -> list[Key]:
        """Keys whose W has not run, in the order their B ran."""
        return list(self._pending)

    def pending_bytes(self) -> int:
        """Bytes of tensor storage the store keeps alive (saved inputs and output
        gradients of deferred linears; each storage counted once per key). Without the
        split these would be freed at the end of B."""
        return self._bytes

    def _stash(self, key: Key, work: _Work) -> None:
        self._pending[key].works.append(work)
        for tensor in (work.input, work.grad_output):
            self._hold(key, tensor)

    def _hold(self, key: Key, tensor: torch.Tensor) -> None:
        """Count what W of ``key`` keeps alive (each storage once per key)."""
        entry = self._pending[key]
        storage = tensor.untyped_storage()
        ident = (tensor.device, storage.data_ptr())
        if ident not in entry.storages:
            entry.storages.add(ident)
            entry.nbytes += storage.nbytes()
            self._bytes += storage.nbytes()
            entry.held.append(tensor)
            if self.memory is not None:
                self.memory.hold(tensor)
        self.peak_pending_bytes = max(self.peak_pending_bytes, self._bytes)

    def _drop(self, key: Key) -> None:
        entry = self._pending.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes
            self._release(entry)

    def _release(self, entry: _Pending) -> None:
        for tensor in entry.held if self.memory is not None else ():
            self.memory.release(tensor)

    def __repr__(self) -> str:
        return (f"WeightGradStore(pending={self.pending()}, pending_bytes={self._bytes}, "
                f"peak_pending_bytes={self.peak_pending_bytes}, max_pending={self.max_pending})")


def _check_key(key) -> Key:
    try:
        if not isinstance(key, tuple) or len(key) != 2:
            raise TypeError
        return (operator.index(key[0]), operator.index(key[1]))
    except TypeError:
        raise TypeError(f"wgrad: key must be a (microbatch, chunk) tuple of ints, got {key!r}") from None


# --------------------------------------------------------------------------- W


def _run_work(work: _Work, key: Key) -> None:
    name = _NAMES.get(work.weight, "<unnamed weight>")
    now = (work.input._version, work.grad_output._version)
    if now != work.versions:
        raise RuntimeError(f"wgrad: W of {key} for {name}: its saved input or output gradient was modified in "
                           f"place after B (versions {work.versions} -> {now}); the weight gradient would be wrong")
    enabled, dtype = work.autocast
    autocast = torch.autocast(device_type="cuda", dtype=dtype) if enabled else contextlib.nullcontext()
    total_input = work.input if work.gather is None else _gathered_input(work)
    with autocast:
        if work.fused is not None:
            _fused_accumulate(work, total_input)
        else:  # the GEMM megatron-core's backward was about to run, on the same tensors
            _accumulate(work.weight, work.grad_output.t().matmul(total_input))


def _gathered_input(work: _Work) -> torch.Tensor:
    """Sequence parallelism: the TP all-gather of the saved local input, exactly as
    megatron-core's backward makes it (its gather function, into its global "mpu" buffer,
    on the linear's tp_group), viewed as the 2-D total_input its GEMM multiplied. The
    buffer is only read by the GEMM right after, as in megatron's own backward."""
    tp_group, shape = work.gather
    local = work.input
    size = list(local.size())
    size[0] *= tp_group.size()
    buffer = _layers.get_global_memory_buffer().get_tensor(size, local.dtype, "mpu")
    _layers.dist_all_gather_func(buffer, local.contiguous(), group=tp_group)
    return buffer.view(shape)


def _accumulate(weight: torch.nn.Parameter, wgrad: torch.Tensor) -> None:
    """What autograd's AccumulateGrad and then megatron DDP's hook do with a weight
    gradient: add it to ``weight.grad``; the hook (if any) moves it into main_grad."""
    if wgrad.dtype != weight.dtype:  # the engine casts gradients to the input's dtype
        wgrad = wgrad.to(weight.dtype)
    if weight.grad is None:
        weight.grad = wgrad
    else:
        weight.grad += wgrad
    ddp = _ddp_of(weight)
    if ddp is not None:
        ddp._make_backward_post_hook(weight)()
    elif hasattr(weight, "main_grad"):
        raise RuntimeError(f"wgrad: {_NAMES.get(weight, 'a weight')} has main_grad but no megatron DDP wrapper was "
                           "passed to install(); pass the DDP-wrapped models so W can use its gradient hook")


def _fused_accumulate(work: _Work, total_input: torch.Tensor) -> None:
    """gradient_accumulation_fusion: the fused-kernel call megatron-core's backward made
    (intercepted in B), now, into the same main_grad; then DDP's hook with the dummy
    gradient it expects (untested: needs CUDA + APEX)."""
    weight = work.weight
    kernel, method = work.fused
    if kernel is None:
        raise RuntimeError("wgrad: gradient_accumulation_fusion needs APEX's fused_weight_gradient_mlp_cuda")
    weight.main_grad = work.main_grad
    getattr(kernel, method)(total_input, work.grad_output, work.main_grad)
    ddp = _ddp_of(weight)
    if ddp is not None and hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True  # as megatron-core's fused backward sets it
        weight.grad = torch.zeros_like(weight.main_grad, dtype=weight.dtype)
        ddp._make_backward_post_hook(weight)()


# --------------------------------------------------------------------------- B
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


class _Capture:
    """What one intercepted megatron-core backward handed to its weight-gradient GEMM."""

    __slots__ = ("grad_output", "total_input", "gemm", "fused", "main_grad")

    def __init__(self) -> None:
        self.grad_output: Optional[torch.Tensor] = None  # prepared (contiguous, 2-D)
        self.total_input: Optional[torch.Tensor] = None
        self.gemm = False  # the non-fused GEMM was answered with a placeholder
        self.fused: Optional[tuple] = None  # (kernel module, method name) of the fused call
        self.main_grad: Optional[torch.Tensor] = None

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


def _wrap(total_input: torch.Tensor, capture: _Capture) -> _DeferredInput:
    wrapped = total_input.as_subclass(_DeferredInput)  # same storage, no copy
    wrapped._rrfp_capture = capture
    return wrapped


def _plain(tensor):
    return tensor.as_subclass(torch.Tensor) if isinstance(tensor, _DeferredInput) else tensor


class _FusedKernelRecorder:
    """Stands in for APEX's fused_weight_gradient_mlp_cuda during an intercepted backward:
    the call on the capture's tensors is recorded for W; any other call runs the kernel."""

    def __init__(self, kernel, capture: _Capture) -> None:
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


_PREPARE, _FUSED = "prepare_input_tensors_for_wgrad_compute", "fused_weight_gradient_mlp_cuda"
_MISSING = object()
_intercepting = threading.Lock()  # one intercepted backward at a time patches the module
_thread = threading.local()  # the capture of the backward this thread is running


def _megatron_backward_intercepted(ctx, grad_output) -> tuple[tuple, _Capture]:
    """megatron-core's backward, its weight-gradient GEMM recorded instead of computed.
    Autograd may run the backward on its device thread: the module names are patched
    under a lock and only the patching thread's calls are intercepted."""
    capture = _Capture()
    with _intercepting:
        prepare = getattr(_layers, _PREPARE)
        fused = _layers.__dict__.get(_FUSED, _MISSING)

        def capturing_prepare(grad_output, total_input):
            grad_output, total_input = prepare(grad_output, total_input)
            if getattr(_thread, "capture", None) is not capture or capture.grad_output is not None:
                return grad_output, total_input  # another thread's backward, or a second call
            capture.grad_output, capture.total_input = grad_output, total_input
            return grad_output, _wrap(total_input, capture)

        _thread.capture = capture
        setattr(_layers, _PREPARE, capturing_prepare)
        if ctx.gradient_accumulation_fusion:
            setattr(_layers, _FUSED, _FusedKernelRecorder(None if fused is _MISSING else fused, capture))
        try:
            grads = _MegatronLinearFunction.backward(ctx, grad_output)
        finally:
            setattr(_layers, _PREPARE, prepare)
            if fused is _MISSING:
                _layers.__dict__.pop(_FUSED, None)
            else:
                setattr(_layers, _FUSED, fused)
            _thread.capture = None
    return grads, capture


class _DeferrableLinear(_MegatronLinearFunction):
    """megatron-core's linear autograd function (same forward); its backward defers the
    weight gradient while a ``WeightGradStore.deferring`` is active."""

    @staticmethod
    def forward(ctx, input, weight, *args):
        ctx.rrfp_weight = weight  # the Parameter: under saved_tensors_hooks, saved_tensors is a copy
        return _MegatronLinearFunction.forward(ctx, input, weight, *args)

    @staticmethod
    def backward(ctx, grad_output):
        active = _active
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
    placeholder = _placeholder_weight_grad(weight, key)  # may refuse: before any work
    # Under SP megatron's total_input is the TP all-gather of the input, a view of its global
    # buffer that the next linear's backward overwrites: W keeps the saved local input (what
    # autograd kept anyway) and gathers it again itself (_gathered_input), not a TP x copy.
    local_input = ctx.saved_tensors[0] if ctx.sequence_parallel else None
    grads, capture = _megatron_backward_intercepted(ctx, grad_output)
    if not capture.deferred:
        return grads  # megatron-core computed the weight gradient itself: exact, just not deferred
    total_input, grad_output, gather = capture.total_input, capture.grad_output, None
    if local_input is not None:
        total_input, gather = local_input, (ctx.tp_group, tuple(capture.total_input.shape))
    store._stash(key, _Work(
        weight=weight, input=total_input, grad_output=grad_output,
        versions=(total_input._version, grad_output._version), main_grad=capture.main_grad, fused=capture.fused,
        autocast=(bool(getattr(ctx, "_fwd_used_autocast", False)), getattr(ctx, "_dtype", None)), gather=gather))
    return (grads[0], placeholder) + tuple(grads[2:])


def _placeholder_weight_grad(weight, key: Key):
    """What B hands autograd for a deferred weight. None, except under DDP with
    overlap_grad_reduce, whose hook asserts a gradient exists: a zero one then (adds 0 to
    main_grad, exact); its readiness mark must then be inert (no_sync)."""
    ddp = _ddp_of(weight)
    if ddp is None or not ddp.ddp_config.overlap_grad_reduce:
        return None
    if ddp.param_to_bucket_group.get(weight) is None:  # not in DDP's buckets: its hook does nothing
        return None
    _check_sync_off(ddp, weight, f"B{key}")
    return torch.zeros_like(weight)


def _check_sync_off(ddp, weight, phase: str) -> None:
    """With overlap_grad_reduce, DDP's hook counts a parameter as ready whenever sync is
    on; from a deferred B that is before its gradient exists, and from W it is a partial
    count (B-computed parameters never counted) that DDP rejects at the next
    zero_grad_buffer. So every deferred B and W must run under no_sync."""
    if not ddp.ddp_config.overlap_grad_reduce:
        return
    bucket_group = ddp.param_to_bucket_group.get(weight)
    if bucket_group is not None and bucket_group.is_last_microbatch:
        raise RuntimeError(f"wgrad: {phase} of {_NAMES.get(weight, 'a weight')} ran with DDP gradient sync enabled "
                           "and overlap_grad_reduce=True; keep DDP's no_sync (config.no_sync_func) active over "
                           "every deferred B and every W, and leave it only after the last W")


def _ddp_of(weight):
    ref = _DDP_OF.get(weight)
    return ref() if ref is not None else None


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


def _is_patchable(module) -> bool:
    return (isinstance(module, _LINEAR_CLASSES)
            and type(module)._forward_impl in (cls._forward_impl for cls in _LINEAR_CLASSES))


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


_GROUPED_EXPERTS = ("GroupedMLP", "TEGroupedMLP")  # megatron-core's grouped-GEMM experts


def _unsupported_reason(module) -> str:
    if type(module).__name__ in _GROUPED_EXPERTS:
        return ("grouped-GEMM experts compute their weight gradients inside one grouped GEMM backward, which "
                "cannot be deferred; use moe_grouped_gemm=False (SequentialMLP: its linears are split)")
    if _is_patchable(module) and getattr(module, "gtp_remat_size", 1) > 1:
        return f"GTP-sharded weight (gtp_remat_size={module.gtp_remat_size}; W would need a reduce-scatter)"
    if not is_te_module(module):
        return ""
    ddps = [d for d in map(_ddp_of, module.parameters(recurse=False)) if d is not None]
    overlap = any(getattr(d.ddp_config, "overlap_grad_reduce", False) for d in ddps)
    return te_split_reason(module, overlap_grad_reduce=overlap)


def _note_ddps(models) -> None:
    """Remember which megatron DDP owns each parameter (W and the refusals need it)."""
    from megatron.core.distributed import DistributedDataParallel

    for model in models:
        for module in model.modules():
            if isinstance(module, DistributedDataParallel):
                for param in module.module.parameters():
                    _DDP_OF[param] = weakref.ref(module)


def _te_modules(models) -> list:
    """(name, module) of the Transformer Engine modules ``install`` accepted, in model order."""
    return [(f"model[{index}].{name}", module) for index, model in enumerate(models)
            for name, module in model.named_modules() if is_te_module(module) and not _unsupported_reason(module)]


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


def _trainable_weight(module):
    weight = getattr(module, "weight", None)  # None with skip_weight_param_allocation
    return weight if isinstance(weight, torch.nn.Parameter) and weight.requires_grad else None
