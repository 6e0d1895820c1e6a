"""Megatron-core's schedule contract, run by the readiness-first executor.

``forward_backward_rrfp`` takes exactly the keyword arguments of megatron-core's
``forward_backward_pipelining_without_interleaving`` (plus ``hint=``, ``buffer_limit=``,
``strict=``, ``timeout_s=``) and returns the same thing: the per-microbatch loss dicts on
the last stage, ``[]`` elsewhere. Forward and backward of each microbatch go through
megatron-core's own ``forward_step`` / ``backward_step`` (loss scaling, per-token loss,
MoE aux-loss scaling, custom backward of deallocated outputs), so only the *order* and
the *communication* change — never the math.
"""
from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from . import adapter
from .actions import Task
from .agreement import TPAgreement, create_agreement_groups
from .arbiter import Arbiter, ArbiterConfig
from .executor import Inbox, IterationReport, PipelineIteration
from .grad_sync import GradSyncController
from .topology import Topology

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class RRFPConfig:
    """Options of the readiness-first schedule (Megatron-LM flags in parentheses)."""

    hint: Any = "bf"
    """bf | bfw | 1f1b | gpipe | JSON hint file (--rrfp-hint)."""
    buffer_limit: int = 32
    """Microbatches in flight per stage before backpressure (--rrfp-buffer-limit)."""
    strict: bool = False
    """Run the hint as a fixed order: the baseline in the same runtime (--rrfp-strict)."""
    timeout_s: float = 600.0
    """A rank with no progress for this long raises with a state dump (--rrfp-timeout)."""
    record_spans: bool = False
    """Keep per-task timestamps for traces (--rrfp-trace-dir turns it on)."""
    task_delay: Optional[Callable[[Task], float]] = None
    """Emulated device time per task, seconds slept before it (benchmarks/tests only)."""
    message_delay: Optional[Callable[[Any], float]] = None
    """Extra latency per received message, seconds (benchmarks/tests only)."""

    def __post_init__(self) -> None:
        ArbiterConfig(hint="bf", buffer_limit=self.buffer_limit)  # validates the limit
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s (--rrfp-timeout) must be > 0 seconds, got {self.timeout_s!r}")


_DEFAULT_CONFIG = RRFPConfig()
_last_reports: list[IterationReport] = []


def configure(**options) -> RRFPConfig:
    """Set the process-wide defaults used when Megatron calls the schedule without RRFP
    keywords (the Megatron-LM integration does this from the --rrfp-* flags)."""
    global _DEFAULT_CONFIG
    _DEFAULT_CONFIG = replace(_DEFAULT_CONFIG, **options)
    make_arbiter_config(_DEFAULT_CONFIG)  # fail now on a bad hint, not mid-training
    return _DEFAULT_CONFIG


def make_arbiter_config(config: RRFPConfig) -> ArbiterConfig:
    return ArbiterConfig(hint=config.hint, buffer_limit=config.buffer_limit, strict=config.strict)


def last_iteration_report() -> Optional[IterationReport]:
    """What this rank did in its most recent schedule call (order, timings, spans)."""
    return _last_reports[-1] if _last_reports else None


# -- the persistent per-process runtime: process groups, transport, inbox -------------

class _Runtime:
    def __init__(self, *, pp_ranks: list[int], agree_ranks: list[int], device: torch.device,
                 timeout_s: float) -> None:
        from .transport import StageTransport, create_directed_groups

        timeout = datetime.timedelta(seconds=timeout_s)
        self.key = (tuple(pp_ranks), tuple(agree_ranks), str(device))
        self.pp_ranks, self.device = pp_ranks, device
        # Both are collective over the world: every rank reaches here in its first call.
        self.groups = create_directed_groups(pp_ranks, timeout=timeout, ring=True)
        self.agreement_group = create_agreement_groups(agree_ranks, timeout=timeout)
        self.inbox = Inbox()
        self._transport_cls = StageTransport
        self.transport = None
        self._message_delay = None

    def transport_for(self, message_delay) -> Any:
        """The transport; rebuilt only when message-delay emulation is switched on/off."""
        if self.transport is None or (message_delay is None) != (self._message_delay is None):
            if self.transport is not None:
                self.transport.close()
            self.inbox = Inbox()
            self.transport = self._transport_cls(
                rank=dist.get_rank(), groups=self.groups, device=self.device, on_message=self.inbox.put,
                on_error=self.inbox.fail, name="",
                delay_fn=(lambda m: self._message_delay(m)) if message_delay else None)
        self._message_delay = message_delay
        return self.transport


_RUNTIME: Optional[_Runtime] = None


