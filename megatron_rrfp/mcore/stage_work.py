"""One stage's F, B and W through megatron-core's own forward_step / backward_step.

Only the *order* and the *communication* change under RRFP — never the math: loss
scaling, per-token loss, MoE aux-loss scaling and the custom backward of deallocated
outputs are megatron-core's.

With ``overlap_moe_expert_parallel_comm`` every F and B goes through megatron-core's combined-1F1B
step instead (its forward builds the schedule plan the backward consumes), and a pair the arbiter
dispatched runs as one such step: one microbatch's forward with another's backward, layer by
layer, each one's all-to-alls on the communication stream beside the other's compute.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch

from ..policy.actions import Task
from ..policy.topology import Topology
from ..ranks import print_line
from . import compat
from .grad_sync import GradSyncController
from .state import ScheduleState


class MicrobatchFeed:
    """Megatron's data iterators are sequential; readiness-first may run microbatch 5's
    forward before 4's. Item k of the underlying iterator belongs to microbatch k: the
    feed reads ahead in order and caches, so every forward sees its own data. Assumes the
    forward step calls ``next()`` at most once per microbatch (as Megatron-LM's do)."""

    def __init__(self, iterator: Optional[Iterator]) -> None:
        self._iterator = iterator
        self._cache: dict[int, Any] = {}
        self._consumed = 0

    def view(self, microbatch: int) -> Optional[Iterator]:
        return None if self._iterator is None else _MicrobatchView(self, microbatch)

    def _item(self, microbatch: int) -> Any:
        while self._consumed <= microbatch:
            self._cache[self._consumed] = next(self._iterator)
            self._consumed += 1
        if microbatch not in self._cache:
            raise RuntimeError(f"the forward step asked for microbatch {microbatch}'s data twice; "
                               "rrfp supports one next(data_iterator) per microbatch")
        return self._cache.pop(microbatch)


class _MicrobatchView:
    def __init__(self, feed: MicrobatchFeed, microbatch: int) -> None:
        self._feed, self._microbatch = feed, microbatch

    def __iter__(self):
        return self

    def __next__(self):
        return self._feed._item(self._microbatch)


# -- Megatron's per-microbatch work ---------------------------------------------------

class MegatronStageWork:
    """F and B of one stage through megatron-core's own forward_step / backward_step."""

    def __init__(self, *, forward_step_func, data_iterators, models, num_microbatches: int, config,
                 topology: Topology, stage: int, cp_size: int, forward_only: bool,
                 collect_non_loss_data: bool, first_val_step, grad_sync: GradSyncController) -> None:
        self.forward_step_func, self.models, self.config = forward_step_func, models, config
        self.feeds = [MicrobatchFeed(it) for it in data_iterators]
        self.num_microbatches, self.topology, self.stage, self.cp_size = num_microbatches, topology, stage, cp_size
        self.forward_only, self.collect_non_loss_data = forward_only, collect_non_loss_data
        self.first_val_step = first_val_step
        self.grad_sync = grad_sync
        self.model_type = compat.model_type(models[0])
        self.saved: dict[tuple[int, int], tuple[list, list]] = {}
        self.wgrad_store = None  # set when the hint splits the backward (BFW), with split_readiness
        self.split_readiness = None
        self.defers_weight: Callable[[Task], bool] = lambda task: True  # the arbiter's (byte budget)
        self.outputs: dict[int, list] = {}
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=compat.pipeline_device())
        self._forwards_run = [0] * len(models)
        # megatron-core's combined-1F1B steps for every F and B (forward-only calls run its plain forward_step,
        # as Megatron's own schedules do)
        self.combined = bool(getattr(config, "overlap_moe_expert_parallel_comm", False)) and not forward_only
        if self.combined:
            compat.set_combined_streams(config)

    def forward(self, task: Task, input_tensor, send) -> None:
        if self.combined:
            self.pair((task, input_tensor, send), None)
            return
        mb, chunk = task.microbatch, task.chunk
        if input_tensor is not None and not self.forward_only:
            input_tensor.requires_grad_()  # its .grad is what backward sends upstream
        inputs = [input_tensor]
        store: list = []
        first = self._forwards_run[chunk] == 0
        self._forwards_run[chunk] += 1
        self.grad_sync.before_forward(chunk, first_of_chunk=first)
        output, num_tokens = compat.forward_step(
            self.forward_step_func, self.feeds[chunk].view(mb), self.models[chunk], self.num_microbatches,
            inputs, store, self.config, cp_group_size=self.cp_size,
            collect_non_loss_data=self.collect_non_loss_data,
            is_first_microbatch=compat.first_val_step(self.first_val_step, self.forward_only, first),
            current_microbatch=mb,
            vp_stage=chunk if self.topology.interleaved else None,
            is_last_stage=self.topology.is_last(self.stage, chunk))
        if store:
            self.outputs[mb] = store
        # As Megatron: a CPU 0-dim count is added as a scalar (no copy, so no sync with the stream)
        self.total_num_tokens += num_tokens
        if send is not None:
            send(output[0])  # the transport keeps its own reference until the send completed
        if not self.forward_only:
            self.saved[(mb, chunk)] = (inputs, output)
            compat.deallocate_output_tensor(output[0], self.config.deallocate_pipeline_outputs)

    def backward(self, task: Task, output_grad, send) -> None:
        if self.combined:
            self.pair(None, (task, output_grad, send))
            return
        inputs, output = self.saved.pop((task.microbatch, task.chunk))
        if self.wgrad_store is not None:  # B of a split backward: input gradients only
            with self._split_backward_half(task):
                input_grad = compat.backward_step(inputs, output, [output_grad], self.model_type, self.config)
            if send is not None:
                send(input_grad[0])
            self.split_readiness.after_backward(task.chunk)  # the chunk's last B: B-computed buckets may reduce
            return
        self.grad_sync.before_backward(task.chunk)  # the chunk's last backward may reduce
        input_grad = compat.backward_step(inputs, output, [output_grad], self.model_type, self.config)
        if send is not None:
            send(input_grad[0])
        self.grad_sync.after_backward(task.chunk)

    def pair(self, forward, backward) -> None:
        """One combined-1F1B step: ``forward`` = (F task, input, send) and ``backward`` = (B task,
        output gradient, send), either None for a half alone. megatron-core's own
        ``combined_forward_backward_step`` runs it; around it only what Megatron's interleaved
        combined path does around its call (grad-sync points, the sends, the output's deallocation).
        With the B/W split the backward half defers its weight gradients as a lone B does (the
        arbiter's ``defers_weight``; inside the step only the backward calls a linear's backward)."""
        f_model = b_model = f_chunk = None
        inputs, store, num_microbatch, first = [None], [], None, False
        b_inputs, b_output, b_grad = None, None, None
        if forward is not None:
            f_task, input_tensor, _ = forward
            f_chunk, num_microbatch, f_model = f_task.chunk, f_task.microbatch, self.models[f_task.chunk]
            if input_tensor is not None:
                input_tensor.requires_grad_()  # its .grad is what the backward sends upstream
            inputs = [input_tensor]
            first = self._forwards_run[f_chunk] == 0
            self._forwards_run[f_chunk] += 1
            self.grad_sync.before_forward(f_chunk, first_of_chunk=first)
        if backward is not None:
            b_task, output_grad, _ = backward
            b_inputs, b_output = self.saved.pop((b_task.microbatch, b_task.chunk))
            b_model, b_grad = self.models[b_task.chunk], [output_grad]
            if self.wgrad_store is None:
                self.grad_sync.before_backward(b_task.chunk)  # the chunk's last backward may reduce
        with self._split_backward_half(None if backward is None else backward[0]):
            output, num_tokens, input_grad = compat.combined_forward_backward_step(
                self.forward_step_func, None if forward is None else self.feeds[f_chunk].view(num_microbatch),
                f_model, self.num_microbatches, inputs, store, b_model, b_inputs, b_output, b_grad, self.config,
                f_model_chunk_id=f_chunk if self.topology.interleaved else None,
                collect_non_loss_data=self.collect_non_loss_data, checkpoint_activations_microbatch=None,
                is_first_microbatch=compat.first_val_step(self.first_val_step, self.forward_only, first),
                current_microbatch=num_microbatch)
        if forward is not None:
            f_task, _, send = forward
            if store:
                self.outputs[f_task.microbatch] = store
            self.total_num_tokens += num_tokens
            if send is not None:
                send(output[0])
            self.saved[(f_task.microbatch, f_task.chunk)] = (inputs, output)
            compat.deallocate_output_tensor(output[0], self.config.deallocate_pipeline_outputs)
        if backward is not None:
            b_task, _, send = backward
            if send is not None:
                send(input_grad[0])
            if self.wgrad_store is None:
                self.grad_sync.after_backward(b_task.chunk)
            else:
                self.split_readiness.after_backward(b_task.chunk)

    def _split_backward_half(self, b_task: Optional[Task]):
        """The deferral of ``b_task``'s weight gradients under the B/W split (none without it)."""
        if b_task is None or self.wgrad_store is None:
            return contextlib.nullcontext()
        return self.wgrad_store.deferring((b_task.microbatch, b_task.chunk), inline=not self.defers_weight(b_task))

    def weight(self, task: Task) -> None:
        """W of a split backward: the deferred weight gradients of one microbatch; the
        chunk's last W lets each bucket reduce as soon as its last weight is done."""
        readiness = self.split_readiness
        self.wgrad_store.run((task.microbatch, task.chunk), after_weight=readiness.weight_done(task.chunk))
        readiness.after_weight_task(task.chunk)

    def losses_in_microbatch_order(self) -> list:
        return [item for mb in sorted(self.outputs) for item in self.outputs[mb]]


