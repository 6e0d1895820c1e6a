"""A number of microbatches that changes from one call to the next, as Megatron's
sequence-packing schedulers change it: every call equals Megatron's own schedule, and each
M is calibrated on its own (a call never runs with another M's figures)."""
from __future__ import annotations

import pytest

from helpers.equivalence import Case, run_cases
from helpers.interleaved import compare_interleaved_cases
from megatron_rrfp.launch.function import launch
from megatron_rrfp.policy.actions import Kind, parse_order

pytestmark = pytest.mark.timeout(600)

MS = (6, 9, 4, 9)  # the last call meets an M calibrated before: it applies that M's agreed figures


def _microbatches(order: str) -> int:
    return len({task.microbatch for task in parse_order(order) if task.kind == Kind.F})


def test_pp2_calls_at_m_6_9_4_equal_megatron_and_calibrate_each_m():
    cases = [Case(model="gpt", hint="default", buffer_limit="1x", iterations=len(MS), microbatches_per_iteration=MS,
                  max_task_delay_s=0.005),
             Case(model="gpt", hint="bf", buffer_limit="auto", iterations=len(MS), microbatches_per_iteration=MS,
                  max_task_delay_s=0.005)]
    results = launch(run_cases, world_size=2, timeout=480, args=(cases,))
    for rank in results:
        for r in rank:
            assert r["loss_rel_err"] <= 1e-5 and r["grad_rel_err"] <= 1e-5, r
            assert [_microbatches(order) for order in r["orders"]] == list(MS), r["orders"]
            if r["stage"] == 1:
                assert r["num_losses"] == len(MS)
            # each M measured by its first call; only M = 9, called twice, agreed and applied
            calibrated = r["calibrations"]["auto" if r["case"]["buffer_limit"] == "auto" else "bytes"]
            assert calibrated == [(4, True, False), (6, True, False), (9, True, True)], r["calibrations"]


def test_interleaved_pp2_calls_at_changing_m_equal_megatron():
    # Megatron's interleaved schedule takes M in groups of PP: even M at PP 2
    case = dict(microbatches=(6, 8, 4, 8), iterations=4, buffer_limit="1x", max_task_delay_s=0.005)
    results = launch(compare_interleaved_cases, world_size=2, vpp=2, timeout=480, args=([case],))
    for rank in results:
        for r in rank:
            assert r["loss_rel_err"] <= 1e-5 and r["grad_rel_err"] <= 1e-5, r
            assert [_microbatches(order) for order in r["orders"]] == [6, 8, 4, 8], r["orders"]