def _runtime(pp_ranks: list[int], agree_ranks: list[int], device: torch.device, timeout_s: float) -> _Runtime:
    global _RUNTIME
    key = (tuple(pp_ranks), tuple(agree_ranks), str(device))
    if _RUNTIME is None:
        _RUNTIME = _Runtime(pp_ranks=pp_ranks, agree_ranks=agree_ranks, device=device, timeout_s=timeout_s)
    elif _RUNTIME.key != key:
        raise RuntimeError(f"megatron_rrfp: process groups changed between iterations ({_RUNTIME.key} -> {key}); "
                           "call megatron_rrfp.schedule.shutdown() before re-initialising model parallelism")
    return _RUNTIME


def agreement_group():
    """This rank's TP-agreement group (None before the first call or without TP)."""
    return None if _RUNTIME is None else _RUNTIME.agreement_group


def shutdown() -> None:
    """Stop transport threads (tests, or before destroying process groups)."""
    global _RUNTIME
    if _RUNTIME is not None and _RUNTIME.transport is not None:
        _RUNTIME.transport.close()
    _RUNTIME = None


# -- data: each microbatch gets its own item, whatever the execution order ------------

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
        self.model_type = adapter.model_type(models[0])
        self.saved: dict[tuple[int, int], tuple[list, list]] = {}
        self.wgrad_store = None  # set when the hint splits the backward (BFW)
        self.outputs: dict[int, list] = {}
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=adapter.pipeline_device())
        self._forwards_run = [0] * len(models)

    def forward(self, task: Task, input_tensor, send) -> None:
        mb, chunk = task.microbatch, task.chunk
        if input_tensor is not None and not self.forward_only:
            input_tensor.requires_grad_()  # its .grad is what backward sends upstream
        inputs = [input_tensor]
        store: list = []
        first = self._forwards_run[chunk] == 0
        self._forwards_run[chunk] += 1
        self.grad_sync.before_forward(chunk, first_of_chunk=first)
        output, num_tokens = adapter.forward_step(
            self.forward_step_func, self.feeds[chunk].view(mb), self.models[chunk], self.num_microbatches,
            inputs, store, self.config, cp_group_size=self.cp_size,
            collect_non_loss_data=self.collect_non_loss_data,
            is_first_microbatch=adapter.first_val_step(self.first_val_step, self.forward_only, first),
            current_microbatch=mb,
            vp_stage=chunk if self.topology.interleaved else None,
            is_last_stage=self.topology.is_last(self.stage, chunk))
        if store:
            self.outputs[mb] = store
        self.total_num_tokens += num_tokens.to(self.total_num_tokens.device)
        if send is not None:
            send(output[0])  # the transport keeps its own reference until the send completed
        if not self.forward_only:
            self.saved[(mb, chunk)] = (inputs, output)
            adapter.deallocate_output_tensor(output[0], self.config.deallocate_pipeline_outputs)

    def backward(self, task: Task, output_grad, send) -> None:
        inputs, output = self.saved.pop((task.microbatch, task.chunk))
        if self.wgrad_store is not None:  # B of a split backward: input gradients only
            with self.wgrad_store.deferring((task.microbatch, task.chunk)):
                input_grad = adapter.backward_step(inputs, output, [output_grad], self.model_type, self.config)
            if send is not None:
                send(input_grad[0])
            return
        self.grad_sync.before_backward(task.chunk)  # the chunk's last backward may reduce
        input_grad = adapter.backward_step(inputs, output, [output_grad], self.model_type, self.config)
        if send is not None:
            send(input_grad[0])
        self.grad_sync.after_backward(task.chunk)

    def weight(self, task: Task) -> None:
        """W of a split backward: the deferred weight gradients of one microbatch."""
        self.wgrad_store.run((task.microbatch, task.chunk))

    def losses_in_microbatch_order(self) -> list:
        return [item for mb in sorted(self.outputs) for item in self.outputs[mb]]


# -- the schedule function ------------------------------------------------------------

_UNSUPPORTED_FLAGS = {
    "overlap_p2p_comm": "rrfp overlaps communication by design (sender/receiver threads); set overlap_p2p_comm=False",
    "num_microbatches_with_partial_activation_checkpoints":
        "partial activation checkpointing per microbatch assumes 1F1B's order; unset it with rrfp",
}


def _check_supported(config, models) -> None:
    for flag, fix in _UNSUPPORTED_FLAGS.items():
        if flag == "overlap_p2p_comm" and len(models) > 1:
            continue  # Megatron-LM's default for interleaving; RRFP's transport always overlaps
        if getattr(config, flag, None) not in (None, False):
            raise ValueError(f"megatron_rrfp: config.{flag}={getattr(config, flag)!r} is not supported: {fix}")
    if adapter.expert_parallel_size() > 1:
        raise ValueError("megatron_rrfp: expert_model_parallel_size > 1 is not supported yet (expert all-to-alls "
                         "span data-parallel ranks and would need agreement across them); use the 1f1b schedule")


