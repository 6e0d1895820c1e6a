"""Rank body for tests/distributed/test_inprocess_restart.py: an in-process restart as NVRx's
``inprocess.Wrapper`` does it, without NVRx (PP=2, real transport, real megatron-core stage).

NVRx's monitor thread, on a fault anywhere, first aborts the process groups
(``AbortTorchDistributed``: ``destroy_process_group``) and then raises an asynchronous exception in
the main thread (``PyThreadState_SetAsyncExc``), which Python delivers only between bytecodes; the
wrapper then re-creates the world under a new store prefix and calls the training function again.
Here a thread of each rank does the same, while one rank hangs in its forward step (``hang``) or
after one rank's forward step raised and the other failed on the closed link (``raise``).
"""
from __future__ import annotations

import ctypes
import threading
import time

import torch

from megatron_rrfp.mcore.config import RRFPConfig
from megatron_rrfp.mcore.schedule import forward_backward_rrfp
from megatron_rrfp.mcore.state import ScheduleState

from . import mlp
from .failures import _stage_and_data

M = 4
TIMEOUT_S = 60.0  # RRFP's stall timeout: every wait below must end long before it


class Restart(BaseException):
    """What NVRx raises in the main thread (its RankShouldRestart is a BaseException too)."""


def _raise_in_main_thread(exc_type) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threading.main_thread().ident),
                                               ctypes.py_object(exc_type))


def _rrfp_threads() -> set:
    return {t for t in threading.enumerate() if t.name.startswith("rrfp-") and not t.name.startswith("rrfp-launcher")}


def restart_in_process(kind: str) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    model, _, step = _stage_and_data()
    rank = dist.get_rank()
    options = RRFPConfig().with_options(timeout_s=TIMEOUT_S, buffer_limit="1x")  # 1x in bytes: calibrated

    def run(forward_step=step) -> torch.Tensor:
        for p in model.parameters():
            p.grad = None
        data = mlp.synthetic_mlp_batches(seed=5, micro_batch_size=2, seq_length=8, hidden_size=32)
        forward_backward_rrfp(forward_step_func=forward_step, data_iterator=data, model=model, num_microbatches=M,
                              seq_length=8, micro_batch_size=2, rrfp_config=options)
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    reference = run()
    run()  # measures, then applies the byte calibration: the failed world has one
    record: dict = {"rank": rank}
    old_state = ScheduleState.get()
    old_calibrations = [*old_state.auto_limits.values(), *old_state.byte_budgets.values()]
    record["calibrated_before"] = len(old_calibrations)
    old_threads = _rrfp_threads()
    record["threads_before"] = len(old_threads)

    calls = [0]

    def faulty_step(data_iterator, model_):
        calls[0] += 1
        if rank == 1 and calls[0] == 2:  # mid-iteration: stage 1's second forward
            if kind == "raise":
                raise RuntimeError("injected fault")
            while True:  # a hang that Python code still runs through
                time.sleep(0.05)
        return step(data_iterator, model_)

    store = dist.distributed_c10d._get_default_store()
    raised_at = [None]

    def monitor(delay: float) -> None:  # NVRx's order: abort the groups, then interrupt the main thread
        time.sleep(delay)
        dist.destroy_process_group()
        raised_at[0] = time.monotonic()
        _raise_in_main_thread(Restart)

    failure = None
    if kind == "hang":
        threading.Thread(target=monitor, args=(2.0,), daemon=True).start()
    start = time.monotonic()
    try:
        run(faulty_step)
        time.sleep(30)  # not reached on any rank: the restart ends the wait below
    except Restart:
        failure = "Restart"
    except Exception as exc:  # noqa: BLE001 - "raise": the fault, and the peer's failure on the closed link
        failure = type(exc).__name__
        record["message"] = str(exc)
        record["failed_after_s"] = time.monotonic() - start
        dist.destroy_process_group()  # what NVRx's abort does on every rank after a fault
    record["failure"] = failure
    if raised_at[0] is not None:
        record["interrupted_after_s"] = time.monotonic() - raised_at[0]

    # NVRx's next restart iteration: a new world under a new store prefix, the same training function
    parallel_state.destroy_model_parallel()
    dist.init_process_group("gloo", store=dist.PrefixStore("restart-1", store), rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    # the old world's threads end on the peers' close frames, far sooner than RRFP's stall timeout (60 s);
    # a loaded host may take more than a moment to run them out
    deadline = time.monotonic() + 10.0
    while any(t.is_alive() for t in old_threads) and time.monotonic() < deadline:
        time.sleep(0.05)
    record["old_threads_alive"] = sorted(t.name for t in old_threads if t.is_alive())
    record["first_after_restart_matches"] = bool(torch.equal(run(), reference))
    new_state = ScheduleState.get()
    record["new_state"] = new_state is not old_state
    record["old_session_closed"] = old_state.session is None
    new_calibrations = [*new_state.auto_limits.values(), *new_state.byte_budgets.values()]
    record["calibrations_carried"] = sum(any(n is o for o in old_calibrations) for n in new_calibrations)
    record["second_after_restart_matches"] = bool(torch.equal(run(), reference))
    record["threads_of_new_world"] = len(_rrfp_threads() - old_threads)
    return record
