"""What ``rounds.RoundTransport`` is built on: a device for payloads, a host channel for headers.

* ``NcclDevice`` — CUDA tensors; a round is ``dist.batch_isend_irecv`` on the pair's NCCL
  group (ProcessGroupNCCL runs it on its own stream after the current stream's queued
  work, i.e. after the producer kernels, and keeps the tensors alive until it finished);
  receive buffers are allocated on the compute stream; ``Completion.wait()`` makes the
  current stream wait for the round (call it right before the tensor's use).
* ``HostDevice`` — the same protocol with host tensors over gloo: runs the device path on
  CPU (its tests, and debugging it without a GPU).
* ``GlooHostChannel`` — fixed-size int64 records over directed 2-rank gloo groups: one
  sender thread per destination (a queue), one receiver thread per source, records in
  FIFO order. A closing rank sends each neighbour a BYE so its receiver stops.

``create_pair_groups`` makes the one group per neighbour pair that rounds travel on.
"""
from __future__ import annotations

import datetime
import queue
import threading
import time
from collections.abc import Callable
from typing import Optional

import torch
import torch.distributed as dist

from .rounds import BYE, RECORD_LEN, record
from .transport import create_directed_groups

_POLL_S = 0.0002  # how often a host wait re-checks a CUDA event


def pipeline_pairs(pp_group_ranks: list[int], ring: bool) -> list[tuple[int, int]]:
    """Neighbour pairs of one pipeline, in one order on every rank (lower stage first)."""
    ranks = list(pp_group_ranks)
    pairs = list(zip(ranks, ranks[1:]))
    if ring and len(ranks) > 2:
        pairs.append((ranks[0], ranks[-1]))
    return sorted(pairs, key=lambda p: (ranks.index(p[0]), ranks.index(p[1])))


def create_pair_groups(pp_group_ranks: list[int], *, backend: str, timeout: datetime.timedelta,
                       ring: bool = True) -> dict[int, dist.ProcessGroup]:
    """One 2-rank group per neighbour pair of every pipeline; returns ours keyed by peer.
    Collective over the world (every rank creates every group, in the same order)."""
    me = dist.get_rank()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [int(r) for r in pp_group_ranks])
    pairs = [pair for ranks in sorted({tuple(g) for g in gathered}) for pair in pipeline_pairs(list(ranks), ring)]
    groups = {}
    for a, b in dict.fromkeys(pairs):
        group = dist.new_group([a, b], timeout=timeout, backend=backend)
        if me in (a, b):
            groups[b if me == a else a] = group
    return groups


def warm_up(groups: dict[int, dist.ProcessGroup], pp_group_ranks: list[int], device: torch.device) -> None:
    """Create the NCCL communicators now, from this thread, pair by pair in the global
    order of ``pipeline_pairs`` (each finished before the next): lazily, they would be
    made inside the first training step, from wherever the first round happens."""
    me = dist.get_rank()
    for a, b in pipeline_pairs(pp_group_ranks, ring=True):
        if me not in (a, b) or (b if me == a else a) not in groups:
            continue
        peer = b if me == a else a
        out, into = torch.ones(1, device=device), torch.zeros(1, device=device)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer, group=groups[peer]),
                                        dist.P2POp(dist.irecv, into, peer, group=groups[peer])])
        for work in works:
            work.wait()
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        if float(into.item()) != 1.0:
            raise RuntimeError(f"rank {me}: warm-up exchange with rank {peer} received {into.item()}, expected 1.0")


# --------------------------------------------------------------------------- devices

class _WorkCompletion:
    """A round issued with batch_isend_irecv."""

    def __init__(self, works: list, cuda: bool) -> None:
        self._works, self._cuda, self._waited = works, cuda, not works

    def done(self) -> bool:
        # gloo: is_completed() stays False until wait(); rounds there finish by wait/synchronize
        return self._waited or (self._cuda and all(w.is_completed() for w in self._works))

    def wait(self) -> None:
        if self._waited:  # gloo: a second wait() on a finished receive would block for good
            return
        for work in self._works:
            work.wait()  # NCCL: the current stream waits (the host does not); gloo: the host waits
        self._waited = not self._cuda

    def synchronize(self, timeout: float) -> bool:
        if not self._cuda:
            if self._waited:
                return True
            for work in self._works:
                work.wait(datetime.timedelta(seconds=timeout))
            self._waited = True
            return True
        deadline = time.monotonic() + timeout
        pause = threading.Event()
        while not self.done():
            if time.monotonic() > deadline:
                return False
            pause.wait(_POLL_S)
        return True


