"""The executor in one process, in milliseconds: ``PipelineIteration`` with a recording
``StageWork`` and a loopback transport (tests/helpers/loopback.py) — readiness,
backpressure, out-of-order arrival, duplicate and stray messages, stall diagnosis."""
from __future__ import annotations

import threading
import time

import pytest

from helpers.loopback import LoopbackMessage, LoopbackNetwork, RecordingWork
from megatron_rrfp.bench.around_schedules import HeldMessages
from megatron_rrfp.policy.actions import Kind, Task, format_order
from megatron_rrfp.policy.arbiter import ArbiterConfig
from megatron_rrfp.policy.plan import Plan
from megatron_rrfp.policy.topology import Topology
from megatron_rrfp.runtime.executor import Inbox, PipelineIteration, PipelineStallError

pytestmark = pytest.mark.timeout(60)


def iteration(network: LoopbackNetwork, *, stage: int, topology: Topology, m: int, hint: str = "bf",
              buffer_limit: int = 32, strict: bool = False, timeout_s: float = 10.0, forward_only: bool = False):
    plan = Plan.build(ArbiterConfig(hint=hint, buffer_limit=buffer_limit, strict=strict), topology, m)
    ranks = list(range(topology.num_stages))
    return PipelineIteration(work=RecordingWork(stage), arbiter=plan.arbiter(stage, forward_only=forward_only),
                             topology=topology, stage=stage, stage_ranks=ranks,
                             transport=network.transport(stage), inbox=network.inboxes[stage], agreement=None,
                             timeout_s=timeout_s, forward_only=forward_only)


def run_pipeline(topology: Topology, m: int, **options) -> list:
    """Every stage in its own thread; returns the global log [(seq, stage, task)]."""
    RecordingWork.log = []
    network = LoopbackNetwork(range(topology.num_stages))
    stages = [iteration(network, stage=s, topology=topology, m=m, **options) for s in range(topology.num_stages)]
    errors: list = []

    def body(it):
        try:
            it.run()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(it,)) for it in stages]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    return RecordingWork.log


@pytest.mark.parametrize("pp,chunks,m,hint,strict", [
    (3, 1, 6, "bf", False), (4, 1, 8, "bfw", False), (3, 1, 5, "1f1b", True), (2, 2, 4, "bf", False),
    (3, 2, 6, "1f1b", False), (2, 2, 4, "bfw", False)])
def test_every_stage_completes_in_dependency_order(pp, chunks, m, hint, strict):
    topology = Topology(pp, chunks)
    log = run_pipeline(topology, m, hint=hint, strict=strict, buffer_limit=3)
    when = {(stage, task): seq for seq, stage, task in log}
    split = hint == "bfw"
    for stage in range(pp):
        kinds = (Kind.F, Kind.B, Kind.W) if split else (Kind.F, Kind.B)
        assert {t for s, t in when if s == stage} == {Task(k, mb, c) for k in kinds for mb in range(m)
                                                      for c in range(chunks)}
    for (stage, task), seq in when.items():
        if task.kind is Kind.F and (up := topology.upstream(stage, task.chunk)) is not None:
            assert seq > when[(up[0], Task(Kind.F, task.microbatch, up[1]))]
        if task.kind is Kind.B:
            assert seq > when[(stage, Task(Kind.F, task.microbatch, task.chunk))]
            if (down := topology.downstream(stage, task.chunk)) is not None:
                assert seq > when[(down[0], Task(Kind.B, task.microbatch, down[1]))]
        if task.kind is Kind.W:
            assert seq > when[(stage, Task(Kind.B, task.microbatch, task.chunk))]


def test_runs_what_arrived_first_not_what_the_order_lists_first():
    network = LoopbackNetwork([0, 1])
    last = iteration(network, stage=1, topology=Topology(2), m=3)
    network.deliver(1, "activation", 2, 0, src=0)  # microbatch 2 overtook 0 and 1
    threading.Timer(0.2, lambda: [network.deliver(1, "activation", mb, 0, src=0) for mb in (0, 1)]).start()
    report = last.run()
    assert report.order_string.startswith("0F2,0B2,"), report.order_string
    assert report.wait_s > 0.1  # then it waited for the others, as a bubble


def test_at_the_buffer_limit_only_backwards_run_and_the_wait_is_backpressure():
    network = LoopbackNetwork([0, 1])
    first = iteration(network, stage=0, topology=Topology(2), m=4, buffer_limit=2)
    threading.Timer(0.3, lambda: [network.deliver(0, "gradient", mb, 0, src=1) for mb in range(4)]).start()
    report = first.run()
    assert report.order_string.startswith("0F0,0F1,0B0,0F2"), report.order_string
    assert report.peak_in_flight == 2
    assert report.backpressure_s > 0.2 and report.wait_s < 0.2


def test_stall_diagnosis_names_the_state_and_the_peers():
    network = LoopbackNetwork([0, 1])
    first = iteration(network, stage=0, topology=Topology(2), m=4, buffer_limit=2, timeout_s=0.3)
    with pytest.raises(PipelineStallError) as info:
        first.run()
    message = str(info.value)
    assert "rank 0 (pipeline stage 0): no progress for" in message
    assert "'in_flight': 2" in message and "ready: 0F2,0F3" in message
    assert "dispatched: 0F0,0F1" in message and "peers (stage -> rank): {0: 0, 1: 1}" in message