def with_combined_steps(options, config, models, forward_step_func, *, forward_only: bool):
    """``options`` (an RRFPConfig) for megatron-core's combined-1F1B steps: with
    ``overlap_moe_expert_parallel_comm`` the arbiter pairs a ready F with a ready B
    (``ArbiterConfig.pair_forward_backward``). The default hint still splits the backward where
    ``with_split_capability`` finds the models' weight gradients deferrable, megatron-core's own
    linears; with Transformer Engine's layers the backward runs whole (says so once): TE's deferral
    inside megatron-core's combined step is not verified. Raises a one-line ValueError where the
    steps cannot run here."""
    if not getattr(config, "overlap_moe_expert_parallel_comm", False) or forward_only:
        return options
    blocker = compat.combined_steps_blocker(config, models, forward_step_func)
    if blocker:
        raise ValueError(f"megatron_rrfp: --overlap-moe-expert-parallel-comm under rrfp: {blocker}")
    arbiter = options.arbiter
    hint = arbiter.parsed_hint
    if hint.name != "default" and hint.split_backward:
        raise ValueError(f"megatron_rrfp: --overlap-moe-expert-parallel-comm under rrfp: hint {hint.name!r} "
                         "(--rrfp-hint) places W tasks by its own order, which is not built for pairs; use --rrfp-hint "
                         "default (it pairs, and splits the backward where it can), bf or 1f1b")
    arbiter = dataclasses.replace(arbiter, pair_forward_backward=True)
    if arbiter.split_backward_ok and _holds_te_layers(models):
        arbiter = dataclasses.replace(arbiter, split_backward_ok=False)
    return dataclasses.replace(options, arbiter=arbiter)


