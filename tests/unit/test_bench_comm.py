"""The bench's emulated DP / expert communication (bench/comm_emulation.py): the DP channel's
timing on hand-made bucket groups, the options' checks, and one short end-to-end bench run
(DP2 x PP2 x 2 chunks, the production DP flags, the whole-stage agreement forced on CPU)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from megatron_rrfp.bench.comm_emulation import CommEmulator, CommTimes
from megatron_rrfp.bench.run import BenchConfig
from megatron_rrfp.policy.actions import Kind, Task


def _chunk(*sizes: int):
    """A DDP chunk as the emulator reads it: bucket groups with their gradient buffers' sizes."""
    groups = [SimpleNamespace(buckets=[SimpleNamespace(grad_data=SimpleNamespace(numel=lambda n=n: n))])
              for n in sizes]
    return SimpleNamespace(bucket_groups=groups)


def test_reductions_queue_on_one_channel_by_their_share_of_the_chunk():
    chunk = _chunk(300, 100)  # shares 0.75 and 0.25 of a 0.08 s chunk reduction
    comm = CommEmulator(CommTimes(dp_reduce_s=0.08), [chunk])
    comm.begin_iteration()
    start = time.time()
    comm.launched(chunk.bucket_groups[0])
    comm.launched(chunk.bucket_groups[1])
    comm.launched(chunk.bucket_groups[0])  # a second launch of the same group (first batch): no new time
    comm.finished(chunk.bucket_groups[1])  # behind the first on the channel: 0.06 + 0.02
    assert time.time() - start >= 0.08 - 1e-3
    assert comm.exposed_s == pytest.approx(0.08, abs=0.02)
    comm.finished(chunk.bucket_groups[0])  # already done: no wait
    assert comm.exposed_s == pytest.approx(0.08, abs=0.02)


def test_a_reduction_starts_once_every_dp_replica_launched_it():
    """DP replicas share a store (the job's, in a bench): a replica that launched early waits for
    the late one, then the reduction's own time, as the simulator's ``replicas_iteration_time``."""
    import torch.distributed as dist

    from megatron_rrfp.bench.comm_emulation import ReplicaClock

    store = dist.HashStore()
    chunks = [_chunk(100), _chunk(100)]  # one per replica: the same model, its own bucket groups
    early, late = (CommEmulator(CommTimes(dp_reduce_s=0.05), [chunk], ReplicaClock(store, "stage0", r, 2))
                   for r, chunk in enumerate(chunks))
    for comm in (early, late):
        comm.begin_iteration()
    start = time.time()
    early.launched(chunks[0].bucket_groups[0])
    time.sleep(0.1)
    late.launched(chunks[1].bucket_groups[0])
    early.finished(chunks[0].bucket_groups[0])
    assert time.time() - start >= 0.15 - 1e-3  # the late launch, then the reduction
    late.finished(chunks[1].bucket_groups[0])  # the same collective: done by now
    assert early.exposed_s == pytest.approx(0.05, abs=0.02) and late.exposed_s == 0.0


def test_all_gathers_overlapped_wait_only_at_each_chunks_first_forward_and_else_follow_the_call():
    chunks = [_chunk(100, 300), _chunk(400)]  # chunk 0's first group in forward order: its last (share 0.75)
    comm = CommEmulator(CommTimes(dp_gather_s=0.04, overlap_param_gather=True), chunks)
    comm.begin_iteration()
    assert comm.before_task(Task(Kind.F, 0, 0)) == pytest.approx(0.03, abs=0.015)
    assert comm.before_task(Task(Kind.F, 1, 0)) == 0.0  # not the chunk's first forward
    assert comm.before_task(Task(Kind.B, 0, 1)) == 0.0
    waited = comm.before_task(Task(Kind.F, 0, 1))  # behind chunk 0's two groups: 0.08 from the start
    assert waited == pytest.approx(0.05, abs=0.015)
    comm.after_call()  # overlapped: nothing after the call
    at_end = CommEmulator(CommTimes(dp_gather_s=0.02), chunks)
    at_end.begin_iteration()
    assert at_end.before_task(Task(Kind.F, 0, 0)) == 0.0
    start = time.time()
    at_end.after_call()  # every chunk's all-gather after the step
    assert time.time() - start >= 0.04 - 1e-3 and at_end.exposed_s == pytest.approx(0.04, abs=0.015)


