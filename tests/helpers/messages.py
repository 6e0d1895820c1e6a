"""Rank body for tests/distributed/test_messages.py: failures, bad messages and new process groups,
one after the other in the same two processes (PP=2, real transport, real megatron-core
stage). Each step records what it saw; the test asserts on every rank's record."""
from __future__ import annotations

import contextlib
import time

import torch

from megatron_rrfp.mcore import recovery
from megatron_rrfp.mcore import session as session_module
from megatron_rrfp.mcore.config import RRFPConfig
from megatron_rrfp.mcore.schedule import forward_backward_rrfp
from megatron_rrfp.mcore.state import ScheduleState
from megatron_rrfp.runtime.transport import encode_header

from . import mlp
from .failures import _stage_and_data

M = 4
TIMEOUT_S = 3.0


def _outcome(call) -> dict:
    start = time.monotonic()
    try:
        call()
        return {"error": None, "seconds": time.monotonic() - start}
    except Exception as exc:  # noqa: BLE001 - the test inspects whatever was raised
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}


def failure_and_recovery() -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.timers import Timers

    model, _, step = _stage_and_data()
    rank = dist.get_rank()
    options = RRFPConfig(timeout_s=TIMEOUT_S)
    open_no_sync = [0]

    @contextlib.contextmanager
    def counting_no_sync():
        open_no_sync[0] += 1
        try:
            yield
        finally:
            open_no_sync[0] -= 1

    model.config.no_sync_func = counting_no_sync
    model.config.timers = Timers(log_level=2, log_option="minmax")
    model.config.barrier_with_L1_time = False  # in steps 2 and 3 only stage 1 calls the schedule

    def run(forward_step=step) -> torch.Tensor:
        for p in model.parameters():
            p.grad = None
        data = mlp.synthetic_mlp_batches(seed=5, micro_batch_size=2, seq_length=8, hidden_size=32)
        forward_backward_rrfp(forward_step_func=forward_step, data_iterator=data, model=model, num_microbatches=M,
                              seq_length=8, micro_batch_size=2, rrfp_config=options)
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    def matches(grads: torch.Tensor) -> bool:
        return bool(torch.equal(grads, reference))

    record: dict = {"rank": rank}
    reference = run()

    # 1. stage 1's forward step raises on its third microbatch; stage 0 then stalls
    calls = [0]

    def failing_step(data_iterator, model_):
        calls[0] += 1
        if rank == 1 and calls[0] == 3:
            raise RuntimeError("bad batch in microbatch 2")
        return step(data_iterator, model_)

    record["failed"] = _outcome(lambda: run(failing_step))
    timers = getattr(model.config.timers, "_timers", {})
    record["after_failure"] = {
        "timer_running": any(getattr(timers.get(name), "_started", False) for name in recovery.SCHEDULE_TIMERS),
        "no_sync_open": open_no_sync[0], "session_discarded": ScheduleState.get().session is None}
    dist.barrier()
    record["recovered_matches_reference"] = matches(run())

    # 2. a forged header (dtype code 99) on the directed group 0 -> 1, while stage 1 runs
    if rank == 0:
        header = encode_header("activation", 0, 0, torch.empty(2, 32))
        header[4] = 99
        dist.send(header, 1, group=ScheduleState.get().session.groups[(0, 1)])
    else:
        record["forged"] = _outcome(run)
    dist.barrier()
    if rank == 0:  # this rank misbehaved: it starts over too, once rank 1 has judged the message (a
        session_module.discard()  # discard sends close frames, which must not overtake it)

    # 3. an activation for microbatch 99 of an iteration with 4 (through the real transport)
    if rank == 0:
        runtime = session_module.session([0, 1], [0], torch.device("cpu"), TIMEOUT_S)
        runtime.transport.send(1, "activation", 99, 0, torch.zeros(2, 32))
        runtime.transport.flush(TIMEOUT_S * 3)
    else:
        record["stray"] = _outcome(run)
    dist.barrier()
    if rank == 0:
        session_module.discard()
    record["after_bad_messages_matches_reference"] = matches(run())

    # 4. process groups destroyed and re-created in these processes (an in-process restart)
    before = ScheduleState.get().session
    store = dist.distributed_c10d._get_default_store()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore("restarted", store), rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    record["new_groups_matches_reference"] = matches(run())
    after = ScheduleState.get().session
    record["new_groups_new_session"] = after is not None and after is not before
    return record