_TE_NOTED: set[int] = set()


def _holds_te_layers(models) -> bool:
    """Transformer Engine layers in ``models``; the first time per model, one line saying what that means."""
    from ..split.te import is_te_module

    if not any(is_te_module(module) for model in models for module in model.modules()):
        return False
    if id(models[0]) not in _TE_NOTED:
        _TE_NOTED.add(id(models[0]))
        print_line("megatron-rrfp: --overlap-moe-expert-parallel-comm with Transformer Engine's layers: pairs run "
                   "each backward whole (TE's weight-gradient deferral inside megatron-core's combined step is not "
                   "verified); megatron-core's own linears keep the B/W split beside the pairs")
    return True


def weight_grad_store(models, memory=None, *, hint: str = ""):
    """BFW: weight gradients are deferred to W tasks. DDP's no_sync stays on through every
    B and W; with overlap_grad_reduce, ``grad_sync.SplitReadiness`` launches each bucket's
    reduction when its last parameter is complete (``attach_split_readiness``).

    Called before the iteration's first task; where the split is impossible (``wgrad.install``
    refuses: its self-check, or a layer it cannot defer) it raises a NotImplementedError that
    names the ``hint`` asking for the split — the same on every rank, before any work."""
    from ..split import megatron_linear as wgrad

    try:
        wgrad.install(models)
    except NotImplementedError as exc:
        if not hint:
            raise
        raise NotImplementedError(
            f"megatron_rrfp: hint {hint!r} (option hint= / --rrfp-hint) splits the backward into B and W, "
            f"which is not possible here: {exc}\nUse --rrfp-hint default (it splits the backward only where "
            "it can and otherwise runs unsplit) or an unsplit hint such as bf or 1f1b.") from exc
    return wgrad.WeightGradStore(memory=memory, models=models)


def with_split_capability(options, models, *, all_stages: Callable[[bool], bool],
                          state: Optional[ScheduleState] = None):
    """``options`` (an RRFPConfig) for these models: the ``default`` hint splits the backward
    only where ``wgrad`` can defer the weight gradients of every stage's model
    (``deferral_blockers``; ``all_stages(ok)`` is a collective AND over the pipeline, run
    once per model and ``state``, the process's ``ScheduleState`` by default, keeps the
    answer); elsewhere it resolves to its unsplit form and a rank that cannot split says why, once."""
    arbiter = options.arbiter
    if arbiter.parsed_hint.name != "default" or not arbiter.split_backward_ok:
        return options
    blocked = (state or ScheduleState.get()).split_blocked
    if models[0] not in blocked:
        from ..split import megatron_linear as wgrad

        blockers = wgrad.deferral_blockers(models)
        if blockers:
            more = f" (+{len(blockers) - 1} more)" if len(blockers) > 1 else ""
            cause = ("with this megatron-core release" if blockers[0] == wgrad.split_self_check()
                     else "for this model")  # the release's own linear failed the self-check, or this model's layers
            print_line(f"megatron-rrfp: the default policy runs without the B/W split {cause}: {blockers[0]}{more}")
        blocked[models[0]] = not all_stages(not blockers)
    if not blocked[models[0]]:
        return options
    return dataclasses.replace(options, arbiter=dataclasses.replace(arbiter, split_backward_ok=False))


def attach_split_readiness(work: MegatronStageWork, *, overlap_allowed: bool, at_last_weight: bool = False) -> None:
    """Overlapped DP reductions for a split backward (grad_sync.SplitReadiness), where
    ``dp_overlap`` allows them inside the task loop; ``at_last_weight``: every bucket at the
    chunk's last W (the epoch rule's DP point), none at its last B."""
    from ..split import megatron_linear as wgrad

    work.split_readiness = work.grad_sync.split_readiness(wgrad.deferred_parameters(work.models),
                                                          overlap_allowed=overlap_allowed,
                                                          at_last_weight=at_last_weight)
