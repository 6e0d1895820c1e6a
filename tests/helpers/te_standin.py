"""A CPU stand-in for a Transformer Engine (>= 2.3) Linear, for the tests of mcore/wgrad_te.py.

Transformer Engine needs CUDA, so the CPU tests cannot run it. ``StandInTELinear`` follows
TE's *documented* weight-gradient-store contract exactly (transformer_engine/pytorch/module/
base.py ``WeightGradStore`` and ``TransformerEngineBaseModule.backward_dw``; linear.py's
backward), written here from that contract, not copied:

* ``wgrad_store = WeightGradStore(delay_wgrad_compute)``: the queue (``context``, a
  ``queue.Queue``) exists only when built with ``delay_wgrad_compute=True``;
  ``delay_wgrad_compute()`` / ``enable_delay_wgrad_compute()`` / ``disable_delay_wgrad_compute()``;
  ``put([tensors], func)`` and ``pop()`` assert the store is enabled; ``pop`` runs the
  *oldest* entry's ``func(*tensors)`` and raises "Pop empty queue" when there is none.
* backward while enabled: input gradient now, ``put([input, grad_output], wgrad_gemm)``,
  and the weight gradient returned to autograd is None — or, with
  ``fuse_wgrad_accumulation`` and a megatron ``main_grad``, a dummy one with
  ``weight.grad_added_to_main_grad = True`` (the GEMM accumulates into main_grad later).
  Not enabled: the weight gradient now (fused: into main_grad, dummy returned).
* ``backward_dw()``: nothing unless the store is enabled; pops, assigns ``weight.grad``
  (not fused), then calls every hook given to ``register_wgrad_accumulation_and_reduce_hooks``.

No bias (TE's bias-gradient placement under deferral is not modelled), no TP, no FP8: the
real module is exercised on a GPU by scripts/gpu_selfcheck.py's ``te-bfw`` step.
"""
from __future__ import annotations

import queue

import torch
from megatron.core.transformer.module import MegatronModule


class WeightGradStore:
    def __init__(self, delay_wgrad_compute: bool = False, ub_bulk_wgrad: bool = False):
        assert not (delay_wgrad_compute and ub_bulk_wgrad), "ub_bulk_wgrad is not supported with delay_wgrad_compute"
        self.context = queue.Queue() if delay_wgrad_compute else None
        self.enabled = bool(delay_wgrad_compute)

    def delay_wgrad_compute(self) -> bool:
        return self.enabled

    def enable_delay_wgrad_compute(self) -> None:
        self.enabled = True

    def disable_delay_wgrad_compute(self) -> None:
        self.enabled = False

    def put(self, tensor_list, func) -> None:
        assert self.enabled is True, "delay_wgrad_compute is not enabled"
        self.context.put([tensor_list, func])

    def pop(self):
        assert self.enabled is True, "delay_wgrad_compute is not enabled"
        if self.context.qsize() > 0:
            tensor_list, func = self.context.get()
            return func(*tensor_list), tensor_list
        raise RuntimeError("Pop empty queue.")


class _StandInLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight, module):
        ctx.save_for_backward(inp, weight)
        ctx.module = module
        return inp.matmul(weight.t())

    @staticmethod
    def backward(ctx, grad_output):
        inp, weight = ctx.saved_tensors
        module = ctx.module
        weight = module.weight  # the Parameter (main_grad lives on it)
        dgrad = grad_output.matmul(weight)
        fused = module.fuse_wgrad_accumulation

        def wgrad_gemm(x, dy):
            dw = dy.reshape(-1, dy.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
            if fused:
                weight.main_grad.add_(dw)
                return weight.main_grad, None
            return dw, None

        store = module.wgrad_store
        if store is not None and store.delay_wgrad_compute():
            store.put([inp, grad_output], wgrad_gemm)
            wgrad = None
        else:
            wgrad, _ = wgrad_gemm(inp, grad_output)
        if fused and hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
            wgrad = torch.zeros_like(weight)  # TE: get_dummy_wgrad
        elif fused:
            wgrad = None
        return dgrad, wgrad, None


class StandInTELinear(torch.nn.Module):
    def __init__(self, in_features: int, out_features: int, *, delay_wgrad_compute: bool = False,
                 fuse_wgrad_accumulation: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(out_features, in_features) / in_features ** 0.5)
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.wgrad_store = WeightGradStore(delay_wgrad_compute)
        self.wgrad_accumulation_and_reduce_hooks = []

    def forward(self, inp):
        return _StandInLinearFunction.apply(inp, self.weight, self)

    def register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def backward_dw(self) -> None:
        if self.wgrad_store is None or not self.wgrad_store.delay_wgrad_compute():
            return
        (wgrad, _), _ = self.wgrad_store.pop()
        if not self.fuse_wgrad_accumulation:
            self.weight.grad = wgrad.to(self.weight.dtype)
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()


class StandInStage(MegatronModule):
    """x -> norm -> te1 -> gelu -> te2 (+ x): a pipeline-stage-shaped module whose linears are
    TE stand-ins and whose norm gets its gradient in B."""

    def __init__(self, config, *, hidden: int, ffn: int, seed: int, fused: bool = False, delay: bool = False):
        super().__init__(config=config)
        torch.manual_seed(seed)
        self.norm = torch.nn.LayerNorm(hidden)
        self.te1 = StandInTELinear(hidden, ffn, fuse_wgrad_accumulation=fused, delay_wgrad_compute=delay)
        self.te2 = StandInTELinear(ffn, hidden, fuse_wgrad_accumulation=fused, delay_wgrad_compute=delay)

    def forward(self, x):
        return x + self.te2(torch.nn.functional.gelu(self.te1(self.norm(x))))
