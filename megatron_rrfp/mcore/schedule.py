"""Megatron-core's schedule contract, run by the readiness-first executor.

``forward_backward_rrfp`` takes exactly the keyword arguments of megatron-core's
``forward_backward_pipelining_without_interleaving`` (plus ``hint=``, ``buffer_limit=``,
``strict=``, ``timeout_s=``, ``rrfp_config=``) and returns the same thing: the
per-microbatch loss dicts on the last stage, ``[]`` elsewhere. Each microbatch runs
through megatron-core's own ``forward_step`` / ``backward_step`` (``stage_work.py``).

Every call measures this rank's peak activation memory (runtime/memory.py) and runs with
the buffer limit resolved for its layout (``16``, ``1x``; ``auto``: auto_limit.py); both are
in ``last_iteration_report()`` beside the peak forwards in flight.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.distributed as dist

from ..dist.env import print_line
from ..policy.budget import LimitSpec
from ..policy.plan import Plan
from ..policy.topology import Topology
from ..runtime.agreement import TPAgreement
from ..runtime.executor import IterationReport, PipelineIteration
from ..runtime.memory import ActivationMeter, model_tensors
from . import auto_limit, byte_limit, compat, recovery
from .config import RRFPConfig, defaults
from .dp_overlap import AFTER_LOOP, LOCKSTEP, describe, dp_communication, overlapped_dp_communication_allowed
from .grad_sync import GradSyncController
from .session import session
from .stage_work import MegatronStageWork, attach_split_readiness, weight_grad_store, with_split_capability

_last_reports: list[IterationReport] = []


def last_iteration_report() -> Optional[IterationReport]:
    """What this rank did in its most recent schedule call (order, timings, spans)."""
    return _last_reports[-1] if _last_reports else None


_UNSUPPORTED_FLAGS = {
    "overlap_p2p_comm": "rrfp overlaps communication by design (sender/receiver threads); set overlap_p2p_comm=False",
    "num_microbatches_with_partial_activation_checkpoints":
        "partial activation checkpointing per microbatch assumes 1F1B's order; unset it with rrfp",
}


_UNSUPPORTED_MOE_FLAGS = {
    "overlap_moe_expert_parallel_comm":
        "it is Megatron's combined-1F1B schedule (one microbatch's all-to-alls overlapped with another's "
        "compute inside one step); rrfp runs one task at a time: unset --overlap-moe-expert-parallel-comm",
    "delay_wgrad_compute": "Megatron's MoE wgrad delay belongs to overlap_moe_expert_parallel_comm; rrfp splits the "
                           "backward itself (hint bfw / zbh1 / default): unset --delay-wgrad-compute",
    "moe_shared_expert_overlap": "the shared experts' side stream overlapping the dispatcher's all-to-all is not "
                                 "verified under rrfp: unset --moe-shared-expert-overlap",
}


def _check_supported(config, models) -> None:
    for flag, fix in _UNSUPPORTED_FLAGS.items():
        if flag == "overlap_p2p_comm" and len(models) > 1:
            continue  # Megatron-LM's default for interleaving; RRFP's transport always overlaps
        if getattr(config, flag, None) not in (None, False):
            raise ValueError(f"megatron_rrfp: config.{flag}={getattr(config, flag)!r} is not supported: {fix}")
    if getattr(config, "num_moe_experts", None) is None:
        return
    for flag, fix in _UNSUPPORTED_MOE_FLAGS.items():
        if getattr(config, flag, None) not in (None, False):
            raise ValueError(f"megatron_rrfp: config.{flag}={getattr(config, flag)!r} is not supported with rrfp: "
                             f"{fix}")


@recovery.cleans_up_on_failure
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
    buffer_limit: Optional[LimitSpec] = None,
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
    options = (rrfp_config or defaults()).with_options(hint=hint, buffer_limit=buffer_limit, strict=strict,
                                                       timeout_s=timeout_s)
    models = model if isinstance(model, list) else [model]
    iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator] * len(models)
    config = compat.get_model_config(models[0])
    _check_supported(config, models)
    device = compat.pipeline_device()
    data_parallel_size = compat.data_parallel_size(pg_collection)
    # interleaved DP overlap on CUDA: lock-step (every DP replica of the stage joins the agreement) or the DP
    # communication out of the task loop (dp_overlap.py); the mode of training calls, for forward-only calls
    # too, so evaluation does not rebuild the session's groups each time
    dp_mode = dp_communication(models, device_type=device.type, data_parallel_size=data_parallel_size,
                               choice=options.dp_overlap)
    _say_dp_mode_once(dp_mode, options.dp_overlap, models, data_parallel_size)
    dp_whole_stage = dp_mode == LOCKSTEP
    groups = compat.process_groups(pg_collection=pg_collection, p2p_communicator=p2p_communicator,
                                   whole_stage=compat.reduces_over_data_parallel(config) or dp_whole_stage)
    pp_ranks = dist.get_process_group_ranks(groups.pp)
    if len(pp_ranks) < 2:
        raise ValueError("megatron_rrfp: the pipeline-parallel size is 1; use Megatron's "
                         "forward_backward_no_pipelining (get_forward_backward_func does this)")
    stage = pp_ranks.index(dist.get_rank())
    topology = Topology(len(pp_ranks), len(models))
    runtime = session(pp_ranks, groups.agreement_ranks, device, options.timeout_s, options.transport)
    options = with_split_capability(options, models, all_stages=lambda ok: _all_true(ok, groups.pp, device))
    limit = auto_limit.call_limit(
        options, models=models, topology=topology, num_microbatches=num_microbatches, stage=stage,
        forward_only=forward_only, device=device, pp_group=groups.pp, agreement_group=runtime.agreement_group)
    in_bytes = byte_limit.call_bytes(
        limit.arbiter, models=models, topology=topology, num_microbatches=num_microbatches, stage=stage,
        forward_only=forward_only, device=device, pp_group=groups.pp, agreement_group=runtime.agreement_group)
    plan = Plan.build(in_bytes.arbiter, topology, num_microbatches)
    arbiter = plan.arbiter(stage, forward_only=forward_only)
    meter = ActivationMeter(device, persistent=model_tensors(models) if device.type == "cpu" else ())
    wgrad_store = weight_grad_store(models, meter, hint=options.arbiter.parsed_hint.name) \
        if arbiter.split_backward else None
    agreement = None
    if runtime.agreement_group is not None:
        agreement = TPAgreement(runtime.agreement_group, num_microbatches=num_microbatches,
                                num_chunks=len(models), split_backward=arbiter.split_backward,
                                forward_only=forward_only, device=runtime.device)

    is_last_stage = stage == len(pp_ranks) - 1
    embedding_module = None
    if config.finalize_model_grads_func is not None and not forward_only:
        embedding_module = compat.clear_embedding_activation_buffer(config, model, is_last_stage)
    if config.timers is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)

    with meter:
        grad_sync = GradSyncController(config, models, pp_rank=stage, num_microbatches=num_microbatches,
                                       forward_only=forward_only, in_loop=dp_mode != AFTER_LOOP)
        recovery.track(config, grad_sync)  # from here on a failure leaves the runtime unusable: clean up
        grad_sync.start()
        work = MegatronStageWork(
            forward_step_func=forward_step_func, data_iterators=iterators, models=models,
            num_microbatches=num_microbatches, config=config, topology=topology, stage=stage,
            cp_size=groups.cp.size(), forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
            first_val_step=first_val_step, grad_sync=grad_sync)
        work.wgrad_store = wgrad_store
        work.defers_weight = arbiter.defers_weight  # a B whose stash the byte budget has no room for runs unsplit
        if wgrad_store is not None:
            attach_split_readiness(work, overlap_allowed=dp_mode != AFTER_LOOP and overlapped_dp_communication_allowed(
                device_type=device.type, data_parallel_size=data_parallel_size, interleaved=len(models) > 1,
                whole_stage=dp_whole_stage))
        iteration = PipelineIteration(
            work=work, arbiter=arbiter, topology=topology, stage=stage, stage_ranks=pp_ranks,
            transport=runtime.transport, inbox=runtime.inbox, agreement=agreement, timeout_s=options.timeout_s,
            forward_only=forward_only, record_spans=options.record_spans, memory=meter,
            measure_task_bytes=in_bytes.calibrating, around_task=options.around_task,
            deliver_message=options.deliver_message)
        report = iteration.run()
        if wgrad_store is not None:
            report.peak_deferred_wgrad_bytes = wgrad_store.peak_pending_bytes
        _last_reports[:] = [report]

        grad_sync.finish()
        if config.finalize_model_grads_func is not None and not forward_only:
            compat.finish_embedding_wgrad_compute(config, embedding_module, is_last_stage, groups.tp)
            compat.finalize_model_grads(config, models,
                                         work.total_num_tokens if config.calculate_per_token_loss else None,
                                         pg_collection=groups.collection, force_all_reduce=force_all_reduce)
    report.peak_activation_bytes, report.activation_measure = meter.peak_bytes, meter.method
    report.buffer_limit = 0 if forward_only or options.arbiter.strict else arbiter.buffer_limit
    report.byte_budget = arbiter.byte_budget
    if arbiter.stage_bytes is not None:  # what a simulation of this call needs (bench/summary.py)
        b = arbiter.stage_bytes
        report.byte_weights = (b.stage.forward, b.stage.forward_peak, b.stage.pending, b.stage.split_peak, b.admit,
                               b.split)
    limit.record(report.peak_activation_bytes, report.peak_in_flight)
    in_bytes.record(report, wgrad_store)
    if config.timers is not None:
        config.timers("forward-backward").stop()
    return work.losses_in_microbatch_order()


_DP_MODE_SAID: set = set()


def _say_dp_mode_once(mode: str, choice: str, models, data_parallel_size: int) -> None:
    """Rank 0 names the choice once per model (it changes where DP time is spent)."""
    if mode in (LOCKSTEP, AFTER_LOOP) and id(models[0]) not in _DP_MODE_SAID:
        _DP_MODE_SAID.add(id(models[0]))
        if dist.get_rank() == 0:
            print_line(describe(mode, choice, models, data_parallel_size))


def _all_true(value: bool, group, device) -> bool:
    """Collective over ``group``: ``value`` on every rank."""
    flag = torch.tensor([int(value)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def get_forward_backward_func(pp_size: Optional[int] = None, vp_size: Optional[int] = None,
                              schedule_pg_collection=None):
    """megatron-core's ``get_forward_backward_func`` with RRFP for pipelined runs (PP > 1)."""
    if pp_size is None:
        pp_size = compat.pipeline_parallel_size(schedule_pg_collection)
    if pp_size > 1:
        return forward_backward_rrfp
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    return forward_backward_no_pipelining


__all__ = ["forward_backward_rrfp", "get_forward_backward_func", "last_iteration_report"]
