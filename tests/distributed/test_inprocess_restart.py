"""An in-process restart (what Megatron-LM's --inprocess-restart does through NVRx) under rrfp,
emulated without NVRx: the failed world's process groups destroyed, an asynchronous exception in
the main thread, a new world in the same processes. Nothing of the failed world survives into the
new one (threads, session, calibrations) and the first iteration after it is exact.

The same through Megatron-LM's pretrain_gpt.py and NVRx itself: tests/e2e/test_inprocess_restart_e2e.py.
"""
from __future__ import annotations

import pytest

from helpers import inprocess
from megatron_rrfp.launch.function import launch


def _check_new_world(results):
    for r in results:
        assert r["calibrated_before"] >= 1 and r["threads_before"] >= 2, r  # there was something to leave behind
        assert r["old_threads_alive"] == [], r
        assert r["new_state"] and r["old_session_closed"] and r["calibrations_carried"] == 0, r
        assert r["first_after_restart_matches"] and r["second_after_restart_matches"], r
        assert r["threads_of_new_world"] >= 2, r


@pytest.mark.timeout(300)
def test_a_rank_that_raises_mid_iteration_fails_its_peer_at_once_and_the_new_world_starts_clean():
    results = {r["rank"]: r for r in launch(inprocess.restart_in_process, world_size=2, timeout=240,
                                            args=("raise",))}
    assert results[1]["failure"] == "RuntimeError"
    # the peer learns it from the closed link, long before RRFP's stall timeout (60 s)
    assert results[0]["failure"] == "PipelineStallError", results[0]
    assert "rank 1 closed the link" in results[0]["message"] and results[0]["failed_after_s"] < 10, results[0]
    _check_new_world(results.values())


@pytest.mark.timeout(300)
def test_an_asynchronous_restart_reaches_every_rank_waiting_in_rrfp_and_the_new_world_starts_clean():
    results = {r["rank"]: r for r in launch(inprocess.restart_in_process, world_size=2, timeout=240,
                                            args=("hang",))}
    for r in results.values():  # rank 0 waits in the executor, rank 1 in its (hung) forward step
        assert r["failure"] == "Restart", r
        assert r["interrupted_after_s"] < 2.0, r  # bounded waits: delivered within a slice, not a timeout
    _check_new_world(results.values())
