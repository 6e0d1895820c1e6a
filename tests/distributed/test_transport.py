"""Tests of megatron_rrfp.runtime.transport over gloo on CPU (spawned ranks; ~1 min on 2 cores).

    pytest tests/distributed/test_transport.py -v
"""
from __future__ import annotations

import datetime
import json
import os
import random
import threading
import time

import pytest
import torch

from megatron_rrfp.launch.function import DistributedTestFailure, launch
from megatron_rrfp.runtime.transport import (
    HEADER_LEN,
    MAX_DIMS,
    Message,
    StageTransport,
    TransportError,
    decode_header,
    encode_header,
)

TIMEOUT = datetime.timedelta(seconds=180)  # gloo op timeout of the directed groups
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
          torch.int32, torch.uint8, torch.bool]


def _payload(src: int, dst: int, i: int, big: bool = False) -> torch.Tensor:
    """Deterministic tensor for message i on src->dst, so the receiver can rebuild it."""
    g = torch.Generator().manual_seed(src * 1_000_003 + dst * 10_007 + i)
    dtype = DTYPES[int(torch.randint(len(DTYPES), (1,), generator=g))]
    ndim = int(torch.randint(0, 5, (1,), generator=g))
    shape = torch.randint(0, 6, (ndim,), generator=g).tolist()
    if i % 10:  # every 10th message may be empty (a zero in its shape)
        shape = [max(1, s) for s in shape]
    if big:
        shape = [256, 1024]  # 1 MiB of float32
    x = torch.randn(shape, generator=g) * 100
    if dtype == torch.bool:
        return x > 0
    return (x.abs() if dtype == torch.uint8 else x).to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


class _Inbox:
    """Thread-safe on_message / on_error sink; optional random slowness on delivery."""

    def __init__(self, slow_seed: int | None = None):
        self.cv = threading.Condition()
        self.msgs: list[tuple[float, Message]] = []
        self.errors: list[BaseException] = []
        self._rng = random.Random(slow_seed) if slow_seed is not None else None

    def put(self, msg: Message) -> None:
        if self._rng is not None and self._rng.random() < 0.05:
            time.sleep(self._rng.random() * 0.005)  # a consumer that is sometimes slow
        with self.cv:
            self.msgs.append((time.monotonic(), msg))
            self.cv.notify_all()

    def fail(self, err: BaseException) -> None:
        with self.cv:
            self.errors.append(err)
            self.cv.notify_all()

    def wait_for(self, n: int, timeout: float) -> None:
        with self.cv:
            ok = self.cv.wait_for(lambda: len(self.msgs) >= n or self.errors, timeout)
            if self.errors:
                raise self.errors[0]
            assert ok, f"received {len(self.msgs)} of {n} messages in {timeout}s"


