"""The launcher's sliced waits for blocking gloo collectives (a CPU run with --inprocess-restart):
exact sums with a late peer, plain and coalesced; an asynchronous exception reaches a rank blocked in
an all-reduce its peer never joins, within a slice; the interrupted group is kept and a new group works.
Megatron's point-to-point requests (its own 1F1B) are waited on a helper thread, with the same effect.

Through Megatron-LM and NVRx (PP2 x DP2, TP2 x PP2): tests/e2e/test_inprocess_restart_e2e.py.
"""
from __future__ import annotations

import pytest

from helpers import gloo_waits
from megatron_rrfp.launch.function import launch
from megatron_rrfp.megatron_lm.inprocess import WAIT_SLICE_S


@pytest.mark.timeout(300)
def test_sliced_gloo_waits_keep_the_sums_and_let_an_asynchronous_exception_through():
    results = {r["rank"]: r for r in launch(gloo_waits.sliced_waits, world_size=2, timeout=240)}
    for r in results.values():
        assert r["changed"] and r["sliced"], r
        assert r["sums"] == ([3.0] * 4, [3.0] * 3, [30.0] * 5), r
        assert r["fresh_sum"] == [2.0, 2.0], r
    interrupted = results[0]["interrupted_after_s"]
    assert interrupted is not None and 1.0 <= interrupted < 1.0 + 4 * WAIT_SLICE_S, results[0]
    assert results[0]["kept"] == 1, results[0]


@pytest.mark.timeout(300)
def test_megatron_p2p_requests_wait_on_a_thread_and_let_an_asynchronous_exception_through():
    results = {r["rank"]: r for r in launch(gloo_waits.megatron_p2p_waits, world_size=2, timeout=240)}
    for r in results.values():
        assert r["wrapped"] == [True, True, True], r
        assert r["batched"] == [float(2 - r["rank"])] * 3, r
    assert results[0]["late"] == [7.0] * 4, results[0]
    interrupted = results[0]["interrupted_after_s"]
    assert interrupted is not None and 1.0 <= interrupted < 1.0 + 4 * WAIT_SLICE_S, results[0]
    assert results[0]["kept"] == 1, results[0]


class _CompletesAsTheSliceRunsOut:
    """A gloo Work whose operation completes just after a slice's ``wait(timeout)`` gave up: c10d's
    ``Work.wait`` then has raised "Operation timed out!" although ``is_completed()`` is now True (seen
    under load in CI: a barrier whose peer arrived at the end of a slice)."""

    def __init__(self, error=None):
        self.error, self.waits, self.done = error, 0, False

    def wait(self, timeout=None):
        self.waits += 1
        if timeout is not None and not self.done:
            self.done = True
            raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self):
        return self.done


def test_a_slice_that_times_out_as_the_operation_completes_is_not_an_error():
    from megatron_rrfp.megatron_lm.inprocess import _KEPT, _wait

    kept = len(_KEPT)
    work = _CompletesAsTheSliceRunsOut()
    _wait(work, group=None)  # completed: returns
    assert work.waits == 2 and len(_KEPT) == kept
    failed = _CompletesAsTheSliceRunsOut(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="closed by peer"):  # the operation's own error, not the slice's
        _wait(failed, group=None)
    assert len(_KEPT) == kept  # a completed operation is not kept