@pytest.mark.parametrize("fails_in", ["send", "flush"])
def test_a_peer_gone_while_sending_or_flushing_fails_with_the_stall_diagnosis(fails_in):
    """A transport that finds its peer gone raises TransportError from a send (inside a task),
    an issued round or the final flush; the iteration turns it into the same diagnosis as
    one found while waiting (a race a dying peer wins on a fast host)."""
    from megatron_rrfp.runtime.transport import TransportError

    network = LoopbackNetwork([0, 1])
    first = iteration(network, stage=0, topology=Topology(2), m=2, timeout_s=5.0)

    def gone(*_args):
        raise TransportError("rank 0: send to rank 1 failed while processing (header not yet received)")

    setattr(first.transport, fails_in, gone)
    if fails_in == "flush":  # let every task run: the peer answers, then is gone at the flush
        for mb in range(2):
            network.deliver(0, "gradient", mb, 0, src=1)
    with pytest.raises(PipelineStallError) as info:
        first.run()
    message = str(info.value)
    assert "rank 0 (pipeline stage 0): transport failed: rank 0: send to rank 1 failed" in message
    assert "dispatched:" in message and "peers (stage -> rank): {0: 0, 1: 1}" in message
    assert isinstance(info.value.__cause__, TransportError)


@pytest.mark.parametrize("kind,mb,chunk,src,expected", [
    ("activation", 7, 0, 0, "unexpected activation for microbatch 7, chunk 0 from rank 0: this iteration has "
                            "microbatches 0..2"),
    ("activation", 0, 1, 0, "chunks 0..0"),
    ("activation", 0, 0, 5, "unexpected activation for microbatch 0, chunk 0 from rank 5: it must come from rank 0"),
    ("gradient", 0, 0, 0, "unexpected gradient for microbatch 0, chunk 0 from rank 0: it must come from no rank"),
    ("weights", 0, 0, 0, "unexpected weights"),
])
def test_stray_messages_fail_the_iteration_naming_the_sender(kind, mb, chunk, src, expected):
    network = LoopbackNetwork([0, 1])
    last = iteration(network, stage=1, topology=Topology(2), m=3)
    network.deliver(1, kind, mb, chunk, src=src)
    with pytest.raises(PipelineStallError, match="rank 1 \\(pipeline stage 1\\)") as info:
        last.run()
    assert expected in str(info.value)


def test_a_duplicate_message_fails_the_iteration():
    network = LoopbackNetwork([0, 1])
    last = iteration(network, stage=1, topology=Topology(2), m=3)
    network.deliver(1, "activation", 1, 0, src=0)
    network.deliver(1, "activation", 1, 0, src=0)
    with pytest.raises(PipelineStallError, match="duplicate activation for microbatch 1, chunk 0 from rank 0"):
        last.run()


def test_forward_only_refuses_gradients():
    network = LoopbackNetwork([0, 1])
    first = iteration(network, stage=0, topology=Topology(2), m=2, forward_only=True)
    network.deliver(0, "gradient", 0, 0, src=1)
    with pytest.raises(PipelineStallError, match="in a forward-only iteration"):
        first.run()


def test_delayed_messages_are_held_back_each_by_its_own_delay():
    inbox = Inbox()
    delays = {0: 0.4, 3: 0.25}
    inbox.deliver = HeldMessages(lambda message: delays.get(message.microbatch, 0.0))  # RRFPConfig.deliver_message
    start = time.monotonic()
    for mb in range(6):
        inbox.put(LoopbackMessage("activation", mb, 0, None, 0))
    arrived: list = []
    while len(arrived) < 6 and time.monotonic() - start < 5:
        arrived += [(m.microbatch, time.monotonic() - start) for m in inbox.drain()]
        inbox.wait(0.05)
    assert [mb for mb, _ in arrived] == [1, 2, 4, 5, 3, 0]
    at = dict(arrived)
    assert at[5] < 0.2 and 0.2 < at[3] < at[0] and at[0] > 0.35
    assert format_order([Task(Kind.F, mb) for mb, _ in arrived]) == "0F1,0F2,0F4,0F5,0F3,0F0"


def test_the_agreements_gather_uses_torchs_current_collective_without_a_warning():
    """torch 2.13 deprecates all_gather_into_tensor (a FutureWarning on every
    call, every TP run); the agreement's gather goes through all_gather_single."""
    import warnings

    import torch
    import torch.distributed as dist

    from megatron_rrfp.runtime.agreement import GlooCollective

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gathered = GlooCollective(dist.group.WORLD).all_gather(torch.tensor([3, 1, 4], dtype=torch.uint8))
    finally:
        dist.destroy_process_group()
    assert gathered.tolist() == [[3, 1, 4]]
    assert not [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))], \
        [str(w.message) for w in caught]


@pytest.mark.parametrize("release_broken", [False, True])
def test_the_unsplit_fallback_line_names_the_release_when_it_is_the_cause(monkeypatch, capsys, release_broken):
    """The default hint's one line says 'with this megatron-core release' when the
    release's own linear failed the split self-check, 'for this model' when the model's
    layers are the reason (here: no megatron-core linear at all)."""
    import torch

    from megatron_rrfp.mcore import stage_work
    from megatron_rrfp.mcore.config import RRFPConfig
    from megatron_rrfp.split import megatron_linear as wgrad

    failed = "megatron-core 0.0: the B/W split self-check failed: its split backward raised RuntimeError: x"
    monkeypatch.setattr(wgrad, "_SELF_CHECK", [failed if release_broken else ""])
    options = stage_work.with_split_capability(RRFPConfig(), [torch.nn.Linear(2, 2)], all_stages=lambda ok: ok)
    assert not options.arbiter.split_backward_ok
    line, = [line for line in capsys.readouterr().out.splitlines() if "without the B/W split" in line]
    if release_broken:
        assert line.startswith("megatron-rrfp: the default policy runs without the B/W split with this megatron-core "
                               f"release: {failed} (+1 more)"), line
    else:
        assert "for this model: no trainable megatron-core ColumnParallelLinear" in line, line
