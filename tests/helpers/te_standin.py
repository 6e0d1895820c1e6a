"""A CPU stand-in for Transformer Engine's Linear and GroupedLinear, for the tests of split/te.py.

TE needs CUDA, so the CPU tests cannot run it. This module follows TE's SOURCE (read from
the NVIDIA/TransformerEngine tags v2.3 ... v2.18, release_v2.19 and main = 2.20.0.dev0;
written here, not copied) in what the B/W split depends on, tagged by version
(``te_version("2.18")`` selects one; default ``LATEST``):

* ``WeightGradStore`` (module/base.py, later module/_common.py): the queue exists only when
  built with ``delay_wgrad_compute=True``; ``put`` / ``pop`` assert the store is enabled;
  ``pop`` runs the oldest entry's ``func(*tensors)``; ``ub_bulk_wgrad`` with the deferral asserts.
* Forward-time store gating: from 2.16, ``Linear.forward`` hands its autograd function the
  store only if the deferral is on *at forward time* (linear.py ``wgrad_store = self.wgrad_store
  if self.wgrad_store.delay_wgrad_compute() else None``); before 2.16 always. Its backward
  defers only if the store it got is enabled *at backward time*.
* Bias: ``apply_bias = bias and not return_bias``; a row-parallel layer adds an applied bias
  outside the GEMM (``gemm_bias_unfused_add``). A bias inside the GEMM: without FP8 its
  gradient is folded into the wgrad GEMM (so deferred: B returns None for it and the GEMM's
  ``db`` comes out of ``pop``); with FP8 it is computed in B (grad_output_preprocess) and the
  GEMM gets no bias. A returned or unfused bias gets its gradient from autograd outside TE.
* ``backward_dw``: nothing unless the store is enabled; pops; not fused: assigns
  ``weight.grad`` (only if None before 2.8); ``if use_bias and bias.grad is None: bias.grad =
  bgrad.to(...)`` — which raises on a None ``bgrad`` (TE's own bug, unfixed through main);
  calls the ``register_wgrad_accumulation_and_reduce_hooks`` hooks (2.7+). 2.3's pop result
  has four elements.
* Fused accumulation (``fuse_wgrad_accumulation`` + megatron's ``main_grad``): the GEMM
  accumulates into main_grad, except that a forward with ``is_first_microbatch=True``
  *overwrites* it; B returns the cached dummy (``get_dummy_wgrad``) and sets
  ``grad_added_to_main_grad``.
* Userbuffers: with ``ub_bulk_dgrad`` / ``ub_overlap_ag`` the input TE hands the wgrad GEMM
  is a view of one persistent buffer shared by every layer of that shape.
* Sequence parallelism (column-parallel ``Linear``, ``sequence_parallel`` with a TP group of
  size > 1): the forward all-gathers the input along dim 0 and saves the local shard; the
  backward gathers it again (``backward_input_needs_gather``) and queues that TP-gathered
  ``inputmat_total`` for W; the input gradient is reduce-scattered.
* ``GroupedLinear``: ``num_gemms`` weights ``weight{i}``; deferred entry
  ``[inputmats, grad_outputs, wgrad_list]``; not fused, ``wgrad_list`` is a fresh
  ``torch.empty`` buffer that B already returns to autograd (uncomputed) and ``backward_dw``
  assigns after the GEMM filled it; fused, it is the main_grads.

FP8 (``fp8_autocast``) changes only where the bias gradient is computed; the math stays
full precision. No TP collectives. The real modules run on a GPU in scripts/gpu_selfcheck.py.
"""
from __future__ import annotations

import contextlib
import queue

import torch
from megatron.core.transformer.module import MegatronModule

VERSIONS = ("2.3", "2.4", "2.7", "2.8", "2.15", "2.16", "2.18", "2.19", "2.20")
LATEST = "2.20"
_STATE = {"version": (2, 20), "fp8": False}


