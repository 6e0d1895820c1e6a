"""Transformer Engine layers in the B/W split: TE's own deferral, driven by rrfp's W task.

TE >= 2.3 splits its backward itself. Each Linear / LayerNormLinear / LayerNormMLP /
GroupedLinear owns ``module.wgrad_store``: while ``wgrad_store.delay_wgrad_compute()`` is
true its backward computes the input gradient, ``put``s (saved tensors, wgrad GEMM) on a
FIFO queue and returns no weight gradient (with ``fuse_wgrad_accumulation`` and
megatron's main_grad: a dummy one, ``grad_added_to_main_grad`` set). ``module.backward_dw()``
pops the *oldest* entry, runs the GEMM (into ``weight.grad``, or ``main_grad`` when fused)
and calls the hooks given to ``register_wgrad_accumulation_and_reduce_hooks``.

megatron-core ties that mechanism to its MoE communication overlap (``config.delay_wgrad_compute``
is built into the modules, and its TE wrappers' ``backward_dw`` are no-ops without it), so
rrfp does not use the flag: ``TeSplit`` enables each module's store for the length of one
B (``deferring``), notes which modules queued work under that key, and in W calls TE's own
``backward_dw`` (the first non-megatron class in the module's MRO that defines it).

* Order: TE's queue is FIFO per module, so W of a key must be the oldest queued entry of
  every module it touches. The policy runs W in B order per chunk
  (tests/unit/test_policy.py checks it over the dry run, every hint); ``run`` checks it again and
  refuses an out-of-order W before touching any gradient.
* Accumulation: TE's backward_dw *assigns* ``weight.grad``. Under megatron DDP that is what
  it expects (its hook moves grad into main_grad and clears it); without DDP, W adds the
  earlier gradient back, as autograd's AccumulateGrad would have.
* DDP: megatron DDP registered its per-parameter hook on the AccumulateGrad node (the
  modules were built without delay_wgrad_compute, so no ``skip_backward_post_hook``). In B
  it fires with no gradient (under overlap_grad_reduce with megatron's placeholder,
  ``wgrad_store.register_b_placeholder``); W calls it after backward_dw so main_grad gets
  the gradient. Fused accumulation wrote main_grad directly: nothing more to add.
  Readiness for overlapped reductions is counted by ``grad_sync.SplitReadiness``.
* Forward: TE >= 2.16 ``Linear`` keeps its store only if the deferral is on at forward time;
  ``TeSplit`` switches it on around every forward (F runs outside ``deferring``).
* TE's own bias bug (2.3 ... main): ``backward_dw`` calls ``bgrad.to`` on a None bgrad when the
  bias gradient came in B (returned / row-parallel bias, FP8); ``_BiasKeepingPop`` works around it.
* is_first_microbatch + fused accumulation: the first-forwarded microbatch's GEMM overwrites
  main_grad; if anything reached main_grad since that forward, W keeps it and adds it back.

Refused (``te_split_reason``; the default policy then runs unsplit with one line): TE
older than 2.3 or a store / module missing the attributes above; modules built with
``delay_wgrad_compute=True`` (megatron's MoE-overlap path owns them and registered DDP's
hook on the module); any Userbuffers flag (the queued tensors alias persistent UB buffers);
GroupedLinear without fused accumulation (B hands autograd its uncomputed wgrad buffers).
"""
from __future__ import annotations

import collections
import functools
import queue
import sys
from collections.abc import Callable
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

MIN_TE = (2, 3)
_STORE_ATTRS = ("delay_wgrad_compute", "enable_delay_wgrad_compute", "disable_delay_wgrad_compute", "put", "pop",
                "context")

Key = tuple[int, int]


def is_te_module(module) -> bool:
    """A Transformer Engine module with its own weight-gradient store (TE >= 2.3)."""
    return getattr(module, "wgrad_store", None) is not None


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _te_backward_dw(module) -> Optional[Callable]:
    """TE's own backward_dw: megatron's wrappers make theirs a no-op unless
    config.delay_wgrad_compute is set, so skip megatron's classes in the MRO."""
    for cls in type(module).__mro__:
        if "backward_dw" in vars(cls) and not cls.__module__.startswith("megatron."):
            return vars(cls)["backward_dw"]
    return None