class EventCompletion:
    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def done(self) -> bool:
        return self._event.query()

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self._event)

    def synchronize(self, timeout: float) -> bool:
        deadline, pause = time.monotonic() + timeout, threading.Event()
        while not self._event.query():
            if time.monotonic() > deadline:
                return False
            pause.wait(_POLL_S)
        return True


class _Done:
    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass

    def synchronize(self, timeout: float) -> bool:
        return True


class NcclDevice:
    """Rounds on one CUDA device over NCCL pair groups (``create_pair_groups(backend="nccl")``)."""

    def __init__(self, device: torch.device, groups: dict[int, dist.ProcessGroup]) -> None:
        self.device, self.groups = torch.device(device), groups

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)  # on the current (compute) stream

    def exchange(self, peer: int, sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> _WorkCompletion:
        group = self.groups[peer]
        ops = [dist.P2POp(dist.isend, t, peer, group=group) for t in sends if t.numel()]
        ops += [dist.P2POp(dist.irecv, t, peer, group=group) for t in recvs if t.numel()]
        return _WorkCompletion(dist.batch_isend_irecv(ops) if ops else [], cuda=self.device.type == "cuda")

    def mark(self) -> EventCompletion:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return EventCompletion(event)


class HostDevice(NcclDevice):
    """The round protocol with host tensors over gloo pair groups."""

    def __init__(self, groups: dict[int, dist.ProcessGroup]) -> None:
        super().__init__(torch.device("cpu"), groups)

    def mark(self) -> _Done:
        return _Done()  # host compute is synchronous


# --------------------------------------------------------------------------- host channel

class GlooHostChannel:
    """``rounds.HostChannel`` over directed gloo groups (``create_directed_groups(backend="gloo")``)."""

    def __init__(self, *, rank: int, groups: dict[tuple[int, int], dist.ProcessGroup],
                 on_record: Callable[[int, list[int]], None], on_error: Callable[[BaseException], None],
                 device: Optional[torch.device] = None, name: str = "") -> None:
        self.rank, self._groups = rank, groups
        self._on_record, self._on_error = on_record, on_error
        self._device = device
        self._closed = False
        self._queues = {dst: queue.SimpleQueue() for (src, dst) in groups if src == rank}
        tag = f"rrfp-{name}-r{rank}" if name else f"rrfp-r{rank}"
        self._threads = [threading.Thread(target=self._send_loop, args=(dst,), daemon=True, name=f"{tag}-ctl{dst}")
                         for dst in self._queues]
        self._threads += [threading.Thread(target=self._recv_loop, args=(src,), daemon=True, name=f"{tag}-ctl<{src}")
                          for (src, dst) in groups if dst == rank]
        for thread in self._threads:
            thread.start()

    def post(self, dst: int, rec: list[int]) -> None:
        self._queues[dst].put(torch.tensor(rec, dtype=torch.int64))

    def close(self, timeout: float = 5.0) -> None:
        self._closed = True
        for q in self._queues.values():
            q.put(torch.tensor(record(BYE), dtype=torch.int64))
            q.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _bind(self) -> None:
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # a thread without it would make a context on GPU 0

    def _send_loop(self, dst: int) -> None:
        self._bind()
        group = self._groups[(self.rank, dst)]
        while (item := self._queues[dst].get()) is not None:
            try:
                dist.send(item, dst, group=group)
            except BaseException as exc:  # noqa: BLE001 - reported through on_error
                if not self._closed:
                    self._on_error(exc)
                return

    def _recv_loop(self, src: int) -> None:
        self._bind()
        group = self._groups[(src, self.rank)]
        while True:
            buffer = torch.empty(RECORD_LEN, dtype=torch.int64)
            try:
                dist.recv(buffer, src, group=group)
            except BaseException as exc:  # noqa: BLE001 - reported through on_error
                if not self._closed:
                    self._on_error(exc)
                return
            rec = buffer.tolist()
            if rec[0] == BYE:
                return
            self._on_record(src, rec)


def create_channel_groups(pp_group_ranks: list[int], *, timeout: datetime.timedelta,
                          ring: bool = True) -> dict[tuple[int, int], dist.ProcessGroup]:
    """The host channel's directed gloo groups (see ``transport.create_directed_groups``)."""
    return create_directed_groups(pp_group_ranks, timeout=timeout, ring=ring, backend="gloo")


__all__ = ["EventCompletion", "GlooHostChannel", "HostDevice", "NcclDevice", "create_channel_groups",
           "create_pair_groups", "pipeline_pairs", "warm_up"]
