"""A stand-in GPU per rank with ONE in-order queue, to check transports without a GPU.

The worst case of ``CUDA_DEVICE_MAX_CONNECTIONS=1`` and NCCL's blocking kernels: every
operation a rank issues — compute, its tensor-parallel collectives, point-to-point sends
and receives, events — enters one FIFO and runs only when it reaches the head. A compute
op takes its duration; a collective completes when every member has it at the head; a
send and its receive (or the two ends of a batched round) complete only while both are
at their heads. Nothing overtakes anything. A real GPU is never worse than this.

``QueueFabric`` is the device thread serving every rank's queue; it declares a deadlock
when the queues hold work, no op has started, finished or been issued for ``quiet_s``,
and every head is a communication op waiting for its partner — and then fails every
waiter (``on_abort`` callbacks) so the ranks' executors raise instead of hanging.

``EmulatedDevice`` (``rounds.Device``), ``EmulatedChannel`` (``rounds.HostChannel``, with
random FIFO latency: the package's ``selfcheck/host_channel.py``, which the self-check's loopback
step uses too) and ``ThreadCollective`` (``agreement.Collective``) let the shipped
``RoundTransport``, ``TPAgreement`` and executor run on it unchanged, one thread per rank.
Test code (tests/helpers/emulated_pipeline.py, tests/unit/test_transport_emulated.py), never run by
the package.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_rrfp.selfcheck.host_channel import ChannelHub, EmulatedChannel


class DeviceDeadlock(RuntimeError):
    """Every queue's head waits for a partner that cannot reach its own head."""


class MismatchedCollective(DeviceDeadlock):
    """The members of a group's n-th collective issued different operations (NCCL matches
    collectives by issue order only: a different size hangs, the same size corrupts)."""


@dataclass(eq=False)
class Op:
    rank: int
    kind: str  # compute | collective | round | send | recv | marker
    key: tuple = ()  # what must meet: (group, seq) / (pair, index) / (channel, seq)
    duration: float = 0.0
    run: Optional[Callable[[], None]] = None  # at completion, on the device thread
    tensors: list = field(default_factory=list)  # round: sends; send: [tensor]; recv: [buffer]
    buffers: list = field(default_factory=list)  # round: receive buffers
    tag: tuple = ()  # collective: what was meant (e.g. ("reduce", chunk, bucket)); members must agree
    started: Optional[float] = None
    finished: bool = False

    def describe(self) -> str:
        return f"{self.kind}{self.key}" if self.key else self.kind


class OpCompletion:
    """``rounds.Completion`` of one queued op."""

    def __init__(self, fabric: QueueFabric, op: Op) -> None:
        self.fabric, self.op = fabric, op

    def done(self) -> bool:
        return self.op.finished

    def wait(self) -> None:
        pass  # later work of this rank is behind it in the same queue

    def synchronize(self, timeout: float) -> bool:
        return self.fabric.wait_for(self.op, timeout)


class QueueFabric:
    def __init__(self, ranks, *, quiet_s: float = 1.5) -> None:
        self.queues: dict[int, deque] = {r: deque() for r in ranks}
        self.quiet_s = quiet_s
        self.cv = threading.Condition()
        self.members: dict = {}  # collective group -> ranks
        self.error: Optional[DeviceDeadlock] = None
        self.completed = 0
        self.on_abort: list[Callable[[BaseException], None]] = []
        self._last_activity = time.monotonic()
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True, name="queue-fabric")
        self._thread.start()

    # -- host side ------------------------------------------------------------------
    def issue(self, op: Op) -> OpCompletion:
        with self.cv:
            if self.error is not None:
                raise self.error
            self.queues[op.rank].append(op)
            self._last_activity = time.monotonic()
            self.cv.notify_all()
        return OpCompletion(self, op)

    def wait_for(self, op: Op, timeout: Optional[float]) -> bool:
        with self.cv:
            self.cv.wait_for(lambda: op.finished or self.error is not None, timeout)
            if self.error is not None and not op.finished:
                raise self.error
            return op.finished

    def stop(self) -> None:
        with self.cv:
            self._stop = True
            self.cv.notify_all()
        self._thread.join(5)

    # -- the device thread ----------------------------------------------------------
    def _serve(self) -> None:
        with self.cv:
            while not self._stop and self.error is None:
                now = time.monotonic()
                try:
                    progressed, next_due = self._step(now)
                except MismatchedCollective as exc:
                    self._abort(now, exc)
                    return
                if progressed:
                    self._last_activity = now
                    self.cv.notify_all()
                    continue
                if any(self.queues.values()) and now - self._last_activity > self.quiet_s and self._all_blocked():
                    self._abort(now)
                    return
                self.cv.wait(min(0.05, max(0.0, next_due - now)) if next_due else 0.05)

    def _step(self, now: float) -> tuple[bool, Optional[float]]:
        progressed, next_due = False, None
        heads = {r: q[0] for r, q in self.queues.items() if q}
        for op in heads.values():
            if op.kind in ("compute", "marker"):
                if op.started is None:
                    op.started = now
                    progressed = True
                if now >= op.started + op.duration:
                    self._finish(op)
                    progressed = True
                else:
                    due = op.started + op.duration
                    next_due = due if next_due is None else min(next_due, due)
        for op in self._matches(heads):
            self._finish(op)
            progressed = True
        return progressed, next_due

    def _matches(self, heads: dict[int, Op]) -> list[Op]:
        done = []
        by_key: dict = {}
        for op in heads.values():
            if op.kind in ("collective", "round", "send", "recv"):
                by_key.setdefault((op.kind in ("send", "recv"),) + op.key, []).append(op)
        for ops in by_key.values():
            first = ops[0]
            if first.kind == "collective" and len(ops) == len(self.members[first.key[0]]):
                if len({op.tag for op in ops}) > 1:
                    raise MismatchedCollective(f"mismatched collective {first.key}: " + ", ".join(
                        f"rank {op.rank} issued {op.tag}" for op in ops))
                done += ops
            elif first.kind == "round" and len(ops) == 2:
                a, b = ops
                self._copy(a.tensors, b.buffers)
                self._copy(b.tensors, a.buffers)
                done += ops
            elif first.kind in ("send", "recv") and len(ops) == 2:
                send, recv = ops if ops[0].kind == "send" else ops[::-1]
                self._copy(send.tensors, recv.tensors)
                done += ops
        return done

    @staticmethod
    def _copy(sources: list, targets: list) -> None:
        if [tuple(t.shape) for t in sources] != [tuple(t.shape) for t in targets]:
            raise DeviceDeadlock(f"mismatched transfer: {[tuple(t.shape) for t in sources]} -> "
                                 f"{[tuple(t.shape) for t in targets]}")
        for source, target in zip(sources, targets):
            target.copy_(source)

    def _finish(self, op: Op) -> None:
        self.queues[op.rank].popleft()
        op.finished = True
        self.completed += 1
        if op.run is not None:
            op.run()

    def _all_blocked(self) -> bool:
        return all(q[0].kind in ("collective", "round", "send", "recv") for q in self.queues.values() if q)

    def _abort(self, now: float, error: Optional[DeviceDeadlock] = None) -> None:
        heads = "; ".join(f"rank {r}: {q[0].describe()} (+{len(q) - 1} queued)"
                          for r, q in sorted(self.queues.items()) if q)
        self.error = error or DeviceDeadlock(f"device deadlock: no progress for {now - self._last_activity:.1f}s, "
                                             f"every head waits for a partner: {heads}")
        self.cv.notify_all()
        for abort in list(self.on_abort):
            threading.Thread(target=abort, args=(self.error,), daemon=True).start()