def te_split_reason(module) -> str:
    """Why ``module``'s weight gradients cannot go through TE's own deferral (empty when
    they can, or when ``module`` is not a TE module). Overlapped DDP refuses nothing: B's
    placeholders give its hooks what megatron's own delayed wgrad gives them."""
    store = getattr(module, "wgrad_store", None)
    if store is None:
        return ""
    te = sys.modules.get("transformer_engine")
    if type(module).__module__.startswith("transformer_engine") or any(
            c.__module__.startswith("transformer_engine") for c in type(module).__mro__):
        found = getattr(te, "__version__", "0") if te is not None else "0"
        if _version(found) < MIN_TE:
            return f"Transformer Engine {found} < 2.3: no per-module weight-gradient deferral"
    missing = [a for a in _STORE_ATTRS if not hasattr(store, a)]
    missing += [] if _te_backward_dw(module) is not None else ["backward_dw"]
    if missing:
        return f"this Transformer Engine module lacks {missing}, which rrfp's W uses"
    if store.delay_wgrad_compute():
        return ("built with delay_wgrad_compute=True (megatron's MoE-overlap path owns that and hooks DDP onto the "
                "module); build without it: rrfp enables TE's deferral per B itself")
    ub = sorted(name for name, value in vars(module).items() if name.startswith("ub_") and value is True)
    if ub:
        return (f"Userbuffers TP overlap ({', '.join(ub)}; megatron --tp-comm-overlap): the tensors TE queues for W "
                "are views of persistent Userbuffers buffers that later layers overwrite before W runs (TE's own "
                "check covers only the wgrad ones); train without --tp-comm-overlap to split")
    if hasattr(module, "num_gemms") and not getattr(module, "fuse_wgrad_accumulation", False):
        return ("GroupedLinear without gradient_accumulation_fusion: TE's deferred backward hands autograd its "
                "not yet computed weight-gradient buffers in B; enable gradient_accumulation_fusion")
    return ""


def te_delay_wgrad_reason(module) -> str:
    """Kept for callers of the earlier name: ``te_split_reason`` without DDP."""
    return te_split_reason(module)


_FORWARD_HOOKED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # module -> its TeSplit's forward state


class _ForwardState:
    """Per module: whether rrfp switched its store on for the running forward, and how many
    weight-gradient accumulations happened since its last is_first_microbatch forward."""

    __slots__ = ("enabled_here", "since_first", "mark_output", "in_b", "first_in_b")

    def __init__(self) -> None:
        self.enabled_here = False
        self.since_first = 0
        self.mark_output = False  # this forward is the first microbatch's: hook its output
        self.in_b = False  # a deferred B is running
        self.first_in_b = False  # ... and it reached the first microbatch's output


def _is_first_forward(module, kwargs) -> bool:
    """This forward's is_first_microbatch: TE's keyword, or the attribute megatron-core's TE
    wrappers pass on for it (None when they disable the parameter transpose cache)."""
    if "is_first_microbatch" in kwargs:
        return bool(kwargs["is_first_microbatch"])
    return (getattr(module, "is_first_microbatch", None) is True
            and not getattr(module, "disable_parameter_transpose_cache", False))