def _parse(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


@contextlib.contextmanager
def te_version(text: str):
    """Behave like Transformer Engine ``text`` inside (also sets ``transformer_engine.__version__``
    if a fake package module is installed by the caller)."""
    old = _STATE["version"]
    _STATE["version"] = _parse(text)
    try:
        yield
    finally:
        _STATE["version"] = old


def version() -> tuple[int, int]:
    return _STATE["version"]


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True):
    old = _STATE["fp8"]
    _STATE["fp8"] = enabled
    try:
        yield
    finally:
        _STATE["fp8"] = old


class WeightGradStore:
    def __init__(self, delay_wgrad_compute: bool = False, ub_bulk_wgrad: bool = False):
        if delay_wgrad_compute:
            self.context = queue.Queue()
            assert ub_bulk_wgrad is False, "ub_bulk_wgrad is not supported when enabling delay_wgrad_compute"
            self.enabled = True
        else:
            self.context = None
            self.enabled = False

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


_DUMMY: dict = {}


def get_dummy_wgrad(shape, dtype, zero: bool = False) -> torch.Tensor:
    """TE's one cached dummy weight gradient per (shape, dtype)."""
    key = (tuple(shape), dtype)
    if key not in _DUMMY:
        _DUMMY[key] = torch.empty(shape, dtype=dtype)
    if zero:
        _DUMMY[key].zero_()
    return _DUMMY[key]


_UB_BUFFERS: dict = {}  # Userbuffers: one persistent buffer per shape, shared by every layer


def _ub_buffer(like: torch.Tensor) -> torch.Tensor:
    key = (tuple(like.shape), like.dtype)
    if key not in _UB_BUFFERS:
        _UB_BUFFERS[key] = torch.empty_like(like)
    return _UB_BUFFERS[key]


def _custom_ddp_wgrad(weight, main_grad, wgrad, fused: bool):
    """TE's "handle custom DDP from mcore": fused + grad_added_to_main_grad -> the dummy."""
    if fused and hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        return get_dummy_wgrad(list(main_grad.shape), weight.dtype, zero=getattr(weight, "zero_out_wgrad", False))
    return None if fused else wgrad


def _gather_first_dim(tensor, group):
    import torch.distributed as dist

    out = torch.empty((tensor.shape[0] * dist.get_world_size(group),) + tuple(tensor.shape[1:]), dtype=tensor.dtype)
    dist.all_gather_into_tensor(out, tensor.contiguous(), group=group)
    return out


def _reduce_scatter_first_dim(tensor, group):
    import torch.distributed as dist

    total = tensor.contiguous().clone()
    dist.all_reduce(total, group=group)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = total.shape[0] // size
    return total.narrow(0, rank * rows, rows).clone()


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight, bias, module, wgrad_store, is_first_microbatch, fp8):
        ctx.save_for_backward(inp)  # under SP the local shard
        ctx.module, ctx.wgrad_store, ctx.is_first_microbatch, ctx.fp8 = module, wgrad_store, is_first_microbatch, fp8
        ctx.use_bias = bias is not None
        total = _gather_first_dim(inp, module.tp_group) if module.sequence_parallel else inp
        out = total.matmul(weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad_output):
        (inp,) = ctx.saved_tensors
        module = ctx.module
        weight = module.weight  # the Parameter (main_grad lives on it)
        fused = module.fuse_wgrad_accumulation
        if module.sequence_parallel:  # TE: backward_input_needs_gather; dgrad reduce-scattered
            inp = _gather_first_dim(inp, module.tp_group)
            dgrad = _reduce_scatter_first_dim(grad_output.matmul(weight), module.tp_group)
        else:
            dgrad = grad_output.matmul(weight)
        dy = grad_output.reshape(-1, grad_output.shape[-1])
        x = inp.reshape(-1, inp.shape[-1])
        if module.ub_bulk_dgrad or module.ub_overlap_ag:  # the GEMM's input lives in a shared UB buffer
            buffer = _ub_buffer(x)
            buffer.copy_(x)
            x = buffer
        grad_bias = dy.sum(0) if (ctx.use_bias and ctx.fp8) else None  # FP8: bias grad in B
        main_grad = getattr(weight, "main_grad", None) if fused else None
        if ctx.is_first_microbatch is not None:
            accumulate = fused and not ctx.is_first_microbatch
        else:
            accumulate = fused
        gemm_bias = ctx.use_bias and grad_bias is None and not ctx.fp8

        def wgrad_gemm(x, dy):
            dw = dy.t().matmul(x)
            db = dy.sum(0) if gemm_bias else None
            if fused:
                if accumulate:
                    main_grad.add_(dw)
                else:
                    main_grad.copy_(dw)  # is_first_microbatch: overwrite
                return main_grad, db
            return dw, db

        store = ctx.wgrad_store
        wgrad = None
        if store is not None and store.delay_wgrad_compute():
            if module.ub_bulk_wgrad:
                raise NotImplementedError("Delayed weight grad computation is not supported with Userbuffers")
            store.put([x, dy], wgrad_gemm)
        else:
            wgrad, db = wgrad_gemm(x, dy)
            if grad_bias is None:
                grad_bias = db
        if not ctx.use_bias:
            grad_bias = None
        wgrad = _custom_ddp_wgrad(weight, main_grad, wgrad, fused)
        return dgrad, wgrad, grad_bias, None, None, None, None


