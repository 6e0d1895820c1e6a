"""One schedule call, built then run: what ``forward_backward_rrfp`` does, in three steps.

``build_call`` turns megatron-core's schedule arguments, the options and the process's
``ScheduleState`` (mcore/state.py) into a ``ScheduleCall`` — every decision of the call made
before any rank starts work: where this rank sits (``Placement``: stage, layout, groups,
DP-communication mode), the session, the policy (buffer-limit calibrations, plan, arbiter)
and the parts the iteration needs (activation meter, weight-gradient store, TP agreement).
A refusal (an unsupported flag, PP = 1) raises here and leaves nothing to undo.

``run()`` runs this rank's readiness-first task loop through megatron-core's own forward
and backward steps; ``finish()`` finishes gradient synchronisation and
``finalize_model_grads``, records what the calibrations measured and returns the losses;
``abandon()`` cleans up after a failure in either (mcore/recovery.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..policy.arbiter import Arbiter
from ..policy.epochs import EpochBook, EpochVariant, Timeline, timeline_for
from ..policy.plan import Plan
from ..policy.topology import Topology
from ..ranks import print_line
from ..runtime.agreement import TPAgreement
from ..runtime.executor import IterationReport, PipelineIteration
from ..runtime.memory import ActivationMeter, model_tensors
from . import auto_limit, byte_limit, compat, epoch_tuning, recovery
from .config import RRFPConfig
from .dp_overlap import AFTER_LOOP, EPOCHS, LOCKSTEP, describe, dp_communication, overlapped_dp_communication_allowed
from .grad_sync import GradSyncController
from .session import Session, session
from .stage_work import (
    MegatronStageWork,
    attach_split_readiness,
    weight_grad_store,
    with_combined_steps,
    with_split_capability,
)
from .state import ScheduleState, epoch_variant_key

_UNSUPPORTED_FLAGS = {
    "overlap_p2p_comm": "rrfp overlaps communication by design (sender/receiver threads); set overlap_p2p_comm=False",
    "num_microbatches_with_partial_activation_checkpoints":
        "partial activation checkpointing per microbatch assumes 1F1B's order; unset it with rrfp",
}

_UNSUPPORTED_MOE_FLAGS = {
    "moe_shared_expert_overlap": "the shared experts' side stream overlapping the dispatcher's all-to-all is not "
                                 "verified under rrfp: unset --moe-shared-expert-overlap",
}


@dataclass(frozen=True, slots=True)
class Inputs:
    """What megatron-core's schedule call hands over, lists made of single models / iterators."""

    forward_step_func: Any
    models: list
    iterators: list
    num_microbatches: int
    forward_only: bool
    collect_non_loss_data: bool
    first_val_step: Optional[bool]
    force_all_reduce: Optional[bool]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where this rank's stage sits, and where its data-parallel communication runs."""

    config: Any  # the models' TransformerConfig
    device: torch.device
    groups: compat.ScheduleGroups
    pp_ranks: list[int]
    stage: int
    topology: Topology
    data_parallel_size: int
    dp_mode: str  # dp_overlap.py: in the loop, EPOCHS, LOCKSTEP or AFTER_LOOP

    @property
    def is_last_stage(self) -> bool:
        return self.stage == len(self.pp_ranks) - 1