class TeSplit:
    """The TE modules of one stage, deferred per key through their own stores.

    ``ddp_of(param)``: the megatron DDP owning ``param`` (None without DDP).
    ``hold(key, tensor)``: told of every tensor a queued entry keeps alive (memory meter).

    Forward: from TE 2.16 ``Linear`` keeps its store only if the deferral is on *at forward
    time*, and the executor runs F outside any ``deferring``; so every module's store is on for
    the length of its forward (a forward pre-hook and an always-called forward hook; only if it
    was off). B outside ``deferring`` still computes inline: TE's backward checks the store again.
    """

    def __init__(self, modules: list[tuple[str, torch.nn.Module]], *, ddp_of: Callable, hold: Callable) -> None:
        self._modules = modules
        self._ddp_of, self._hold = ddp_of, hold
        self._queued: dict[int, collections.deque] = {id(m): collections.deque() for _, m in modules}
        self._by_key: dict[Key, list[tuple[str, torch.nn.Module, int]]] = {}
        self._sizes: dict[int, int] = {}
        self._overwrites: set = set()  # (key, id(module)): that W's GEMM overwrites main_grad (first microbatch)
        self._regather: dict = {}  # id(queued tensor list) -> TP group: its input is this rank's shard (SP)
        for _, module in modules:
            store = module.wgrad_store
            if store.context is None:  # built without delay_wgrad_compute: TE creates the queue only then
                store.context = queue.Queue()
            if module not in _FORWARD_HOOKED:
                _FORWARD_HOOKED[module] = _ForwardState()
                module.register_forward_pre_hook(_forward_pre_hook, with_kwargs=True)
                module.register_forward_hook(_forward_hook, always_call=True)

    def __bool__(self) -> bool:
        return bool(self._modules)

    def weights(self) -> list[torch.nn.Parameter]:
        return [p for _, m in self._modules for p in m.parameters(recurse=False) if p.requires_grad]

    def begin(self, key: Key) -> None:
        """B of ``key`` starts: every module's backward defers its weight gradient."""
        for _, module in self._modules:
            self._sizes[id(module)] = module.wgrad_store.context.qsize()
            module.wgrad_store.enable_delay_wgrad_compute()
            _FORWARD_HOOKED[module].in_b = True

    def inline(self) -> None:
        """A B runs unsplit (the store is full): its GEMMs accumulate into main_grad now."""
        for _, module in self._modules:
            _FORWARD_HOOKED[module].since_first += 1

    def end(self, key: Key, *, ok: bool) -> None:
        """B of ``key`` ended: note which modules queued work (drop it when B failed)."""
        touched = []
        for name, module in self._modules:
            store, state = module.wgrad_store, _FORWARD_HOOKED[module]
            store.disable_delay_wgrad_compute()
            added = store.context.qsize() - self._sizes.pop(id(module), store.context.qsize())
            first, state.first_in_b, state.in_b = state.first_in_b, False, False
            if added <= 0:
                continue
            if not ok:
                for _ in range(added):
                    store.context.queue.pop()  # the newest entries are this failed B's
                continue
            if first and getattr(module, "fuse_wgrad_accumulation", False):
                self._overwrites.add((key, id(module)))
            group = _sp_group(module)
            for tensor_list, _ in list(store.context.queue)[-added:] if group is not None else ():
                self._keep_local_shard(tensor_list, group)
            touched.append((name, module, added))
            self._queued[id(module)].append(key)
            for tensor_list, _ in list(store.context.queue)[-added:]:
                for tensor in _tensors(tensor_list):
                    self._hold(key, tensor)
        if touched:
            self._by_key[key] = touched

    def _keep_local_shard(self, tensor_list, group) -> None:
        """SP column layer: TE queued the TP-gathered input (TP x this rank's); keep this rank's
        rows only, W gathers them again right before TE's GEMM (as for megatron-core's linears)."""
        import torch.distributed as dist

        total = tensor_list[0] if isinstance(tensor_list, list) and tensor_list else None
        size = dist.get_world_size(group)
        if type(total) is not torch.Tensor or total.shape[0] % size:  # FP8 / quantized inputs: kept as queued
            return
        rows = total.shape[0] // size
        tensor_list[0] = total.narrow(0, dist.get_rank(group) * rows, rows).clone()
        self._regather[id(tensor_list)] = group

    def _regather_inputs(self, store, added: int) -> None:
        import torch.distributed as dist

        from ..ranks import all_gather_single

        for tensor_list, _ in list(store.context.queue)[:added]:
            group = self._regather.pop(id(tensor_list), None)
            if group is not None:
                local = tensor_list[0]
                full = torch.empty((local.shape[0] * dist.get_world_size(group),) + tuple(local.shape[1:]),
                                   dtype=local.dtype, device=local.device)
                all_gather_single(full, local, group=group)
                tensor_list[0] = full

    def check(self, key: Key) -> None:
        """Refuse a W that is not the oldest queued entry of every module it touches."""
        for name, module, _ in self._by_key.get(key, ()):
            oldest = self._queued[id(module)][0]
            if oldest != key:
                raise RuntimeError(
                    f"wgrad: W of {key} for Transformer Engine module {name}: its queue is FIFO and holds "
                    f"{oldest}'s weight gradient first (queued: {list(self._queued[id(module)])}); W must run in B "
                    "order per chunk")

    def run(self, key: Key, after_weight: Optional[Callable] = None) -> None:
        """W of ``key``: TE's backward_dw on every module that queued work under it."""
        self.check(key)
        for name, module, added in self._by_key.pop(key, ()):
            self._queued[id(module)].popleft()
            overwrites = (key, id(module)) in self._overwrites
            self._overwrites.discard((key, id(module)))
            self._run_module(name, module, added, overwrites)
            if after_weight is not None:
                for param in module.parameters(recurse=False):
                    after_weight(param)

    def _run_module(self, name: str, module, added: int, overwrites: bool) -> None:
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        earlier = {id(p): p.grad for p in params}
        for p in params:
            p.grad = None
        state = _FORWARD_HOOKED[module]
        # is_first_microbatch + fused accumulation: TE's GEMM of the first-forwarded microbatch
        # overwrites main_grad. Right only if nothing reached main_grad since that forward (an
        # unsplit B or another W did): then keep what is there and add it back.
        kept = None
        if overwrites and state.since_first:
            kept = [(p.main_grad, p.main_grad.clone()) for p in params if getattr(p, "main_grad", None) is not None]
        state.since_first += 1
        backward_dw, store = _te_backward_dw(module), module.wgrad_store
        self._regather_inputs(store, added)
        target = store.context.qsize() - added
        pop = _BiasKeepingPop(store, module)
        store.pop = pop
        store.enable_delay_wgrad_compute()  # TE's pop and backward_dw run only while enabled
        try:
            while store.context.qsize() > target:
                before = store.context.qsize()
                pop.calls = 0
                backward_dw(module)
                if store.context.qsize() >= before:
                    raise RuntimeError(f"wgrad: backward_dw of Transformer Engine module {name} popped nothing")
        finally:
            store.disable_delay_wgrad_compute()
            del store.pop
            for bias in pop.sentinels:
                bias.grad = None
        if store.context.qsize() != target:
            raise RuntimeError(f"wgrad: backward_dw of {name} popped more than this W's {added} entries")
        for main_grad, copy in kept or ():
            main_grad.add_(copy)
        for p in params:
            new, old = p.grad, earlier[id(p)]
            if old is not None:
                p.grad = old if new is None else old.add_(new)
            ddp = self._ddp_of(p)
            if ddp is not None and p.grad is not None and not getattr(p, "skip_backward_post_hook", False):
                ddp._make_backward_post_hook(p)()  # moves grad into main_grad, as in an unsplit backward


