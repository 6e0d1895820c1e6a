"""The device transport under NCCL's worst-case semantics, without a GPU (in-process, ~40 s).

Every rank gets a stand-in GPU with ONE in-order queue for compute, TP collectives and
p2p (``CUDA_DEVICE_MAX_CONNECTIONS=1``; a send or receive blocks the queue until its
partner runs — ``tests/helpers/queue_device.py``). The real executor, arbiter, TP
agreement and transport run on it, a thread per rank, with random device times, host
jitter and host-channel latency. ``scripts/emulate_transport.py`` runs many more.
"""
from __future__ import annotations

import threading

import pytest
import torch

from helpers.emulated_pipeline import EmulatedJob, random_jobs, run_emulated
from helpers.queue_device import ThreadCollective
from megatron_rrfp.policy.actions import Kind, Task
from megatron_rrfp.runtime.agreement import AgreementError, TPAgreement

# random jobs name bf / bfw on interleaved layouts where the planner announces a loss (tests/unit/test_policy.py)
pytestmark = [pytest.mark.timeout(240),
              pytest.mark.filterwarnings("ignore:megatron-rrfp. hint '(bf|bfw)' with:RuntimeWarning")]


def test_rounds_protocol_completes_every_random_configuration_with_the_right_gradients():
    # PP 2-8, TP=2, 1-4 chunks, bf / bfw / 1f1b, buffer limits 2 / 4 / 32; half of them two pipelines
    # (DP=2, overlapped DDP reductions / all-gathers, some with EP=2 all-to-alls)
    jobs = random_jobs(18, seed=11, protocol="rounds", quiet_s=3.0)
    assert {j.pp for j in jobs} >= {2, 3, 4} and {j.chunks for j in jobs} == {1, 2, 3, 4}
    assert {j.hint for j in jobs} >= {"bf", "bfw", "1f1b"}
    assert {j.dp for j in jobs} == {1, 2} and {j.ep for j in jobs} == {1, 2}
    failed = [(job.describe(), outcome.error) for job in jobs if not (outcome := run_emulated(job)).completed]
    assert not failed, failed


@pytest.mark.parametrize("kwargs", [
    # interleaved DP overlap: every replica of a stage joins the agreement (mcore/dp_overlap.py)
    dict(pp=4, chunks=4, microbatches=4, hint="bfw", overlap_grad_reduce=True, overlap_param_gather=True, buckets=3),
    dict(pp=3, chunks=2, microbatches=6, hint="bf", overlap_grad_reduce=True, overlap_param_gather=True),
    # MoE: all-to-alls in F and B and the dispatcher's host sync, on two pipelines (EP spans them)
    dict(pp=3, chunks=2, microbatches=3, hint="bfw", ep=2, overlap_grad_reduce=True),
    # no interleaving: reductions in the last B / W and all-gathers in the first F need no rule
    dict(pp=4, chunks=1, microbatches=6, hint="bfw", overlap_grad_reduce=True, overlap_param_gather=True),
    # two of dp_stress_jobs where rounds-dp-unagreed (the rule dropped) deadlocked in 1 of 3 runs each:
    # a cycle through both pipelines' DP reductions and rounds (scripts/emulate_transport.py --dp-stress)
    dict(pp=4, chunks=3, microbatches=4, hint="bfw", overlap_grad_reduce=True, buckets=3, straggler=3.0,
         channel_latency_ms=5.0, task_ms=(0.2, 1.0), seed=105),
    dict(pp=4, chunks=2, microbatches=8, hint="bfw", overlap_grad_reduce=True, buckets=3, straggler=6.0,
         channel_latency_ms=10.0, task_ms=(0.2, 3.0), seed=108),
    # the other safe choice (--rrfp-dp-overlap after-loop): replicas independent, DP communication out of the loop
    dict(pp=4, chunks=4, microbatches=4, hint="bfw", overlap_grad_reduce=True, overlap_param_gather=True, buckets=3,
         dp_after_loop=True),
    dict(pp=4, chunks=2, microbatches=8, hint="bfw", overlap_grad_reduce=True, buckets=3, straggler=6.0,
         channel_latency_ms=10.0, task_ms=(0.2, 3.0), seed=108, dp_after_loop=True),
])
def test_whole_production_jobs_on_two_pipelines_complete(kwargs):
    job = EmulatedJob(**{"dp": 2, "straggler": 3.0, "host_jitter_ms": 3.0, "quiet_s": 3.0, "seed": 3, **kwargs})
    outcome = run_emulated(job)
    assert outcome.completed, outcome.error
    if job.whole_stage:  # lock-step: both pipelines' ranks of a stage ran one order
        assert all(outcome.orders[s * 2] == outcome.orders[job.pp * 2 + s * 2] for s in range(job.pp))