@dataclass(kw_only=True, slots=True, eq=False)
class ScheduleCall:
    """One schedule call on this rank: built by ``build_call``, then ``run()``, ``finish()``."""

    state: ScheduleState
    options: RRFPConfig
    inputs: Inputs
    place: Placement
    session: Session
    limit: auto_limit.CallLimit
    in_bytes: byte_limit.CallBytes
    arbiter: Arbiter
    meter: ActivationMeter
    wgrad_store: Any  # split/store.py's WeightGradStore when this call splits backwards, else None
    agreement: Optional[TPAgreement]
    grad_sync: Optional[GradSyncController] = None
    work: Optional[MegatronStageWork] = None
    report: Optional[IterationReport] = None
    measuring: bool = False  # epoch_tuning's measuring call: the DP collectives out of the loop, timed
    variant: Optional[EpochVariant] = None  # the job's variant of the DP epoch rule, where it runs
    trial: Optional[epoch_tuning.Trial] = None  # epoch_tuning's trial, which times this call
    _gather_s: float = 0.0
    _began: float = 0.0
    _embedding: Any = None
    _open: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def run(self) -> IterationReport:
        """This rank's task loop, measured by the activation meter; sets ``report``."""
        config, place, inputs = self.place.config, self.place, self.inputs
        training_finalizes = config.finalize_model_grads_func is not None and not inputs.forward_only
        if training_finalizes:
            self._embedding = compat.clear_embedding_activation_buffer(config, inputs.models, place.is_last_stage)
        if config.timers is not None:
            config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
        timeline = self._epoch_timeline()  # made once per variant: not timed
        if self.trial is not None:
            self._began = epoch_tuning.clock(place.device)
        self._open.enter_context(self.meter)
        # a variant with no DP point left runs no book: plain rounds, its DP collectives outside the loop
        book = EpochBook(timeline, place.topology, place.stage) if timeline is not None and timeline.points else None
        self.grad_sync = GradSyncController(config, inputs.models, pp_rank=place.stage,
                                            num_microbatches=inputs.num_microbatches,
                                            forward_only=inputs.forward_only, in_loop=place.dp_mode != AFTER_LOOP,
                                            after_loop_chunks=timeline.deferred if timeline else frozenset(),
                                            gathers_before=timeline is not None and timeline.gathers_before)
        if self.measuring:
            self._gather_s = epoch_tuning.timed(place.device, self.grad_sync.start)
        else:
            self.grad_sync.start()
        self.work = self._stage_work()
        iteration = PipelineIteration(
            work=self.work, arbiter=self.arbiter, topology=place.topology, stage=place.stage,
            stage_ranks=place.pp_ranks, transport=self.session.transport, inbox=self.session.inbox,
            agreement=self.agreement, timeout_s=self.options.timeout_s, forward_only=inputs.forward_only,
            record_spans=self.options.record_spans or self.measuring, memory=self.meter,
            measure_task_bytes=self.in_bytes.calibrating,
            around_task=self.options.around_task, deliver_message=self.options.deliver_message,
            epochs=book)
        self.report = iteration.run()
        if self.wgrad_store is not None:
            self.report.peak_deferred_wgrad_bytes = self.wgrad_store.peak_pending_bytes
        self.state.last_report = self.report
        return self.report

    def finish(self) -> list:
        """Gradient sync and ``finalize_model_grads`` done, the measurements recorded; the
        losses in microbatch order on the last stage (``[]`` elsewhere), as megatron-core's."""
        config, inputs, report, arbiter = self.place.config, self.inputs, self.report, self.arbiter
        if self.measuring:
            reduce_s = epoch_tuning.timed(self.place.device, self._sync_and_finalize)
            epoch_tuning.record(self.state, epoch_variant_key(inputs.models, self.place.topology,
                                                              inputs.num_microbatches),
                                report, inputs.models, gather_s=self._gather_s, reduce_s=reduce_s)
            if not self.options.record_spans:
                report.spans = []
        else:
            self._sync_and_finalize()
        if self.trial is not None:
            self.trial.seconds.append(epoch_tuning.clock(self.place.device) - self._began)
        self._open.close()  # the meter's peak is final
        report.peak_activation_bytes, report.activation_measure = self.meter.peak_bytes, self.meter.method
        report.buffer_limit = 0 if inputs.forward_only or self.options.arbiter.strict else arbiter.buffer_limit
        report.byte_budget = arbiter.byte_budget
        if arbiter.stage_bytes is not None:  # what a simulation of this call needs (bench/summary.py)
            b = arbiter.stage_bytes
            report.byte_weights = (b.stage.forward, b.stage.forward_peak, b.stage.pending, b.stage.split_peak,
                                   b.admit, b.split)
        self.limit.record(report.peak_activation_bytes, report.peak_in_flight)
        self.in_bytes.record(report, self.wgrad_store)
        if config.timers is not None:
            config.timers("forward-backward").stop()
        return self.work.losses_in_microbatch_order()

    def _sync_and_finalize(self) -> None:
        config, inputs = self.place.config, self.inputs
        self.grad_sync.finish()
        if config.finalize_model_grads_func is not None and not inputs.forward_only:
            compat.finish_embedding_wgrad_compute(config, self._embedding, self.place.is_last_stage,
                                                  self.place.groups.tp)
            compat.finalize_model_grads(config, inputs.models,
                                         self.work.total_num_tokens if config.calculate_per_token_loss else None,
                                         pg_collection=self.place.groups.collection,
                                         force_all_reduce=inputs.force_all_reduce)

    def abandon(self) -> None:
        """After a failure in ``run()`` or ``finish()``: the meter closed, ``no_sync`` exited,
        the schedule's timers stopped, the session discarded (mcore/recovery.py)."""
        self._open.close()
        recovery.after_failure(self.place.config, self.grad_sync, self.state)

    def _epoch_timeline(self) -> Optional[Timeline]:
        """The static timeline of the DP epoch rule's variant for this call (dp_overlap.py's ``EPOCHS``), or None."""
        if self.variant is None:
            return None
        return timeline_for(self.options.arbiter, self.place.topology, self.inputs.num_microbatches,
                            self.arbiter.split_backward, self.variant)

    def _stage_work(self) -> MegatronStageWork:
        place, inputs = self.place, self.inputs
        work = MegatronStageWork(
            forward_step_func=inputs.forward_step_func, data_iterators=inputs.iterators, models=inputs.models,
            num_microbatches=inputs.num_microbatches, config=place.config, topology=place.topology,
            stage=place.stage, cp_size=place.groups.cp.size(), forward_only=inputs.forward_only,
            collect_non_loss_data=inputs.collect_non_loss_data, first_val_step=inputs.first_val_step,
            grad_sync=self.grad_sync)
        work.wgrad_store = self.wgrad_store
        work.defers_weight = self.arbiter.defers_weight  # a B whose stash the byte budget has no room for runs unsplit
        if self.wgrad_store is not None:
            overlap = place.dp_mode != AFTER_LOOP and overlapped_dp_communication_allowed(
                device_type=place.device.type, data_parallel_size=place.data_parallel_size,
                interleaved=place.topology.interleaved, whole_stage=place.dp_mode in (LOCKSTEP, EPOCHS))
            # under the epoch rule a chunk's reductions all launch at its DP point, its last W
            attach_split_readiness(work, overlap_allowed=overlap, at_last_weight=place.dp_mode == EPOCHS)
        return work