def _sp_group(module):
    """The TP group of a column-parallel sequence-parallel TE layer (its queued input is the
    TP-gathered one), else None."""
    if (getattr(module, "sequence_parallel", False) and getattr(module, "parallel_mode", None) == "column"
            and getattr(module, "tp_size", 1) > 1):
        return getattr(module, "tp_group", None)
    return None


def _forward_pre_hook(module, args, kwargs):
    state = _FORWARD_HOOKED[module]
    store = module.wgrad_store
    state.enabled_here = not store.delay_wgrad_compute()
    if state.enabled_here:
        store.enable_delay_wgrad_compute()
    if _is_first_forward(module, kwargs) and getattr(module, "fuse_wgrad_accumulation", False):
        state.since_first, state.mark_output = 0, True
    return None


def _forward_hook(module, args, output):
    state = _FORWARD_HOOKED[module]
    if state.enabled_here:
        module.wgrad_store.disable_delay_wgrad_compute()
        state.enabled_here = False
    if state.mark_output:
        state.mark_output = False
        out = next((t for t in _tensors(output) if t.requires_grad), None)
        if out is not None:  # its gradient arrives in that microbatch's B, before the module's backward
            out.register_hook(functools.partial(_note_first, state))
    return None


def _note_first(state: _ForwardState, grad):
    if state.in_b:
        state.first_in_b = True
    return None


def _bias_of_pop(module, index: int):
    """The bias parameter whose gradient TE's backward_dw sets from its ``index``-th pop, or None."""
    if not getattr(module, "use_bias", False):
        return None
    if hasattr(module, "fc1_bias") and hasattr(module, "fc2_bias"):  # LayerNormMLP: fc2's entry, then fc1's
        return (module.fc2_bias, module.fc1_bias)[index] if index < 2 else None
    names = getattr(module, "bias_names", None) or []
    return getattr(module, names[0], None) if len(names) == 1 and index == 0 else None


class _BiasKeepingPop:
    """TE's pop, for its backward_dw. Works around TE's own bug (every TE from 2.3 through main):
    backward_dw sets ``bias.grad = bgrad.to(...)`` whenever ``bias.grad is None``, but ``bgrad`` is
    None where the bias gradient was computed in B (a returned / row-parallel bias, FP8). Such a
    bias gets a stand-in ``bias.grad`` (bias-sized) for backward_dw to leave alone, cleared after."""

    def __init__(self, store, module) -> None:
        self._pop, self._module = type(store).pop.__get__(store), module
        self.calls = 0  # pops within one backward_dw (LayerNormMLP pops fc2's entry, then fc1's)
        self.sentinels: list = []

    def __call__(self):
        result = self._pop()
        bias = _bias_of_pop(self._module, self.calls)
        self.calls += 1
        grads = result[0]
        if (bias is not None and isinstance(grads, (tuple, list)) and len(grads) > 1 and grads[1] is None
                and bias.grad is None):
            bias.grad = torch.empty_like(bias)
            self.sentinels.append(bias)
        return result


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


__all__ = ["MIN_TE", "TeSplit", "is_te_module", "te_delay_wgrad_reason", "te_split_reason"]
