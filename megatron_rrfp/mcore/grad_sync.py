"""When gradient reductions may run: Megatron's contract, for any execution order.

Megatron keeps reductions off (``config.no_sync_func``) until a model chunk's *last* backward
of the iteration, so DDP's hooks launch bucket reductions while that backward still computes.
Readiness-first changes *which* backward is last, not the rule, so the rule is applied here to
"the last backward of chunk c", counted as tasks run. Under the B/W split ``SplitReadiness``
does DDP's readiness counting instead (a weight's gradient is complete only after its W);
``param_sync_func`` all-gathers run before each chunk's first forward; outside the loop
(``in_loop=False``, ``dp_overlap``'s after-loop choice) all-gathers complete before the first
task and reductions launch after the last; ``after_loop_chunks`` does that for the reductions of
some chunks only, ``gathers_before`` launches every chunk's all-gathers before the first task
without waiting for them (the DP epoch rule's variants). Why each step is safe and in the same
order on every DP replica: docs/design/grad-sync.md.
"""
from __future__ import annotations

import contextlib


def _per_chunk(funcs, count: int):
    if funcs is None or isinstance(funcs, list):
        return funcs
    return [funcs] * count


class GradSyncController:
    def __init__(self, config, models, *, pp_rank: int, num_microbatches: int, forward_only: bool,
                 in_loop: bool = True, after_loop_chunks: frozenset = frozenset(),
                 gathers_before: bool = False) -> None:
        self.config, self.models, self.pp_rank = config, models, pp_rank
        self.in_loop = in_loop or forward_only
        self.after_loop_chunks = frozenset() if forward_only else frozenset(after_loop_chunks)
        self.gathers_before = gathers_before
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
            for chunk in range(len(self.models) if self.gathers_before else min(2, len(self.models))):
                self._param_sync[chunk](self.models[chunk].parameters())

    def before_forward(self, chunk: int, first_of_chunk: bool) -> None:
        nxt = chunk + 1
        if (self.in_loop and not self.gathers_before and self._param_sync is not None and first_of_chunk
                and 1 < nxt < len(self.models)):
            self._param_sync[nxt](self.models[nxt].parameters())

    def before_backward(self, chunk: int) -> None:
        self._backwards_left[chunk] -= 1
        if self._backwards_left[chunk] or not self.in_loop or chunk in self.after_loop_chunks:
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
        if self._grad_sync is not None and self._backwards_left[chunk] == 0 and chunk not in self.after_loop_chunks:
            self.enable()
            self._grad_sync[chunk](self.models[chunk].parameters())
            self._synced.add(chunk)
        self.disable()

    def reduces_during_backward(self, chunk: int) -> bool:
        """Megatron's contract: chunk's reductions launch during (or right after) its last
        backward — not interleaved: without grad_sync_func or on pipeline rank 0; interleaved: always."""
        during = self.interleaved or self._grad_sync is None or self.pp_rank == 0
        return during and chunk not in self.after_loop_chunks

    def split_readiness(self, deferred: set, *, overlap_allowed: bool = True,
                        at_last_weight: bool = False) -> SplitReadiness:
        """Readiness counting for a split backward; ``deferred``: parameters W completes.
        Without ``overlap_allowed`` (``dp_overlap``) nothing launches inside the task loop:
        ``finish`` launches every reduction after the last W. ``at_last_weight``: the
        parameters B completes count as ready at the chunk's last W, not its last B."""
        return SplitReadiness(self, deferred, overlap_allowed=overlap_allowed, at_last_weight=at_last_weight)

    def finish(self) -> None:
        if self.forward_only:
            self.enable()
            return
        if not self.in_loop:
            self.enable()
            self._launch_after_loop(range(len(self.models)))
            return
        if not self.interleaved:
            if self._context is not None:
                self.enable()
                if self._grad_sync is not None and 0 not in self._synced:
                    self._grad_sync[0](self.models[0].parameters())
            return
        self.enable()
        self._launch_after_loop(sorted(self.after_loop_chunks - self._synced))
        if self._grad_sync is not None:
            for chunk in range(len(self.models)):
                if chunk not in self._synced:
                    self._grad_sync[chunk](self.models[chunk].parameters())
                    self._synced.add(chunk)

    def _launch_after_loop(self, chunks) -> None:
        """The reductions of ``chunks`` after the last task, in chunk order on every replica."""
        for chunk in chunks:
            model = self.models[chunk]
            if self._grad_sync is not None:
                self._grad_sync[chunk](model.parameters())
            elif getattr(getattr(model, "ddp_config", None), "overlap_grad_reduce", False):
                model.start_grad_sync()  # finalize_model_grads' finish_grad_sync waits for it
            self._synced.add(chunk)


class SplitReadiness:
    """DDP readiness under the B/W split (module docstring): ``after_backward(c)`` after each
    B, ``weight_done(c)`` (a per-weight callback, or None) for the W about to run and
    ``after_weight_task(c)`` after it."""

    def __init__(self, controller: GradSyncController, deferred: set, *, overlap_allowed: bool = True,
                 at_last_weight: bool = False) -> None:
        self._controller = controller
        self._at_last_weight = at_last_weight
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
        if self._b_left[chunk] == 0 and self._chunks[chunk] is not None and not self._at_last_weight:
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
            for param in self._chunks[chunk][1] if self._at_last_weight else ():
                self._ready(chunk, param)
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