def _pinned_at_dp_points(job: EmulatedJob, outcome) -> None:
    """Every rank's every order holds each of its stage's DP points at its place of the static
    timeline: exactly the timeline's tasks before it, in any order, come first."""
    from megatron_rrfp.policy.actions import parse_order
    from megatron_rrfp.policy.arbiter import ArbiterConfig
    from megatron_rrfp.policy.epochs import timeline_for
    from megatron_rrfp.policy.plan import Plan
    from megatron_rrfp.policy.topology import Topology

    topology = Topology(job.pp, job.chunks)
    config = ArbiterConfig(hint=job.hint, buffer_limit=job.buffer_limit)
    plan = Plan.build(config, topology, job.microbatches)
    timeline = timeline_for(plan.config, topology, job.microbatches, plan.split_backward, job.variant)
    for rank, orders in outcome.orders.items():
        stage = (rank % (job.pp * job.tp)) // job.tp
        static = timeline.orders[stage]
        for text in orders:
            order = parse_order(text)
            for point in (p for p in timeline.points if p.stage == stage):
                at = static.index(point.task)
                assert order.index(point.task) == at and set(order[:at]) == set(static[:at]), (rank, point, text)


@pytest.mark.parametrize("kwargs", [
    # the DP epoch rule (--rrfp-dp-overlap epochs): DP collectives where megatron issues them, replicas independent
    dict(pp=4, chunks=4, microbatches=4, hint="bfw", overlap_grad_reduce=True, overlap_param_gather=True, buckets=3),
    dict(pp=3, chunks=2, microbatches=6, hint="bf", overlap_grad_reduce=True, overlap_param_gather=True),
    dict(pp=3, chunks=2, microbatches=3, hint="bfw", ep=2, overlap_grad_reduce=True),
    dict(pp=4, chunks=3, microbatches=4, hint="bfw", overlap_grad_reduce=True, buckets=3, straggler=3.0,
         channel_latency_ms=5.0, task_ms=(0.2, 1.0), seed=105),
    dict(pp=4, chunks=2, microbatches=8, hint="bf", overlap_grad_reduce=True, overlap_param_gather=True, buckets=3,
         straggler=6.0, channel_latency_ms=10.0, task_ms=(0.2, 3.0), seed=108, buffer_limit=4),
    # two of dp_stress_jobs(seed=1) where rounds-without-epoch-order (tasks pinned, rounds not) deadlocked
    dict(pp=4, chunks=2, microbatches=8, hint="bfw", overlap_grad_reduce=True, buckets=3, straggler=6.0,
         channel_latency_ms=10.0, task_ms=(0.2, 3.0), seed=1008),
    dict(pp=4, chunks=3, microbatches=8, hint="bfw", overlap_grad_reduce=True, overlap_param_gather=True, buckets=3,
         straggler=6.0, host_jitter_ms=1.0, channel_latency_ms=10.0, task_ms=(0.2, 3.0), seed=1082),
])
def test_production_jobs_under_the_epoch_rule_complete_with_dp_points_pinned(kwargs):
    job = EmulatedJob(**{"dp": 2, "straggler": 3.0, "host_jitter_ms": 3.0, "quiet_s": 3.0, "seed": 3,
                         "dp_epochs": True, **kwargs})
    assert job.epoch_rule and not job.whole_stage
    outcome = run_emulated(job)
    assert outcome.completed, outcome.error
    _pinned_at_dp_points(job, outcome)


def test_random_jobs_under_the_epoch_rule_complete():
    """The random jobs' interleaved DP=2 jobs (some with EP=2) under the epoch rule, the rest as
    they are; scripts/emulate_transport.py --dp-epochs runs 100 (docs/design/dp-epochs.md)."""
    jobs = [job for job in random_jobs(24, seed=5, protocol="rounds", quiet_s=3.0, dp_epochs=True) if job.dp > 1]
    assert sum(job.epoch_rule for job in jobs) >= 4, [job.describe() for job in jobs]
    for job in jobs:
        outcome = run_emulated(job)
        assert outcome.completed, (job.describe(), outcome.error)
        if job.epoch_rule:
            _pinned_at_dp_points(job, outcome)


def test_replicas_that_issue_different_collectives_are_caught():
    """The fabric pairs a group's n-th collectives and fails the job when they differ (NCCL
    would hang on different sizes and corrupt on equal ones): what a DP rule must prevent."""
    from helpers.queue_device import MismatchedCollective, QueueFabric, TPGroupOps

    fabric = QueueFabric([0, 1], quiet_s=1.0)
    try:
        dp = TPGroupOps(fabric, "dp0", [0, 1])
        dp.collective(0, ("reduce", 1, 0))
        done = dp.collective(1, ("reduce", 0, 0))
        with pytest.raises(MismatchedCollective, match=r"rank 0 issued \('reduce', 1, 0\), rank 1 issued"):
            done.synchronize(5.0)
    finally:
        fabric.stop()


