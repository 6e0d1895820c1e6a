"""Paired forward and backward on single-queue stand-in GPUs (tests/helpers/emulated_pipeline.py):
the real executor, TP agreement and rounds transport, each pair one combined step whose halves'
MoE all-to-alls sit beside the other half's compute on the same queue. Every random job completes
with the right gradients, pairs run, and agreeing ranks (TP, and EP replicas) run one order."""
from __future__ import annotations

import pytest

from helpers.emulated_pipeline import EmulatedJob, paired_jobs, run_emulated

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore:megatron-rrfp. hint '(bf|bfw)' with:RuntimeWarning")]


def test_random_paired_jobs_complete_on_the_rounds_protocol():
    jobs = paired_jobs(16, seed=7, protocol="rounds", quiet_s=3.0)
    assert {j.ep for j in jobs} == {1, 2} and {j.chunks > 1 for j in jobs} == {True, False}
    outcomes = [(job, run_emulated(job)) for job in jobs]
    failed = [(job.describe(), outcome.error) for job, outcome in outcomes if not outcome.completed]
    assert not failed, failed
    assert sum(outcome.pairs for _, outcome in outcomes) > 0
    assert sum(outcome.pairs > 0 for _, outcome in outcomes) >= len(jobs) // 2
    # the default hint pairs with its B/W split: pairs and W tasks in one job
    assert any(outcome.pairs and any("W" in order for orders in outcome.orders.values() for order in orders)
               for job, outcome in outcomes if job.hint == "default")


def test_a_paired_moe_job_on_two_pipelines_runs_one_order_per_stage():
    job = EmulatedJob(pp=3, chunks=2, microbatches=6, hint="bf", buffer_limit=4, dp=2, ep=2, pair=True, seed=5,
                      straggler=3.0, host_jitter_ms=3.0, quiet_s=3.0)
    outcome = run_emulated(job)
    assert outcome.completed, outcome.error
    assert outcome.pairs > 0
    # EP spans the two pipelines: both pipelines' ranks of a stage ran one order, pairs included
    assert all(outcome.orders[s * 2] == outcome.orders[job.pp * 2 + s * 2] for s in range(job.pp))
