"""When gradient reductions may run: Megatron's contract, for any execution order.

Megatron keeps reductions off (``config.no_sync_func``, one per chunk when interleaved)
until a model chunk's *last* backward of the iteration, so DDP's hooks launch bucket
reductions while that backward still computes; ``config.grad_sync_func`` (one per chunk)
is an explicit alternative. Readiness-first changes *which* backward is last, not the
rule, so the rule is stated here in terms of "the last backward of chunk c", counted as
tasks run:

* non-interleaved (exactly megatron-core's semantics): enable before the last backward if
  there is no grad_sync_func or this is pipeline rank 0; at the end, if still disabled,
  enable and call grad_sync_func;
* interleaved: without grad_sync_func, enable for each chunk's last backward and disable
  again afterwards; with it, call grad_sync_func[c] right after chunk c's last backward;
  at the end, enable and sync every chunk not yet synced.

Split backward (B now, W later): no_sync stays on over every B and W (DDP's own hook would
count readiness too early from B and never for what B computes, see wgrad.py), and
``SplitReadiness`` does DDP's counting instead: each parameter is registered ready once per
iteration, when its gradient is complete — after the chunk's last W for what W computes
(weight by weight inside that W), after the chunk's last B for everything else — so a bucket
launches its reduction as soon as its last parameter is done, with DDP's golden counts
(recorded in the first iteration, as Megatron's) exact. It applies where Megatron's contract
reduces during the backward (``reduces_during_backward``); elsewhere the end does, as before.
Launch order across DP ranks: a chunk's last W runs after its last B (W follows B per
microbatch and the policy runs W in B order), and inside a W the weights complete in a fixed
order, so every DP replica of a stage launches the same buckets in the same order whatever
the timing (runtime/rounds.py's argument, extended there).

Why no reduction can start before a chunk's last W under megatron's bucket layout (so none is
tried): DDP buckets only pipeline rank 0 (``pp_rank > 0`` gets one bucket per chunk) and
Megatron-LM only chunk 0 there, and every bucket mixes W-computed weights with B-only
parameters (biases, norms), so a bucket is complete only once its chunk's last W has computed
its weights. Reordering the Ws cannot help: on stage 0, the one stage with several buckets and
the one whose reductions end the iteration, the default policy runs a single W of each chunk
after the chunk's last B (``scripts/dp_overlap_figures.py`` prints the count), and inside that W
the weights complete in B's order (last layers first, the order of DDP's buckets), each bucket
launching as its last weight is done. B-only parameters in buckets of their own would launch
after the last B; the simulator puts that at 0.02-0.15 f0 per iteration
(docs/production-configurations.md), and it needs a different bucket layout (megatron-core
>= 0.19 takes one, ``full_param_layout``; 0.16 does not).

``param_sync_func`` (distributed-optimizer parameter all-gather, interleaved): chunks 0 and 1
before the first forward, chunk c + 1 (c >= 1) before chunk c's first forward — always
before chunk c + 1 can run its own first forward on this rank.

Outside the loop (``in_loop=False``, ``dp_overlap``'s after-loop choice): every chunk's
all-gathers complete before the first task (``start_param_sync(force_sync=True)``, so DDP's
forward pre-hooks find them done and issue none), no_sync stays on for every backward, and
every chunk's reductions launch after the last task, chunk by chunk in bucket order
(``grad_sync_func``, else DDP's ``start_grad_sync``; ``finalize_model_grads`` waits for them) —
the same positions on every DP replica whatever order each ran its tasks in.
"""
from __future__ import annotations

import contextlib


def _per_chunk(funcs, count: int):
    if funcs is None or isinstance(funcs, list):
        return funcs
    return [funcs] * count