def build_call(state: ScheduleState, options: RRFPConfig, inputs: Inputs, *, pg_collection=None,
               p2p_communicator=None) -> ScheduleCall:
    """Every decision of one schedule call, in the order every rank makes it (collectives:
    the session's groups, the split capability, the calibrations' agreements)."""
    place = _placement(state, options, inputs.models, pg_collection=pg_collection, p2p_communicator=p2p_communicator)
    runtime = session(place.pp_ranks, place.groups.agreement_ranks, place.device, options.timeout_s,
                      _transport_for(options, place.dp_mode), state=state)
    options = with_combined_steps(options, place.config, inputs.models, inputs.forward_step_func,
                                  forward_only=inputs.forward_only)  # pairs F and B
    options = with_split_capability(options, inputs.models, state=state,
                                    all_stages=lambda ok: _all_true(ok, place.groups.pp, place.device))
    measuring, variant, trial = False, None, None
    if place.dp_mode == EPOCHS and not inputs.forward_only:  # which of the rule's variants (epoch_tuning.py)
        job = epoch_variant_key(inputs.models, place.topology, inputs.num_microbatches)
        step = epoch_tuning.phase(state, job)
        if step == "choose":
            epoch_tuning.choose(state, job, options.arbiter, place.topology, inputs.num_microbatches, place.device,
                                place.data_parallel_size)
        elif step == "decide":
            epoch_tuning.decide(state, job, place.device)
        measuring = step == "measure"
        if measuring:  # safe on the rounds transport as it is: the replicas meet only outside the loop
            place = dataclasses.replace(place, dp_mode=AFTER_LOOP)
        else:
            variant, trial = epoch_tuning.variant_for(state, job)
    where = dict(models=inputs.models, topology=place.topology, num_microbatches=inputs.num_microbatches,
                 stage=place.stage, forward_only=inputs.forward_only, device=place.device, pp_group=place.groups.pp,
                 agreement_group=runtime.agreement_group)
    limit = auto_limit.call_limit(options, state, **where)
    in_bytes = byte_limit.call_bytes(limit.arbiter, state, **where)
    arbiter = Plan.build(in_bytes.arbiter, place.topology, inputs.num_microbatches).arbiter(
        place.stage, forward_only=inputs.forward_only)
    meter = ActivationMeter(place.device,
                            persistent=model_tensors(inputs.models) if place.device.type == "cpu" else ())
    store = weight_grad_store(inputs.models, meter, hint=options.arbiter.parsed_hint.name) \
        if arbiter.split_backward else None
    agreement = None
    if runtime.agreement_group is not None:
        agreement = TPAgreement(runtime.agreement_group, num_microbatches=inputs.num_microbatches,
                                num_chunks=len(inputs.models), split_backward=arbiter.split_backward,
                                forward_only=inputs.forward_only, device=runtime.device)
    return ScheduleCall(state=state, options=options, inputs=inputs, place=place, session=runtime, limit=limit,
                        in_bytes=in_bytes, arbiter=arbiter, meter=meter, wgrad_store=store, agreement=agreement,
                        measuring=measuring, variant=variant, trial=trial)


