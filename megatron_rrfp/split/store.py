"""The store of the B/W split: deferred weight-gradient work per (microbatch, chunk), and W.

``WeightGradStore.deferring(key)`` is active over B (``megatron_linear.py``'s autograd function stashes
each linear's work here); ``run(key)`` is W: it replays the recorded GEMM (or fused kernel)
and accumulates where the unsplit backward would have. Also here: which modules can join
the split (``_unsupported_reason``) and which megatron DDP owns each parameter, since W
needs both. The mechanism and its DDP contract are described in ``megatron_linear.py``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import operator
import weakref
from collections.abc import Iterator
from typing import Optional

import torch
from megatron.core.tensor_parallel import layers as _layers
from torch.utils.weak import WeakIdKeyDictionary

from .te import TeSplit, is_te_module, te_split_reason

__all__ = ["Key", "WeightGradStore"]

Key = tuple[int, int]  # (microbatch, model chunk)

_LINEAR_CLASSES = (_layers.ColumnParallelLinear, _layers.RowParallelLinear)


# Parameter -> qualified name (for errors and coverage) and -> weakref to its megatron DDP.
_NAMES: WeakIdKeyDictionary = WeakIdKeyDictionary()


_DDP_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()


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
_FLAGGED: list = []  # parameters whose grad_added_to_main_grad a B placeholder set (restored after that B)
_PREHOOKED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> (AccumulateGrad node, hook handle)


def register_b_placeholder(param: torch.nn.Parameter) -> None:
    """Under megatron DDP with overlap_grad_reduce, DDP's hook on a parameter's AccumulateGrad
    asserts ``param.grad is not None`` — but a deferred B gives a deferred weight (and a bias TE
    folds into its deferred GEMM) no gradient. A pre-hook on that node, only inside a deferring
    and only when no gradient arrived, hands the hook what megatron's own delayed-wgrad path hands
    it: an uninitialised ``torch.empty`` with ``grad_added_to_main_grad`` set, so the hook adds
    nothing and clears it (zeros where ``zero_out_wgrad`` asks for them). No pass over the weight;
    a real gradient (e.g. a tied embedding's part) arrives untouched. Idempotent."""
    if param in _PREHOOKED or not param.requires_grad:
        return
    with torch.enable_grad():
        node = param.view_as(param).grad_fn.next_functions[0][0]  # the node DDP hooked (it keeps it alive)
    ref = weakref.ref(param)

    def prehook(grad_outputs):
        param = ref()
        if _active is None or param is None or grad_outputs[0] is not None or param.grad is not None:
            return None
        ddp = _ddp_of(param)
        if ddp is None or not ddp.ddp_config.overlap_grad_reduce or ddp.param_to_bucket_group.get(param) is None:
            return None
        zero = getattr(param, "zero_out_wgrad", False)
        if not zero and not getattr(param, "grad_added_to_main_grad", True):
            param.grad_added_to_main_grad = True  # the hook skips its add; reset when this B ends
            _FLAGGED.append(param)
        param.grad = torch.zeros_like(param) if zero else torch.empty_like(param)
        return None

    _PREHOOKED[param] = (node, node.register_prehook(prehook))


def _restore_flags() -> None:
    while _FLAGGED:
        _FLAGGED.pop().grad_added_to_main_grad = False


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
        for param in self._te.weights():
            register_b_placeholder(param)
        self._pending: dict[Key, _Pending] = {}  # in the order B ran
        self._inline: set[Key] = set()  # keys whose W ran inside B (max_pending reached)
        self._bytes = 0
        self.peak_pending_bytes = 0
        self.peak_key_bytes = 0  # the most one key's W kept (policy/membytes.StageBytes.pending)

    @contextlib.contextmanager
    def deferring(self, key: Key, *, inline: bool = False) -> Iterator[None]:
        """Inside: the backward of installed megatron linears computes only input (and
        bias) gradients; their weight-gradient work is stashed under ``key``. ``inline``:
        this B runs unsplit (the arbiter's byte budget has no room for its stash) and the
        later ``run(key)`` is a no-op, as when the store is full."""
        global _active
        key = _check_key(key)
        if key in self._pending or key in self._inline:
            raise ValueError(f"wgrad: B of {key} was already deferred and its W has not run; "
                             f"pending: {self.pending()}")
        if _active is not None:
            raise RuntimeError(f"wgrad: deferring({key}) entered while deferring({_active[1]}) is active; "
                               "one backward at a time")
        if inline or (self.max_pending is not None and len(self._pending) >= self.max_pending):
            self._inline.add(key)  # store full: this backward runs unsplit
            self._te.inline()
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
            _restore_flags()
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
        self.peak_key_bytes = max(self.peak_key_bytes, entry.nbytes)

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
        # megatron's dummy: torch.empty (the hook does not read it), zeros only for zero_out_wgrad
        make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
        weight.grad = make(weight.main_grad.shape, dtype=weight.dtype, device=weight.main_grad.device)
        ddp._make_backward_post_hook(weight)()


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


def _is_patchable(module) -> bool:
    return (isinstance(module, _LINEAR_CLASSES)
            and type(module)._forward_impl in (cls._forward_impl for cls in _LINEAR_CLASSES))


def _unsupported_reason(module) -> str:
    name = type(module).__name__
    if name == "GroupedMLP":  # legacy grouped GEMM (no TE): one autograd function for every expert
        return ("legacy grouped-GEMM experts (GroupedMLP) compute their weight gradients inside one grouped GEMM "
                "backward, which cannot be deferred; use Transformer Engine's (--transformer-impl "
                "transformer_engine: TEGroupedMLP, split) or moe_grouped_gemm=False (SequentialMLP, split)")
    if name == "TEGroupedMLP" and getattr(module, "_with_fused_impl", False):
        return ("TEGroupedMLP with use_transformer_engine_op_fuser: its fused TE ops keep their weight-gradient "
                "stores outside the module tree rrfp drives; drop --use-transformer-engine-op-fuser (its "
                "GroupedLinear experts then split)")
    if _is_patchable(module) and getattr(module, "gtp_remat_size", 1) > 1:
        return f"GTP-sharded weight (gtp_remat_size={module.gtp_remat_size}; W would need a reduce-scatter)"
    if not is_te_module(module):
        return ""
    return te_split_reason(module)


def _te_modules(models) -> list:
    """(name, module) of the Transformer Engine modules ``install`` accepted, in model order."""
    return [(f"model[{index}].{name}", module) for index, model in enumerate(models)
            for name, module in model.named_modules() if is_te_module(module) and not _unsupported_reason(module)]


def _trainable_weight(module):
    weight = getattr(module, "weight", None)  # None with skip_weight_param_allocation
    return weight if isinstance(weight, torch.nn.Parameter) and weight.requires_grad else None