def _exchange(n: int, ring: bool, big_every: int = 0, megatron: bool = True) -> dict:
    """Every rank sends n messages to each pipeline neighbour (random interleaving and
    sleeps) and checks what it receives: exactly once, in per-source FIFO order, exact.
    megatron=True: pipelines from parallel_state; else one pipeline of all ranks."""
    import torch.distributed as dist

    from megatron_rrfp.runtime.transport import create_directed_groups

    rank = dist.get_rank()
    if megatron:
        from megatron.core import parallel_state

        pp = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
        groups = create_directed_groups(pp, timeout=TIMEOUT, ring=ring)
    else:
        pp = list(range(dist.get_world_size()))
        groups = create_directed_groups(pp, timeout=TIMEOUT, ring=ring)
    stage, size = pp.index(rank), len(pp)
    nbrs = {pp[s % size] for s in (stage - 1, stage + 1) if ring or 0 <= s < size} - {rank}
    assert set(groups) == {(rank, p) for p in nbrs} | {(p, rank) for p in nbrs}, groups
    inbox = _Inbox(slow_seed=rank)
    sent = []
    tr = StageTransport(rank=rank, groups=groups, device=torch.device("cpu"),
                        on_message=inbox.put, on_error=inbox.fail, name="exchange")
    for src in nbrs:
        tr.expect(src, n)
    rng = random.Random(rank)
    todo = {dst: list(range(n)) for dst in sorted(nbrs)}
    while todo:
        dst = rng.choice(sorted(todo))
        i = todo[dst].pop(0)
        if not todo[dst]:
            del todo[dst]
        kind = "activation" if pp.index(dst) > stage else "gradient"
        big = bool(big_every) and i % big_every == 0
        tr.send(dst, kind, i, i % 3, _payload(rank, dst, i, big), on_sent=lambda: sent.append(1))
        if rng.random() < 0.1:
            time.sleep(rng.random() * 0.003)
    inbox.wait_for(n * len(nbrs), timeout=120)
    tr.flush(timeout=120)
    stats = tr.stats()
    tr.close()
    assert len(sent) == n * len(nbrs)
    assert len(inbox.msgs) == n * len(nbrs)
    for src in nbrs:
        got = [m for _, m in inbox.msgs if m.src == src]
        assert [m.microbatch for m in got] == list(range(n)), f"rank {rank} from {src}"
        kind = "activation" if pp.index(src) < stage else "gradient"
        for m in got:
            assert (m.kind, m.chunk, m.ready_event) == (kind, m.microbatch % 3, None)
            assert _same(m.tensor, _payload(src, rank, m.microbatch, big_every
                                            and m.microbatch % big_every == 0))
    assert stats.messages_sent == stats.messages_received == n * len(nbrs)
    assert stats.messages_sent < stats.rendezvous < 2 * stats.messages_sent  # sizes vary: some grow the buffer
    return {"stats": stats, "groups": sorted(groups)}


def _phases(*phases: tuple) -> list:
    """Several checks in one launch: starting ranks costs seconds each on 2 cores."""
    return [fn(*args, **kwargs) for fn, args, kwargs in phases]


@pytest.fixture(scope="module")
def world4() -> list:
    """4 ranks, no Megatron (its discovery is covered by the two-pipeline test): linear
    PP=4 exchange, then the PP=4 interleaved ring."""
    return launch(_phases, world_size=4, init_megatron=False, timeout=200, args=(
        (_exchange, (), dict(n=150, ring=False, megatron=False)), (_interleaved, (2, 4), {})))


def _one_frame_per_message(n: int) -> dict:
    """PP=2, both directions: n messages of one shape, then one larger, then n more."""
    import torch.distributed as dist

    from megatron_rrfp.runtime.transport import create_directed_groups

    rank = dist.get_rank()
    peer = 1 - rank
    inbox = _Inbox()
    tr = StageTransport(rank=rank, groups=create_directed_groups([0, 1], timeout=TIMEOUT), device=torch.device("cpu"),
                        on_message=inbox.put, on_error=inbox.fail, name="frames")
    tr.expect(peer, 2 * n + 1)
    shapes = [(4, 3)] * n + [(8, 3)] + [(4, 3)] * n
    for i, shape in enumerate(shapes):
        tr.send(peer, "activation" if rank == 0 else "gradient", i, 0, torch.full(shape, float(i)))
    inbox.wait_for(len(shapes), timeout=60)
    tr.flush(timeout=60)
    stats = tr.stats()
    tr.close()
    got = [m for _, m in inbox.msgs]
    assert [tuple(m.tensor.shape) for m in got] == shapes
    assert all(torch.equal(m.tensor, torch.full(shapes[i], float(i))) for i, m in enumerate(got))
    return {"rendezvous": stats.rendezvous, "messages": stats.messages_sent}


@pytest.fixture(scope="module")
def world2() -> list:
    """2 ranks, no Megatron: PP=2 interleaved ring, then one frame per message."""
    return launch(_phases, world_size=2, init_megatron=False, timeout=200, args=(
        (_interleaved, (2, 4), {}), (_one_frame_per_message, (20,), {})))


@pytest.mark.timeout(240)
def test_a_message_of_a_known_size_costs_one_rendezvous(world2):
    # the first message and the first larger one announce their size; every other is one frame
    for phases in world2:
        assert phases[1] == {"rendezvous": 41 + 2, "messages": 41}


@pytest.mark.timeout(240)  # a safety net for loaded CI; ~40 s total when idle
def test_pp4_linear_many_messages_both_directions(world4):
    out = [phases[0] for phases in world4]
    assert [len(o["groups"]) for o in out] == [2, 4, 4, 2]
    s = out[1]["stats"]
    assert s.bytes_sent > 0 and s.send_seconds > 0 and s.recv_seconds > 0