class EmulatedDevice:
    """``rounds.Device`` of one rank on a ``QueueFabric``."""

    def __init__(self, fabric: QueueFabric, rank: int) -> None:
        self.fabric, self.rank = fabric, rank
        self._rounds: dict[int, int] = {}

    def empty(self, shape, dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)

    def exchange(self, peer: int, sends: list, recvs: list) -> OpCompletion:
        index = self._rounds.get(peer, 0)
        self._rounds[peer] = index + 1
        return self.fabric.issue(Op(self.rank, "round", (min(self.rank, peer), max(self.rank, peer), index),
                                    tensors=list(sends), buffers=list(recvs)))

    def mark(self) -> OpCompletion:
        return self.fabric.issue(Op(self.rank, "marker"))

    def compute(self, duration: float, run: Optional[Callable[[], None]] = None) -> OpCompletion:
        return self.fabric.issue(Op(self.rank, "compute", duration=duration, run=run))


class TPGroupOps:
    """The collectives of one group (TP inside tasks; DP reductions / all-gathers; EP
    all-to-alls), each one a queue op; the n-th of every member must carry the same tag."""

    def __init__(self, fabric: QueueFabric, name, ranks) -> None:
        self.fabric, self.name = fabric, name
        fabric.members[name] = list(ranks)
        self._seq = {r: 0 for r in ranks}

    def all_reduce(self, rank: int, tag: tuple = ()) -> OpCompletion:
        seq = self._seq[rank]
        self._seq[rank] += 1
        return self.fabric.issue(Op(rank, "collective", (self.name, seq), tag=tag))

    collective = all_reduce  # all-gathers, reduce-scatters and all-to-alls meet the same way


class ThreadCollective:
    """``agreement.Collective`` between threads of one process (one instance per rank)."""

    class Group:
        def __init__(self, size: int) -> None:
            self.size, self.cv, self.rounds, self.error = size, threading.Condition(), {}, None
            self.announced: dict = {}

        def abort(self, error: BaseException) -> None:
            with self.cv:
                self.error = error
                self.cv.notify_all()

    def __init__(self, group: ThreadCollective.Group, index: int) -> None:
        self.group, self.index, self.size, self._round = group, index, group.size, 0
        self._broadcasts = 0

    def broadcast(self, value: torch.Tensor) -> torch.Tensor:
        g, k = self.group, self._broadcasts
        self._broadcasts += 1
        with g.cv:
            if self.index == 0:
                g.announced[k] = value.clone()
                g.cv.notify_all()
                return value
            g.cv.wait_for(lambda: k in g.announced or g.error is not None)
            if g.error is not None:
                raise g.error
            return g.announced[k].clone()

    def all_gather(self, mine: torch.Tensor) -> torch.Tensor:
        g, k = self.group, self._round
        self._round += 1
        with g.cv:
            slots = g.rounds.setdefault(k, [None] * g.size)
            slots[self.index] = mine.clone()
            g.cv.notify_all()
            g.cv.wait_for(lambda: all(s is not None for s in slots) or g.error is not None)
            if g.error is not None:
                raise g.error
            out = torch.stack(slots)
            if sum(1 for _ in g.rounds) > 4:  # drop rounds every member has read
                for old in [r for r in g.rounds if r < k - 2]:
                    del g.rounds[old]
            return out


__all__ = ["ChannelHub", "DeviceDeadlock", "EmulatedChannel", "EmulatedDevice", "MismatchedCollective", "Op",
           "OpCompletion", "QueueFabric", "TPGroupOps", "ThreadCollective"]