class GradSyncController:
    def __init__(self, config, models, *, pp_rank: int, num_microbatches: int, forward_only: bool,
                 in_loop: bool = True) -> None:
        self.config, self.models, self.pp_rank = config, models, pp_rank
        self.in_loop = in_loop or forward_only
        self.interleaved = len(models) > 1
        self.forward_only = forward_only
        no_sync = config.no_sync_func
        if isinstance(no_sync, list):
            def no_sync_all():
                stack = contextlib.ExitStack()
                for chunk_no_sync in no_sync:
                    stack.enter_context(chunk_no_sync())
                return stack
            self._no_sync = no_sync_all
        else:
            self._no_sync = no_sync or contextlib.nullcontext
        self._grad_sync = None if forward_only else _per_chunk(config.grad_sync_func, len(models))
        self._param_sync = None if forward_only else _per_chunk(config.param_sync_func, len(models))
        self.num_microbatches = num_microbatches
        self._backwards_left = [num_microbatches] * len(models)
        self._synced: set[int] = set()
        self._context = None

    # -- the no_sync context ---------------------------------------------------------

    def disable(self) -> None:
        if self._context is None:
            self._context = self._no_sync()
            self._context.__enter__()

    def enable(self) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None

    # -- hooks around tasks ----------------------------------------------------------

    def start(self) -> None:
        self.disable()
        if not self.in_loop:
            for model in self.models:
                if getattr(getattr(model, "ddp_config", None), "overlap_param_gather", False):
                    model.start_param_sync(force_sync=True)
            return
        if self._param_sync is not None and self.interleaved:
            for chunk in range(min(2, len(self.models))):
                self._param_sync[chunk](self.models[chunk].parameters())

    def before_forward(self, chunk: int, first_of_chunk: bool) -> None:
        nxt = chunk + 1
        if self.in_loop and self._param_sync is not None and first_of_chunk and 1 < nxt < len(self.models):
            self._param_sync[nxt](self.models[nxt].parameters())

    def before_backward(self, chunk: int) -> None:
        self._backwards_left[chunk] -= 1
        if self._backwards_left[chunk] or not self.in_loop:
            return
        if not self.interleaved:
            if self._grad_sync is None or self.pp_rank == 0:
                self.enable()
        elif self._grad_sync is None:
            self.enable()
            self._synced.add(chunk)

    def after_backward(self, chunk: int) -> None:
        if not self.interleaved or not self.in_loop:
            return
        if self._grad_sync is not None and self._backwards_left[chunk] == 0:
            self.enable()
            self._grad_sync[chunk](self.models[chunk].parameters())
            self._synced.add(chunk)
        self.disable()

    def reduces_during_backward(self, chunk: int) -> bool:
        """Megatron's contract: chunk's reductions launch during (or right after) its last
        backward — not interleaved: without grad_sync_func or on pipeline rank 0; interleaved: always."""
        return self.interleaved or self._grad_sync is None or self.pp_rank == 0

    def split_readiness(self, deferred: set, *, overlap_allowed: bool = True) -> SplitReadiness:
        """Readiness counting for a split backward; ``deferred``: parameters W completes.
        Without ``overlap_allowed`` (``dp_overlap``) nothing launches inside the task loop:
        ``finish`` launches every reduction after the last W."""
        return SplitReadiness(self, deferred, overlap_allowed=overlap_allowed)

    def finish(self) -> None:
        if self.forward_only:
            self.enable()
            return
        if not self.in_loop:
            self.enable()
            for chunk, model in enumerate(self.models):
                if self._grad_sync is not None:
                    self._grad_sync[chunk](model.parameters())
                elif getattr(getattr(model, "ddp_config", None), "overlap_grad_reduce", False):
                    model.start_grad_sync()  # finalize_model_grads' finish_grad_sync waits for it
                self._synced.add(chunk)
            return
        if not self.interleaved:
            if self._context is not None:
                self.enable()
                if self._grad_sync is not None and 0 not in self._synced:
                    self._grad_sync[0](self.models[0].parameters())
            return
        self.enable()
        if self._grad_sync is not None:
            for chunk in range(len(self.models)):
                if chunk not in self._synced:
                    self._grad_sync[chunk](self.models[chunk].parameters())
                    self._synced.add(chunk)


class SplitReadiness:
    """DDP readiness under the B/W split (module docstring): ``after_backward(c)`` after each
    B, ``weight_done(c)`` (a per-weight callback, or None) for the W about to run and
    ``after_weight_task(c)`` after it."""

    def __init__(self, controller: GradSyncController, deferred: set, *, overlap_allowed: bool = True) -> None:
        self._controller = controller
        m = controller.num_microbatches
        self._b_left = [m] * len(controller.models)
        self._w_left = [m] * len(controller.models)
        self._done: set = set()
        self._chunks = []  # per chunk: (ddp, params B completes, params W completes) or None
        for chunk, model in enumerate(controller.models):
            ddp = model if hasattr(model, "param_to_bucket_group") and hasattr(model, "ddp_config") else None
            if (ddp is None or not ddp.ddp_config.overlap_grad_reduce or controller.forward_only
                    or not overlap_allowed or not controller.reduces_during_backward(chunk)):
                self._chunks.append(None)
                continue
            params = list(ddp.param_to_bucket_group)
            self._chunks.append((ddp, [p for p in params if p not in deferred], [p for p in params if p in deferred]))

    def after_backward(self, chunk: int) -> None:
        self._b_left[chunk] -= 1
        if self._b_left[chunk] == 0 and self._chunks[chunk] is not None:
            for param in self._chunks[chunk][1]:
                self._ready(chunk, param)

    def weight_done(self, chunk: int):
        """The callback for the chunk's last W (its weights complete one by one), else None."""
        if self._chunks[chunk] is None or self._w_left[chunk] != 1:
            return None
        return lambda param: self._ready(chunk, param)

    def after_weight_task(self, chunk: int) -> None:
        self._w_left[chunk] -= 1
        if self._w_left[chunk] == 0 and self._chunks[chunk] is not None:
            for param in self._chunks[chunk][2]:
                self._ready(chunk, param)

    def _ready(self, chunk: int, param) -> None:
        ddp = self._chunks[chunk][0]
        bucket_group = ddp.param_to_bucket_group.get(param)
        if bucket_group is None or param in self._done:
            return
        self._done.add(param)
        # DDP counts only while sync is on; it stays off for its autograd hooks (B, W).
        was, bucket_group.is_last_microbatch = bucket_group.is_last_microbatch, True
        try:
            bucket_group.register_grad_ready(param, getattr(ddp, "force_all_reduce", False))
        finally:
            bucket_group.is_last_microbatch = was
        self._controller._synced.add(chunk)  # the end must not launch this chunk's reductions again