def forward_backward_rrfp(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    seq_length: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    decoder_seq_length: Optional[int] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    adjust_tensor_shapes_fn: Optional[Callable] = None,
    p2p_communicator=None,
    pg_collection=None,
    force_all_reduce: Optional[bool] = False,
    hint=None,
    buffer_limit: Optional[int] = None,
    strict: Optional[bool] = None,
    timeout_s: Optional[float] = None,
    rrfp_config: Optional[RRFPConfig] = None,
    **unused_kwargs,
):
    """Readiness-first drop-in for megatron-core's pipelined forward-backward.

    Tensor shapes travel with every message, so ``seq_length``, ``micro_batch_size``,
    ``decoder_seq_length`` and ``adjust_tensor_shapes_fn`` need not describe them
    (variable sequence lengths work as is); they are accepted for compatibility.
    """
    options = rrfp_config or _DEFAULT_CONFIG
    overrides = {k: v for k, v in dict(hint=hint, buffer_limit=buffer_limit, strict=strict,
                                        timeout_s=timeout_s).items() if v is not None}
    options = replace(options, **overrides) if overrides else options
    models = model if isinstance(model, list) else [model]
    iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator] * len(models)
    config = adapter.get_model_config(models[0])
    _check_supported(config, models)
    groups = adapter.process_groups(pg_collection=pg_collection, p2p_communicator=p2p_communicator)
    pp_ranks = dist.get_process_group_ranks(groups.pp)
    if len(pp_ranks) < 2:
        raise ValueError("megatron_rrfp: the pipeline-parallel size is 1; use Megatron's "
                         "forward_backward_no_pipelining (get_forward_backward_func does this)")
    stage = pp_ranks.index(dist.get_rank())
    topology = Topology(len(pp_ranks), len(models))
    arbiter = Arbiter(make_arbiter_config(options), stage=stage, topology=topology,
                      num_microbatches=num_microbatches, forward_only=forward_only)
    wgrad_store = None
    if arbiter.split_backward:
        wgrad_store = _weight_grad_store(models)
    runtime = _runtime(pp_ranks, groups.agreement_ranks, adapter.pipeline_device(), options.timeout_s)
    transport = runtime.transport_for(options.message_delay)
    agreement = None
    if runtime.agreement_group is not None:
        agreement = TPAgreement(runtime.agreement_group, num_microbatches=num_microbatches,
                                num_chunks=len(models), split_backward=arbiter.split_backward,
                                forward_only=forward_only)

    is_last_stage = stage == len(pp_ranks) - 1
    embedding_module = None
    if config.finalize_model_grads_func is not None and not forward_only:
        embedding_module = adapter.clear_embedding_activation_buffer(config, model, is_last_stage)
    if config.timers is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)

    grad_sync = GradSyncController(config, models, pp_rank=stage, num_microbatches=num_microbatches,
                                   forward_only=forward_only)
    grad_sync.start()
    work = MegatronStageWork(
        forward_step_func=forward_step_func, data_iterators=iterators, models=models,
        num_microbatches=num_microbatches, config=config, topology=topology, stage=stage,
        cp_size=groups.cp.size(), forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
        first_val_step=first_val_step, grad_sync=grad_sync)
    work.wgrad_store = wgrad_store
    iteration = PipelineIteration(
        work=work, arbiter=arbiter, topology=topology, stage=stage, stage_ranks=pp_ranks, transport=transport,
        inbox=runtime.inbox, agreement=agreement, timeout_s=options.timeout_s, forward_only=forward_only,
        record_spans=options.record_spans, task_delay=options.task_delay)
    report = iteration.run()
    if wgrad_store is not None:
        report.peak_deferred_wgrad_bytes = wgrad_store.peak_pending_bytes
    _last_reports[:] = [report]

    grad_sync.finish()
    if config.finalize_model_grads_func is not None and not forward_only:
        adapter.finish_embedding_wgrad_compute(config, embedding_module, is_last_stage, groups.tp)
        adapter.finalize_model_grads(config, models, work.total_num_tokens if config.calculate_per_token_loss else None,
                                     pg_collection=groups.collection, force_all_reduce=force_all_reduce)
    if config.timers is not None:
        config.timers("forward-backward").stop()
    return work.losses_in_microbatch_order()


def _weight_grad_store(models):
    """BFW: weight gradients are deferred to W tasks. Gradient reductions stay off (no_sync)
    through every B and W — the split backward never calls the grad-sync hooks — and run
    after the last W (GradSyncController.finish, then finalize_model_grads), so with
    overlap_grad_reduce the reduction is not overlapped with backward compute."""
    from . import wgrad

    wgrad.install(models)
    return wgrad.WeightGradStore()


def get_forward_backward_func(pp_size: Optional[int] = None, vp_size: Optional[int] = None,
                              schedule_pg_collection=None):
    """megatron-core's ``get_forward_backward_func`` with RRFP for pipelined runs (PP > 1)."""
    if pp_size is None:
        pp_size = adapter.pipeline_parallel_size(schedule_pg_collection)
    if pp_size > 1:
        return forward_backward_rrfp
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    return forward_backward_no_pipelining