@pytest.mark.timeout(240)  # a safety net for loaded CI; ~40 s total when idle
def test_pp2_two_pipelines_simultaneous_both_directions_no_deadlock():
    # world 4, PP 2: pipelines [0, 2] and [1, 3]; each pair sends both ways at once,
    # every 20th message 1 MiB (more than a socket buffer).
    out = launch(_exchange, world_size=4, pp=2, timeout=200,
                 kwargs=dict(n=100, ring=True, big_every=20))
    assert [o["groups"] for o in out] == [[(0, 2), (2, 0)], [(1, 3), (3, 1)],
                                          [(0, 2), (2, 0)], [(1, 3), (3, 1)]]


def _interleaved(num_chunks: int, num_microbatches: int) -> dict:
    """Token passing through an interleaved pipeline: virtual stage v = chunk * P + stage
    adds 1 going forward, the last virtual stage turns x into 10 * x, each earlier one adds
    1 going backward. Exercises the ring links last -> first (activations, chunk c -> c+1)
    and first -> last (gradients)."""
    import queue

    import torch.distributed as dist

    from megatron_rrfp.runtime.transport import create_directed_groups

    calls = []
    new_group = dist.new_group
    dist.new_group = lambda ranks, **kw: calls.append(tuple(ranks)) or new_group(ranks, **kw)
    try:
        # Explicit ranks (no Megatron: saves its import in every rank); the _exchange
        # tests cover discovery through parallel_state.
        groups = create_directed_groups(list(range(dist.get_world_size())), timeout=TIMEOUT)
    finally:
        dist.new_group = new_group
    rank, pp = dist.get_rank(), list(range(dist.get_world_size()))
    P, s, V = len(pp), pp.index(rank), num_chunks * len(pp)
    stage_rank = lambda v: pp[v % P]  # noqa: E731
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    tr = StageTransport(rank=rank, groups=groups, device=torch.device("cpu"),
                        on_message=inbox.put, on_error=inbox.put, name="interleaved")
    expected = 0
    for v in range(s, V, P):
        for src_v in (v - 1, v + 1):
            if 0 <= src_v < V:
                tr.expect(stage_rank(src_v), num_microbatches)
                expected += num_microbatches

    def forward(v: int, mb: int, x: torch.Tensor) -> None:
        y = x + 1
        if v == V - 1:
            tr.send(stage_rank(v - 1), "gradient", mb, (v - 1) // P, y * 10)
        else:
            tr.send(stage_rank(v + 1), "activation", mb, (v + 1) // P, y)

    finals = {}
    if s == 0:
        for mb in range(num_microbatches):
            forward(0, mb, torch.full((2, 3), float(mb)))
    for _ in range(expected):
        msg = inbox.get(timeout=120)
        if isinstance(msg, BaseException):
            raise msg
        v = msg.chunk * P + s
        if msg.kind == "activation":
            forward(v, msg.microbatch, msg.tensor)
        elif v == 0:
            finals[msg.microbatch] = msg.tensor[0, 0].item()
        else:
            tr.send(stage_rank(v - 1), "gradient", msg.microbatch, (v - 1) // P, msg.tensor + 1)
    tr.flush(timeout=120)
    tr.close()
    return {"finals": finals, "groups": sorted(groups), "new_group_calls": calls}


@pytest.mark.timeout(240)  # a safety net for loaded CI; ~40 s total when idle
@pytest.mark.parametrize("pp", [2, 4])
def test_ring_groups_carry_interleaved_pipeline(pp, request):
    C, M = 2, 4  # as in the world2 / world4 fixtures
    out = [phases[1 if pp == 4 else 0] for phases in request.getfixturevalue(f"world{pp}")]
    V = C * pp
    assert out[0]["finals"] == {mb: 10 * (mb + V) + V - 2 for mb in range(M)}
    # 2 directed groups per ring link; PP=2's ring links coincide with its linear ones.
    assert len(out[0]["new_group_calls"]) == (2 if pp == 2 else 2 * pp)
    assert all(len(o["groups"]) == (2 if pp == 2 else 4) for o in out)


def _dies(result_path: str) -> None:
    import torch.distributed as dist

    from megatron_rrfp.runtime.transport import create_directed_groups

    rank = dist.get_rank()
    groups = create_directed_groups([0, 1], timeout=TIMEOUT)
    inbox = _Inbox()
    tr = StageTransport(rank=rank, groups=groups, device=torch.device("cpu"),
                        on_message=inbox.put, on_error=inbox.fail, name="death")
    if rank == 1:
        tr.expect(0, 5)
        for mb in range(3):
            tr.send(0, "gradient", mb, 0, torch.ones(1024))
        inbox.wait_for(5, timeout=20)
        tr.flush(timeout=20)
        time.sleep(0.3)
        os._exit(17)  # abrupt: no close, no destroy_process_group
    tr.expect(1, 1000)  # more than rank 1 will ever send: a receive stays posted
    inbox.wait_for(3, timeout=20)
    t_last = time.monotonic()
    mb = 0
    while not inbox.errors and time.monotonic() - t_last < 20:
        tr.send(1, "activation", mb, 0, torch.ones(1024))
        mb += 1
        time.sleep(0.01)
    with pytest.raises(TransportError):  # refuses new work once failed
        tr.send(1, "activation", mb, 0, torch.ones(1024))
    err = inbox.errors[0] if inbox.errors else None
    with open(result_path, "w") as f:
        json.dump({"type": type(err).__name__, "msg": str(err), "errors": len(inbox.errors),
                   "after_s": time.monotonic() - t_last}, f)
    os._exit(0)  # skip teardown: its barrier would fail against the dead peer


@pytest.mark.timeout(120)
def test_peer_dying_mid_stream_reports_transport_error(tmp_path):
    path = str(tmp_path / "rank0.json")
    with pytest.raises(DistributedTestFailure) as failure:
        launch(_dies, world_size=2, init_megatron=False, timeout=100, args=(path,))
    assert failure.value.outcomes[1].exitcode == 17
    with open(path) as f:
        res = json.load(f)
    assert res["type"] == "TransportError" and res["errors"] == 1, res
    assert "rank 0" in res["msg"] and "rank 1" in res["msg"], res
    assert res["after_s"] < 5.0, res  # the survivor learns within seconds, not at a timeout


@pytest.mark.parametrize("dtype", DTYPES + [torch.int16, torch.int8])
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 0, 5), (1,) * MAX_DIMS, (7, 1, 3, 2)])
def test_header_round_trip(dtype, shape):
    h = encode_header("gradient", 12345678901, 3, torch.empty(shape, dtype=dtype))
    assert h.dtype == torch.int64 and h.shape == (HEADER_LEN,)
    d = decode_header(h)
    assert (d.kind, d.microbatch, d.chunk, d.dtype, d.shape) == ("gradient", 12345678901, 3,
                                                                 dtype, shape)
    assert str(d).startswith("gradient(mb=12345678901, chunk=3, ")


def test_header_rejects_bad_input():
    with pytest.raises(ValueError, match="at most 8"):
        encode_header("activation", 0, 0, torch.empty((1,) * 9))
    with pytest.raises(ValueError, match="unsupported dtype"):
        encode_header("activation", 0, 0, torch.empty(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="kind"):
        encode_header("grad", 0, 0, torch.empty(2))
    bad = encode_header("activation", 0, 0, torch.empty(2))
    bad[0] += 1
    with pytest.raises(TransportError, match="magic"):
        decode_header(bad)


def test_transport_without_peers_validates_calls():
    errors = []
    tr = StageTransport(rank=0, groups={}, device=torch.device("cpu"),
                        on_message=lambda m: None, on_error=errors.append)
    with pytest.raises(ValueError, match="no directed group 0->1"):
        tr.send(1, "activation", 0, 0, torch.ones(2))
    with pytest.raises(ValueError, match="no directed group 1->0"):
        tr.expect(1, 1)
    tr.flush(timeout=1.0)  # nothing queued
    tr.close()
    with pytest.raises(TransportError, match="closed"):
        tr.send(1, "activation", 0, 0, torch.ones(2))
    assert errors == []