def _pop_grads(store):
    """``pop`` and its (wgrad, bgrad) as the version's backward_dw unpacks them."""
    result, tensors = store.pop()
    if version() == (2, 3):
        result = tuple(result) + (None, None)  # 2.3: (wgrad, grad_bias_, _, _)
        wgrad, bgrad, _, _ = result
    else:
        wgrad, bgrad = result
    return wgrad, bgrad, tensors


class _TEBase(torch.nn.Module):
    """What TransformerEngineBaseModule contributes: the store, the hooks, backward_dw."""

    def _init_store(self, delay_wgrad_compute: bool, ub_bulk_wgrad: bool) -> None:
        self.wgrad_store = WeightGradStore(delay_wgrad_compute, ub_bulk_wgrad)
        self.wgrad_accumulation_and_reduce_hooks = []
        self.fp8 = False
        if delay_wgrad_compute:
            for param in self.parameters(recurse=False):
                param.skip_backward_post_hook = True

    def register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def need_backward_dw(self) -> bool:
        return self.wgrad_store is not None and self.wgrad_store.delay_wgrad_compute()

    def _trigger_hooks(self) -> None:
        if version() >= (2, 7):
            for hook in self.wgrad_accumulation_and_reduce_hooks:
                hook()


class Linear(_TEBase):
    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, return_bias: bool = False,
                 parallel_mode=None, fuse_wgrad_accumulation: bool = False, delay_wgrad_compute: bool = False,
                 ub_bulk_dgrad: bool = False, ub_bulk_wgrad: bool = False, ub_overlap_ag: bool = False,
                 sequence_parallel: bool = False, tp_group=None):
        super().__init__()
        import torch.distributed as dist

        self.parallel_mode, self.tp_group = parallel_mode, tp_group
        self.tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.sequence_parallel = self.tp_size > 1 and sequence_parallel and parallel_mode == "column"
        self.weight = torch.nn.Parameter(torch.randn(out_features, in_features) / in_features ** 0.5)
        self.use_bias, self.return_bias = bias, return_bias
        self.apply_bias = bias and not return_bias
        self.gemm_bias_unfused_add = parallel_mode == "row" and self.apply_bias
        self.bias = torch.nn.Parameter(torch.randn(out_features) * 0.1) if bias else None
        self.weight_names, self.bias_names = ["weight"], (["bias"] if bias else [])
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.ub_bulk_dgrad, self.ub_bulk_wgrad, self.ub_overlap_ag = ub_bulk_dgrad, ub_bulk_wgrad, ub_overlap_ag
        self._init_store(delay_wgrad_compute, ub_bulk_wgrad)

    def forward(self, inp, is_first_microbatch=None):
        self.fp8 = _STATE["fp8"]
        store = self.wgrad_store
        if version() >= (2, 16) and not store.delay_wgrad_compute():
            store = None  # linear.py: the store is kept only if the deferral is on at forward time
        gemm_bias = self.bias if (self.apply_bias and not self.gemm_bias_unfused_add) else None
        out = _LinearFunction.apply(inp, self.weight, gemm_bias, self, store, is_first_microbatch, self.fp8)
        if self.gemm_bias_unfused_add:
            out = out + self.bias
        if self.return_bias:
            return out, self.bias
        return out

    def backward_dw(self) -> None:
        if not self.need_backward_dw():
            return
        wgrad, bgrad, _ = _pop_grads(self.wgrad_store)
        if not self.fuse_wgrad_accumulation:
            if version() >= (2, 8) or self.weight.grad is None:
                self.weight.grad = wgrad.to(self.weight.dtype)
        if self.use_bias:
            if self.bias.grad is None:
                self.bias.grad = bgrad.to(self.bias.dtype)  # TE: AttributeError when bgrad is None
        self._trigger_hooks()


