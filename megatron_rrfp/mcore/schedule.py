"""Megatron-core's schedule contract, run by the readiness-first executor.

``forward_backward_rrfp`` takes exactly the keyword arguments of megatron-core's
``forward_backward_pipelining_without_interleaving`` (plus ``hint=``, ``buffer_limit=``,
``strict=``, ``timeout_s=``, ``rrfp_config=``) and returns the same thing: the
per-microbatch loss dicts on the last stage, ``[]`` elsewhere. It reads as three steps over
one object: ``build_call`` decides everything (mcore/call.py), ``run()`` runs the task loop
through megatron-core's own ``forward_step`` / ``backward_step`` (``stage_work.py``),
``finish()`` finalizes the gradients and returns the losses; a failure in between is
cleaned up by ``abandon()``. What one call leaves for the next (options, session,
calibrations, the last report) is the process's ``ScheduleState`` (mcore/state.py).

Every call measures this rank's peak activation memory (runtime/memory.py) and runs with
the buffer limit resolved for its layout (``16``, ``1x``; ``auto``: auto_limit.py); both are
in ``last_iteration_report()`` beside the peak forwards in flight.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from ..policy.budget import LimitSpec
from ..runtime.executor import IterationReport
from . import compat
from .call import Inputs, build_call
from .config import RRFPConfig, defaults
from .state import ScheduleState


def last_iteration_report() -> Optional[IterationReport]:
    """What this rank did in its most recent completed schedule call (order, timings, spans)."""
    return ScheduleState.get().last_report


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
    inputs = Inputs(forward_step_func=forward_step_func, models=models,
                    iterators=data_iterator if isinstance(data_iterator, list) else [data_iterator] * len(models),
                    num_microbatches=num_microbatches, forward_only=forward_only,
                    collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
                    force_all_reduce=force_all_reduce)
    call = build_call(ScheduleState.get(), options, inputs, pg_collection=pg_collection,
                      p2p_communicator=p2p_communicator)  # a refusal raises here: nothing started, nothing to undo
    try:
        call.run()
        return call.finish()
    except BaseException:
        call.abandon()  # no_sync exited, timers stopped, the session discarded
        raise


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
