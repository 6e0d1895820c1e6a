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

``param_sync_func`` (distributed-optimizer parameter all-gather, interleaved): chunks 0 and 1
before the first forward, chunk c + 1 (c >= 1) before chunk c's first forward — always
before chunk c + 1 can run its own first forward on this rank.
"""
from __future__ import annotations

import contextlib


def _per_chunk(funcs, count: int):
    if funcs is None or isinstance(funcs, list):
        return funcs
    return [funcs] * count


class GradSyncController:
    def __init__(self, config, models, *, pp_rank: int, num_microbatches: int, forward_only: bool) -> None:
        self.config, self.models, self.pp_rank = config, models, pp_rank
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
        if self._param_sync is not None and self.interleaved:
            for chunk in range(min(2, len(self.models))):
                self._param_sync[chunk](self.models[chunk].parameters())

    def before_forward(self, chunk: int, first_of_chunk: bool) -> None:
        nxt = chunk + 1
        if self._param_sync is not None and first_of_chunk and 1 < nxt < len(self.models):
            self._param_sync[nxt](self.models[nxt].parameters())

    def before_backward(self, chunk: int) -> None:
        self._backwards_left[chunk] -= 1
        if self._backwards_left[chunk]:
            return
        if not self.interleaved:
            if self._grad_sync is None or self.pp_rank == 0:
                self.enable()
        elif self._grad_sync is None:
            self.enable()
            self._synced.add(chunk)

    def after_backward(self, chunk: int) -> None:
        if not self.interleaved:
            return
        if self._grad_sync is not None and self._backwards_left[chunk] == 0:
            self.enable()
            self._grad_sync[chunk](self.models[chunk].parameters())
            self._synced.add(chunk)
        self.disable()

    def finish(self) -> None:
        if self.forward_only:
            self.enable()
            return
        if not self.interleaved:
            if self._context is not None:
                self.enable()
                if self._grad_sync is not None:
                    self._grad_sync[0](self.models[0].parameters())
            return
        self.enable()
        if self._grad_sync is not None:
            for chunk in range(len(self.models)):
                if chunk not in self._synced:
                    self._grad_sync[chunk](self.models[chunk].parameters())
                    self._synced.add(chunk)