@pytest.mark.parametrize("pp,chunks,hint", [(2, 1, "bf"), (3, 1, "bfw"), (4, 2, "bf")])
def test_the_early_receive_protocol_deadlocks_on_a_single_queue_device(pp, chunks, hint):
    job = EmulatedJob(pp=pp, chunks=chunks, microbatches=pp * 2 if chunks > 1 else 4, hint=hint,
                      protocol="early-receive", quiet_s=1.0, timeout_s=20)
    outcome = run_emulated(job)
    assert not outcome.completed and outcome.deadlock, outcome.error
    assert "every head waits for a partner" in outcome.error and "recv" in outcome.error


def test_one_rank_far_behind_its_tp_peer_still_dispatches_the_same_order():
    job = EmulatedJob(pp=4, chunks=1, microbatches=6, hint="bfw", buffer_limit=2, host_jitter_ms=6.0, seed=5)
    outcome = run_emulated(job)
    assert outcome.completed, outcome.error
    orders = outcome.orders
    assert all(orders[2 * s] == orders[2 * s + 1] for s in range(4))


# -- TP agreement in-process ---------------------------------------------------------

def _agreements(size: int, **kwargs) -> list[TPAgreement]:
    group = ThreadCollective.Group(size)
    return [TPAgreement(ThreadCollective(group, i), num_microbatches=4, num_chunks=1, split_backward=False,
                        forward_only=False, **kwargs) for i in range(size)]


def _together(fns) -> list:
    out: list = [None] * len(fns)

    def run(i):
        try:
            out[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - returned for the test to inspect
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


def test_agreement_intersects_ready_sets_and_takes_counter_minimum_beside_the_caller():
    a, b = _agreements(2)
    f0, f1, b0 = Task(Kind.F, 0), Task(Kind.F, 1), Task(Kind.B, 0)
    # posted exchanges run on the helper thread: both post, then both collect
    a.post({f0, f1}, (3, 7))
    b.post({f0, b0}, (5, 2))
    ra, rb = _together([a.collect, b.collect])
    for r in (ra, rb):
        assert r.common == {f0} and r.union == {f0, f1, b0}
        assert r.state == (3, 2) and r.state_max == (5, 7)
    assert ra.mine == {f0, f1} and ra.lagging and not ra.unanimous
    # a blocking exchange on the calling thread continues the same sequence
    a.commit(f0)
    b.commit(f0)
    ra, rb = _together([lambda: a.exchange({f1}, (1, 1)), lambda: b.exchange({f1}, (1, 1))])
    assert ra.common == rb.common == {f1} and ra.unanimous
    assert a.stats.rounds == 2 and a.stats.blocking_rounds == 1 and a.stats.collective_s > 0
    for agreement in (a, b):
        agreement.close()


def test_agreement_refuses_ranks_out_of_lock_step_with_every_view():
    a, b = _agreements(2)
    a.commit(Task(Kind.F, 0))
    b.commit(Task(Kind.F, 1))  # diverged
    out = _together([lambda: a.exchange({Task(Kind.F, 2)}), lambda: b.exchange(set())])
    for err in out:
        assert isinstance(err, AgreementError), err
        assert "out of lock-step" in str(err) and "group rank 0" in str(err) and "0F2" in str(err)


def test_agreement_collect_times_out_while_a_peer_is_missing_and_then_completes():
    a, b = _agreements(2)
    a.post(set())
    with pytest.raises(TimeoutError):
        a.collect(timeout=0.05)
    assert a.outstanding
    b.post(set())
    assert b.collect(timeout=5).unanimous and a.collect(timeout=5).unanimous
    assert a.stats.blocked_s >= 0.05
    for agreement in (a, b):
        agreement.close()


def test_thread_collective_gathers_in_rank_order():
    group = ThreadCollective.Group(3)
    members = [ThreadCollective(group, i) for i in range(3)]
    out = _together([lambda m=m, i=i: m.all_gather(torch.full((2,), i, dtype=torch.uint8))
                     for i, m in enumerate(members)])
    for gathered in out:
        assert gathered.tolist() == [[0, 0], [1, 1], [2, 2]]


def test_group_rank_0_announces_a_task_with_its_partner_and_alone():
    """A bubble decision of group rank 0 (``agreed_choice._lead_or_listen``): the others learn the
    task and the forward it runs with (a pair under --overlap-moe-expert-parallel-comm), or None."""
    a, b = _agreements(2)
    f1, b0 = Task(Kind.F, 1), Task(Kind.B, 0)
    _, heard = _together([lambda: a.announce(b0, f1), b.listen])
    assert heard == (b0, f1)
    for agreement in (a, b):  # both dispatch the pair: the digests stay equal
        agreement.commit(b0)
        agreement.commit(f1)
    _, heard = _together([lambda: a.announce(Task(Kind.F, 2)), b.listen])
    assert heard == (Task(Kind.F, 2), None) and b.stats.announced == 2
    for agreement in (a, b):
        agreement.close()