def test_all_to_all_time_is_the_tasks_device_time():
    comm = CommEmulator(CommTimes(a2a_s=0.01), [_chunk(10)])
    comm.all_to_all()
    comm.all_to_all()
    assert comm.take_task_device() == pytest.approx(0.02) and comm.take_task_device() == 0.0


@pytest.mark.parametrize("options, flag", [
    (dict(data_parallel=2, dp_reduce_ms=5.0), "--dp-reduce-ms"),  # no DDP
    (dict(data_parallel=1, overlap_grad_reduce=True, dp_reduce_ms=5.0), "--dp-reduce-ms"),
    (dict(data_parallel=2, overlap_grad_reduce=True, dp_gather_ms=5.0), "--dp-gather-ms"),
    (dict(data_parallel=2, overlap_grad_reduce=True, overlap_param_gather=True), "--overlap-param-gather"),
    (dict(data_parallel=2, a2a_ms=1.0), "--a2a-ms"),
    (dict(data_parallel=2, overlap_grad_reduce=True, whole_stage_agreement=True), "--whole-stage-agreement"),
])
def test_communication_options_need_the_layout_they_model(options, flag):
    config = BenchConfig(pipeline_size=2, num_microbatches=4, **options)
    with pytest.raises(ValueError, match=flag):
        config.validate()


@pytest.mark.timeout(400)
def test_bench_dp2_pp2_interleaved_with_emulated_dp_communication(tmp_path):
    from megatron_rrfp.bench.run import run_bench

    config = BenchConfig(pipeline_size=2, num_chunks=2, data_parallel=2, num_microbatches=4, iterations=1,
                         warmup=1, variability="j0", f0_ms=10.0, schedules=("megatron-1f1b", "rrfp-default"),
                         overlap_grad_reduce=True, use_distributed_optimizer=True, overlap_param_gather=True,
                         dp_reduce_ms=20.0, dp_gather_ms=20.0, whole_stage_agreement=True, out_dir=str(tmp_path),
                         timeout_s=300.0)
    report = run_bench(config, progress=False)
    megatron, rrfp = report["runs"]
    for run in (megatron, rrfp):
        # the simulator's DP model lengthens the prediction: chunk 0's exposed all-gather at least
        assert run["simulated_iteration_time_s_with_dp_comm"] >= run["simulated_iteration_time_s"] + 0.02 - 1e-9
        assert run["task_breakdown"]["dp_wait_s"]["max"] > 0.01  # stage 0's first forward waited
    assert rrfp["task_breakdown"]["agree_s"]["max"] > 0  # the whole-stage agreement ran on CPU
    assert megatron["task_breakdown"]["agree_s"]["max"] == 0


def test_held_messages_of_one_sender_keep_their_order_when_asked():
    """The emulator's links are FIFO (bench/around_schedules.HeldMessages(fifo_per_sender=True)): a message
    with a shorter delay waits behind an earlier one from the same sender, not behind another's."""
    from megatron_rrfp.bench.around_schedules import HeldMessages
    from megatron_rrfp.runtime.inbox import Inbox

    inbox = Inbox()
    message = SimpleNamespace
    inbox.deliver = HeldMessages(lambda m: 0.2 if m.microbatch == 0 else 0.0, fifo_per_sender=True)
    for mb, src in ((0, 1), (1, 1), (2, 2)):
        inbox.put(message(kind="activation", microbatch=mb, chunk=0, tensor=None, src=src))
    arrived: list = []
    start = time.monotonic()
    while len(arrived) < 3 and time.monotonic() - start < 5:
        arrived += [m.microbatch for m in inbox.drain()]
        inbox.wait(0.02)
    assert arrived == [2, 0, 1]