class _GroupedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, module, wgrad_store, is_first_microbatch, m_splits, *weights):
        ctx.save_for_backward(inp)
        ctx.module, ctx.wgrad_store, ctx.is_first_microbatch, ctx.m_splits = (module, wgrad_store,
                                                                                is_first_microbatch, m_splits)
        pieces = torch.split(inp, m_splits)
        return torch.cat([x.matmul(w.t()) for x, w in zip(pieces, weights, strict=True)])

    @staticmethod
    def backward(ctx, grad_output):
        (inp,) = ctx.saved_tensors
        module = ctx.module
        weights = [getattr(module, f"weight{i}") for i in range(module.num_gemms)]
        fused = module.fuse_wgrad_accumulation
        dys, xs = torch.split(grad_output, ctx.m_splits), torch.split(inp, ctx.m_splits)
        dgrad = torch.cat([dy.matmul(w) for dy, w in zip(dys, weights, strict=True)])
        if fused:
            main_grads = [w.main_grad for w in weights]
            wgrad_list = main_grads
        else:
            main_grads = [None] * len(weights)
            packed = torch.empty((len(weights),) + tuple(weights[0].shape), dtype=weights[0].dtype)
            wgrad_list = [packed[i] for i in range(len(weights))]
        accumulate = fused and not ctx.is_first_microbatch if ctx.is_first_microbatch is not None else fused

        def grouped_gemm_wgrad(xs, dys, out):
            for x, dy, o in zip(xs, dys, out, strict=True):
                dw = dy.t().matmul(x)
                o.add_(dw) if accumulate else o.copy_(dw)
            return None, [None] * len(out), None

        store = ctx.wgrad_store
        if store is not None and store.delay_wgrad_compute():
            store.put([list(xs), list(dys), wgrad_list], grouped_gemm_wgrad)
        else:
            grouped_gemm_wgrad(xs, dys, wgrad_list)
        wgrads = [_custom_ddp_wgrad(w, m, g, fused) for w, m, g in zip(weights, main_grads, wgrad_list, strict=True)]
        return (dgrad, None, None, None, None, *wgrads)