def _transport_for(options: RRFPConfig, dp_mode: str) -> str:
    """The epoch rule lives in the rounds transport: ``auto`` reads it, ``threads`` is refused."""
    if dp_mode != EPOCHS:
        return options.transport
    if options.transport == "threads":
        raise ValueError("megatron_rrfp: --rrfp-dp-overlap epochs orders the rounds of the rounds transport; "
                         "--rrfp-transport threads has none: use --rrfp-transport rounds (or auto)")
    return "rounds"


def _placement(state: ScheduleState, options: RRFPConfig, models: list, *, pg_collection,
               p2p_communicator) -> Placement:
    config = compat.get_model_config(models[0])
    check_supported(config, models)
    device = compat.pipeline_device()
    data_parallel_size = compat.data_parallel_size(pg_collection)
    # interleaved DP overlap on CUDA: lock-step (every DP replica of the stage joins the agreement) or the DP
    # communication out of the task loop (dp_overlap.py); the mode of training calls, for forward-only calls
    # too, so evaluation does not rebuild the session's groups each time
    dp_mode = dp_communication(models, device_type=device.type, data_parallel_size=data_parallel_size,
                               choice=options.dp_overlap)
    _say_dp_mode_once(state, dp_mode, options.dp_overlap, models, data_parallel_size)
    groups = compat.process_groups(pg_collection=pg_collection, p2p_communicator=p2p_communicator,
                                   whole_stage=compat.reduces_over_data_parallel(config) or dp_mode == LOCKSTEP)
    pp_ranks = dist.get_process_group_ranks(groups.pp)
    if len(pp_ranks) < 2:
        raise ValueError("megatron_rrfp: the pipeline-parallel size is 1; use Megatron's "
                         "forward_backward_no_pipelining (get_forward_backward_func does this)")
    return Placement(config=config, device=device, groups=groups, pp_ranks=pp_ranks,
                     stage=pp_ranks.index(dist.get_rank()), topology=Topology(len(pp_ranks), len(models)),
                     data_parallel_size=data_parallel_size, dp_mode=dp_mode)


def check_supported(config, models) -> None:
    """Refuse, in one line naming the flag and the fix, what rrfp does not run."""
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


def _say_dp_mode_once(state: ScheduleState, mode: str, choice: str, models, data_parallel_size: int) -> None:
    """Rank 0 names the choice once per model (it changes where DP time is spent)."""
    if mode in (LOCKSTEP, AFTER_LOOP, EPOCHS) and id(models[0]) not in state.dp_modes_said:
        state.dp_modes_said.add(id(models[0]))
        if dist.get_rank() == 0:
            print_line(describe(mode, choice, models, data_parallel_size))


def _all_true(value: bool, group, device) -> bool:
    """Collective over ``group``: ``value`` on every rank."""
    flag = torch.tensor([int(value)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


__all__ = ["Inputs", "Placement", "ScheduleCall", "build_call", "check_supported"]
