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
  (tests/test_policy.py checks it over the dry run, every hint); ``run`` checks it again and
  refuses an out-of-order W before touching any gradient.
* Accumulation: TE's backward_dw *assigns* ``weight.grad``. Under megatron DDP that is what
  it expects (its hook moves grad into main_grad and clears it); without DDP, W adds the
  earlier gradient back, as autograd's AccumulateGrad would have.
* DDP: megatron DDP registered its per-parameter hook on the AccumulateGrad node (the
  modules were built without delay_wgrad_compute, so no ``skip_backward_post_hook``). In B
  it fires with no gradient (a no-op add); W calls it after backward_dw so main_grad gets
  the gradient. Fused accumulation wrote main_grad directly: nothing more to add.
  Readiness for overlapped reductions is counted by ``grad_sync.SplitReadiness``.

Refused (``te_split_reason``; the default policy then runs unsplit with one line): TE
older than 2.3 or a store / module missing the attributes above; modules built with
``delay_wgrad_compute=True`` (megatron's MoE-overlap path owns them and registered DDP's
hook on the module); ``ub_bulk_wgrad`` (TE refuses it with the deferral); a TE layer
without fused accumulation under ``overlap_grad_reduce`` (megatron DDP's hook asserts on the
missing weight gradient in B).
"""
from __future__ import annotations

import collections
import queue
import sys
from collections.abc import Callable
from typing import Optional

import torch

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


def te_split_reason(module, *, overlap_grad_reduce: bool = False) -> str:
    """Why ``module``'s weight gradients cannot go through TE's own deferral (empty when
    they can, or when ``module`` is not a TE module)."""
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
    if getattr(module, "ub_bulk_wgrad", False):
        return "ub_bulk_wgrad (Transformer Engine refuses it with delayed weight gradients)"
    if overlap_grad_reduce and not getattr(module, "fuse_wgrad_accumulation", False):
        return ("overlap_grad_reduce without gradient_accumulation_fusion: megatron DDP's hook asserts on the weight "
                "gradient TE defers; enable gradient_accumulation_fusion")
    return ""


def te_delay_wgrad_reason(module) -> str:
    """Kept for callers of the earlier name: ``te_split_reason`` without DDP."""
    return te_split_reason(module)


class TeSplit:
    """The TE modules of one stage, deferred per key through their own stores.

    ``ddp_of(param)``: the megatron DDP owning ``param`` (None without DDP).
    ``hold(key, tensor)``: told of every tensor a queued entry keeps alive (memory meter).
    """

    def __init__(self, modules: list[tuple[str, torch.nn.Module]], *, ddp_of: Callable, hold: Callable) -> None:
        self._modules = modules
        self._ddp_of, self._hold = ddp_of, hold
        self._queued: dict[int, collections.deque] = {id(m): collections.deque() for _, m in modules}
        self._by_key: dict[Key, list[tuple[str, torch.nn.Module, int]]] = {}
        self._sizes: dict[int, int] = {}
        for _, module in modules:
            store = module.wgrad_store
            if store.context is None:  # built without delay_wgrad_compute: TE creates the queue only then
                store.context = queue.Queue()

    def __bool__(self) -> bool:
        return bool(self._modules)

    def weights(self) -> list[torch.nn.Parameter]:
        return [p for _, m in self._modules for p in m.parameters(recurse=False) if p.requires_grad]

    def begin(self, key: Key) -> None:
        """B of ``key`` starts: every module's backward defers its weight gradient."""
        for _, module in self._modules:
            self._sizes[id(module)] = module.wgrad_store.context.qsize()
            module.wgrad_store.enable_delay_wgrad_compute()

    def end(self, key: Key, *, ok: bool) -> None:
        """B of ``key`` ended: note which modules queued work (drop it when B failed)."""
        touched = []
        for name, module in self._modules:
            store = module.wgrad_store
            store.disable_delay_wgrad_compute()
            added = store.context.qsize() - self._sizes.pop(id(module), store.context.qsize())
            if added <= 0:
                continue
            if not ok:
                for _ in range(added):
                    store.context.queue.pop()  # the newest entries are this failed B's
                continue
            touched.append((name, module, added))
            self._queued[id(module)].append(key)
            for tensor_list, _ in list(store.context.queue)[-added:]:
                for tensor in _tensors(tensor_list):
                    self._hold(key, tensor)
        if touched:
            self._by_key[key] = touched

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
            self._run_module(name, module, added)
            if after_weight is not None:
                for param in module.parameters(recurse=False):
                    after_weight(param)

    def _run_module(self, name: str, module, added: int) -> None:
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        earlier = {id(p): p.grad for p in params}
        for p in params:
            p.grad = None
        backward_dw, store = _te_backward_dw(module), module.wgrad_store
        target = store.context.qsize() - added
        store.enable_delay_wgrad_compute()  # TE's pop and backward_dw run only while enabled
        try:
            while store.context.qsize() > target:
                before = store.context.qsize()
                backward_dw(module)
                if store.context.qsize() >= before:
                    raise RuntimeError(f"wgrad: backward_dw of Transformer Engine module {name} popped nothing")
        finally:
            store.disable_delay_wgrad_compute()
        if store.context.qsize() != target:
            raise RuntimeError(f"wgrad: backward_dw of {name} popped more than this W's {added} entries")
        for p in params:
            new, old = p.grad, earlier[id(p)]
            if old is not None:
                p.grad = old if new is None else old.add_(new)
            ddp = self._ddp_of(p)
            if ddp is not None and p.grad is not None and not getattr(p, "skip_backward_post_hook", False):
                ddp._make_backward_post_hook(p)()  # moves grad into main_grad, as in an unsplit backward


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


__all__ = ["MIN_TE", "TeSplit", "is_te_module", "te_delay_wgrad_reason", "te_split_reason"]