class GroupedLinear(_TEBase):
    def __init__(self, num_gemms: int, in_features: int, out_features: int, *, fuse_wgrad_accumulation=False,
                 delay_wgrad_compute: bool = False):
        super().__init__()
        self.num_gemms, self.use_bias = num_gemms, False
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.randn(out_features, in_features)
                                                                     / in_features ** 0.5))
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self._init_store(delay_wgrad_compute, False)

    def forward(self, inp, m_splits, is_first_microbatch=None):
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        return _GroupedFunction.apply(inp, self, self.wgrad_store, is_first_microbatch, list(m_splits), *weights)

    def backward_dw(self) -> None:
        if not self.need_backward_dw() or self.wgrad_store.context is None or self.wgrad_store.context.empty():
            return
        (_, _grad_biases, _), tensor_list = self.wgrad_store.pop()
        if not self.fuse_wgrad_accumulation:
            for i in range(self.num_gemms):
                weight = getattr(self, f"weight{i}")
                weight.grad = tensor_list[2][i].to(weight.dtype)
        self._trigger_hooks()


class TEGroupedMLP(MegatronModule):
    """megatron-core's TEGroupedMLP shape: fc1 (grouped) -> gelu -> fc2 (grouped), the experts'
    tokens split by ``m_splits``; ``_with_fused_impl`` as config.use_transformer_engine_op_fuser."""

    def __init__(self, config, *, num_experts: int, hidden: int, ffn: int, fused: bool, fused_impl: bool = False):
        super().__init__(config=config)
        self.linear_fc1 = GroupedLinear(num_experts, hidden, ffn, fuse_wgrad_accumulation=fused)
        self.linear_fc2 = GroupedLinear(num_experts, ffn, hidden, fuse_wgrad_accumulation=fused)
        self._with_fused_impl = fused_impl

    def forward(self, x, m_splits):
        return self.linear_fc2(torch.nn.functional.gelu(self.linear_fc1(x, m_splits)), m_splits)


class StandInStage(MegatronModule):
    """x -> norm -> te1 (column: bias in the GEMM) -> gelu -> te2 (row: bias returned, added
    by the caller as megatron's skip_bias_add layers do) (+ x): a pipeline-stage-shaped module
    of TE linears whose norm gets its gradient in B. ``bias``: "none", "gemm" (te1's bias in
    the GEMM, te2 none), "return" (te2 returns its bias), "both"."""

    def __init__(self, config, *, hidden: int, ffn: int, seed: int, fused: bool = False, delay: bool = False,
                 bias: str = "none", ub_bulk_dgrad: bool = False, experts: int = 0):
        super().__init__(config=config)
        torch.manual_seed(seed)
        self.norm = torch.nn.LayerNorm(hidden)
        self.te1 = Linear(hidden, ffn, bias=bias in ("gemm", "both"), parallel_mode="column",
                          fuse_wgrad_accumulation=fused, delay_wgrad_compute=delay, ub_bulk_dgrad=ub_bulk_dgrad)
        self.te2 = Linear(ffn, hidden, bias=bias in ("return", "both"), return_bias=True, parallel_mode="row",
                          fuse_wgrad_accumulation=fused, delay_wgrad_compute=delay, ub_bulk_dgrad=ub_bulk_dgrad)
        self.experts = (TEGroupedMLP(config, num_experts=experts, hidden=hidden, ffn=ffn, fused=fused)
                        if experts else None)
        self.is_first_microbatch = None  # megatron's TE wrappers pass theirs to every TE forward

    def forward(self, x):
        first = self.is_first_microbatch
        out, te2_bias = self.te2(torch.nn.functional.gelu(self.te1(self.norm(x), is_first_microbatch=first)),
                                 is_first_microbatch=first)
        out = x + (out if te2_bias is None else out + te2_bias)
        if self.experts is not None:
            flat = out.reshape(-1, out.shape[-1])
            rows = flat.shape[0]
            n = self.experts.linear_fc1.num_gemms
            splits = [rows // n] * (n - 1) + [rows - rows // n * (n - 1)]
            out = out + self.experts(flat, splits).reshape(out.shape)
        if self.is_first_microbatch:
            self.is_first_microbatch = False
        return out


def set_version(text: str) -> None:
    """Behave like Transformer Engine ``text`` from now on (a rank that imports it as TE)."""
    _STATE["version"] = _parse(text)
