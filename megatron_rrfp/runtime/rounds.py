"""The device transport: pipeline messages in *rounds*, built on NCCL's semantics.

A NCCL send or receive blocks its GPU queue until the peer's matching kernel runs, so a
receive may only enter a queue together with its send, and every GPU must see the operations
it shares with others in one consistent order. Per neighbour pair the lower stage leads (on
the interleaved ring's closing pair, stage 0): it forms round k from its own messages and those
the follower announced over the host channel, issues it as one batched group and sends the
round's content to the follower, which issues round k, mirrored, at its next decision point.
The executor never waits on the device while it has rounds to issue (``max_tasks_ahead``).

Why neither the device queues nor the hosts can deadlock — with tensor, expert and data
parallelism, and the B/W split's collectives inside W: docs/design/rounds-protocol.md. With
an ``EpochBook`` (``use_epochs``: interleaving with DP communication in the task loop) rounds
follow the DP epoch rule as well: one epoch per round, a rank's rounds in epoch order across
both its pairs, each after the DP points of earlier epochs (docs/design/dp-epochs.md).

The device and the host channel are injected (``Device``, ``HostChannel``): ``device.py``
ships NCCL and gloo ones; tests drive the same protocol on an emulated single-queue device
(``tests/helpers/queue_device.py``).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

from .transport import HEADER_LEN, Header, Message, TransportError, TransportStats, decode_header, encode_header

RECORD_LEN = 4 + HEADER_LEN  # type, three fields, a message header
ANNOUNCE, HEADER, ROUND, BYE, COVER = 1, 2, 3, 4, 5
LISTED = -1  # a ROUND record's "covers" field when COVER records name the follower's messages


class Completion(Protocol):
    def done(self) -> bool: ...  # non-blocking

    def wait(self) -> None: ...  # order the current stream after it (device) / wait for it (host)

    def synchronize(self, timeout: float) -> bool: ...  # the host waits; False on timeout


class Device(Protocol):
    """Where payloads live and move."""

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...

    def exchange(self, peer: int, sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> Completion:
        """One group with ``peer``: every send and receive, issued together."""

    def mark(self) -> Completion:
        """Everything launched so far on the current stream."""


class HostChannel(Protocol):
    """Small int64 records to neighbour ranks, FIFO per direction. Arriving records go to
    the ``on_record(src, record)`` / ``on_error(exc)`` given when it was made."""

    def post(self, dst: int, record: list[int]) -> None: ...

    def close(self, timeout: float = 5.0) -> None: ...


def record(kind: int, a: int = 0, b: int = 0, c: int = 0, header: Optional[torch.Tensor] = None) -> list[int]:
    return [kind, a, b, c] + (header.tolist() if header is not None else [0] * HEADER_LEN)


@dataclass(slots=True)
class _Out:
    header: torch.Tensor
    tensor: torch.Tensor  # referenced until its round completed
    index: int = 0  # position among this pair's messages from this rank, since start-up
    epoch: int = 0  # under the epoch rule


@dataclass(slots=True)
class _Pair:
    """One neighbour pair. Counts are totals since start-up; lists hold only what is open."""

    peer: int
    leader: bool
    own: list = field(default_factory=list)  # produced here, not yet in an issued round
    announced: list = field(default_factory=list)  # leader: (index, header) of follower messages not yet in a round
    received: int = 0  # leader: announcements received; follower: decisions received
    covered: int = 0  # announcements (of the follower's messages) in issued rounds
    produced: int = 0  # follower: own messages announced
    decisions: list = field(default_factory=list)  # follower: (leader headers, covered after it or the
    # indices of the follower messages it covers), not issued
    partial: list = field(default_factory=list)  # follower: headers of the round being received
    partial_covers: list = field(default_factory=list)  # follower: COVER indices of the round being received
    arrived: int = 0  # messages from the peer in rounds issued here, since start-up
    issued: int = 0  # rounds issued here
    in_flight: list = field(default_factory=list)  # (completion, tensors kept alive)


class _Arrival:
    """``Message.ready_event``: the round that carries it."""

    __slots__ = ("completion",)

    def __init__(self, completion: Completion) -> None:
        self.completion = completion

    def wait(self) -> None:
        self.completion.wait()


class RoundTransport:
    """Device transport of one pipeline rank (module docstring); the executor drives it.

    ``stage_of`` maps the global ranks of this pipeline to their stage index; neighbours
    are the ranks of ``stage_of`` other than ``rank`` that share a pair with it.
    ``channel_factory(on_record, on_error)`` builds the host channel. ``timeout_s`` bounds
    every wait of its own (the ring rule's; ``flush`` gets the executor's): RRFP's stall
    timeout, which the device's own timeout (NCCL's watchdog) must exceed
    (``mcore.session.device_timeout``), so RRFP's diagnosis prints first.
    """

    poll_interval_throttled = 0.0005

    def __init__(self, *, rank: int, stage_of: dict[int, int], neighbours: list[int], device: Device,
                 channel_factory: Callable[..., HostChannel], on_message: Callable[[Message], None],
                 on_error: Callable[[BaseException], None], timeout_s: float,
                 wake: Callable[[], None] = lambda: None, max_tasks_ahead: int = 2, name: str = "") -> None:
        if max_tasks_ahead < 1:
            raise ValueError(f"max_tasks_ahead must be >= 1, got {max_tasks_ahead}")
        self.rank, self.name, self.device = rank, name, device
        self._on_message, self._on_error, self._wake = on_message, on_error, wake
        self.max_tasks_ahead, self.timeout_s = max_tasks_ahead, timeout_s
        me = stage_of[rank]
        # By stage, so agreeing ranks of different pipelines (EP across replicas) list the same roles in one order.
        self._pairs = {p: _Pair(p, leader=me < stage_of[p]) for p in sorted(set(neighbours), key=stage_of.__getitem__)}
        # Stage 0 of an interleaved ring leads both its pairs: it never has rounds of both in flight.
        self._exclusive = sum(pair.leader for pair in self._pairs.values()) > 1
        self.state_words = len(self._pairs)
        self._lock = threading.Lock()
        self._error: Optional[BaseException] = None
        self._budget = {p: 0 for p in self._pairs}  # messages the executor expects, per source
        self._delivered = {p: 0 for p in self._pairs}
        self._held: dict[int, list] = {p: [] for p in self._pairs}
        self._tasks: list[Completion] = []  # tasks launched and maybe not finished on the device
        self._book = None  # policy.epochs.EpochBook of this iteration under the epoch rule (use_epochs)
        self._stage_of, self._stage = stage_of, me
        self._stats = TransportStats()
        self._channel = channel_factory(self._on_record, self._fail)

    # ---- the executor's API -------------------------------------------------------
    @property
    def poll_interval(self) -> Optional[float]:
        return None if self._has_room() else self.poll_interval_throttled

    def send(self, dst: int, kind: str, microbatch: int, chunk: int, tensor: torch.Tensor) -> None:
        """Queue ``tensor`` (produced on the current stream) for ``dst``."""
        self._raise_if_failed()
        pair = self._pairs.get(dst)
        if pair is None:
            raise ValueError(f"rank {self.rank}: {dst} is not a pipeline neighbour; neighbours: {sorted(self._pairs)}")
        tensor = tensor.detach().contiguous()
        header = encode_header(kind, microbatch, chunk, tensor)
        epoch = 0 if self._book is None else self._epoch(self._stage_of[dst], kind, microbatch, chunk)
        with self._lock:
            index, pair.produced = pair.produced, pair.produced + 1
            pair.own.append(_Out(header, tensor, index, epoch))
            self._stats.messages_sent += 1
            self._stats.bytes_sent += tensor.numel() * tensor.element_size()
        if not pair.leader:
            self._channel.post(dst, record(ANNOUNCE, index, header=header))

    def expect(self, src: int, count: int) -> None:
        if src not in self._pairs:
            raise ValueError(f"rank {self.rank}: {src} is not a pipeline neighbour; neighbours: {sorted(self._pairs)}")
        if count < 0:
            raise ValueError(f"expect count must be >= 0, got {count}")
        self._budget[src] += count
        self._release(src)

    def use_epochs(self, book) -> None:
        """Follow the DP epoch rule with ``book`` (``policy.epochs.EpochBook``) from this
        iteration on, or not (None); called before the iteration's ``expect``."""
        self._book = book

    def local_state(self) -> tuple[int, ...]:
        """Per pair (by peer rank): announcements received (leader) / decisions received (follower)."""
        with self._lock:
            return tuple(p.received for p in self._pairs.values())

    def advance(self, state: tuple[int, ...]) -> None:
        """Issue every round ``state`` allows (the agreed counters: the same on all TP ranks)."""
        self._raise_if_failed()
        progress = True
        while progress:  # under the epoch rule a round on one pair can let the other pair's next one go
            progress = False
            for pair, agreed in zip(self._pairs.values(), state):
                issued = pair.issued
                if self._book is not None:
                    self._lead_epoch(pair, agreed) if pair.leader else self._follow_epoch(pair, agreed)
                elif pair.leader:
                    self._lead(pair, agreed)
                else:
                    self._follow(pair, agreed)
                progress |= self._book is not None and pair.issued > issued

    def can_dispatch(self) -> bool:
        return self._has_room()

    def task_launched(self) -> None:
        self._tasks.append(self.device.mark())

    def idle(self) -> bool:
        """Everything expected was delivered and every own message is in an issued round."""
        with self._lock:
            sent = all(not p.own for p in self._pairs.values())
        return sent and all(self._delivered[p] == self._budget[p] for p in self._pairs)

    def flush(self, timeout: float) -> None:
        """Wait until every issued round completed on the device."""
        for pair in self._pairs.values():
            self._drain(pair, timeout, "flush")
        self._tasks = [t for t in self._tasks if not t.done()]
        self._raise_if_failed()

    def close(self, timeout: float = 5.0) -> None:
        self._channel.close(timeout)

    def stats(self) -> TransportStats:
        with self._lock:
            return TransportStats(**{f: getattr(self._stats, f) for f in TransportStats.__slots__})

    # ---- rounds ---------------------------------------------------------------------
    def _lead(self, pair: _Pair, agreed_announcements: int) -> None:
        with self._lock:
            take = agreed_announcements - pair.covered
            incoming, pair.announced = pair.announced[:take], pair.announced[take:]
            outgoing, pair.own = pair.own, []
        if not incoming and not outgoing:
            return
        self._issue_and_post(pair, outgoing, [header for _, header in incoming], agreed_announcements)
        pair.covered = agreed_announcements

    def _issue_and_post(self, pair: _Pair, outgoing: list[_Out], incoming: list[Header], covers: int,
                        listed: tuple[int, ...] = ()) -> None:
        """The leader's round: issued here, then its content to the follower (``listed``: the
        follower's messages it carries, by index, where ``covers`` is ``LISTED``)."""
        k = pair.issued
        self._issue(pair, outgoing, incoming)
        for position, out in enumerate(outgoing):
            self._channel.post(pair.peer, record(HEADER, k, position, header=out.header))
        for position, index in enumerate(listed):
            self._channel.post(pair.peer, record(COVER, k, position, index))
        self._channel.post(pair.peer, record(ROUND, k, covers, len(outgoing)))

    # ---- the DP epoch rule (docs/design/dp-epochs.md) -------------------------------------
    def _epoch(self, dst_stage: int, kind: str, microbatch: int, chunk: int) -> int:
        book = self._book
        return book.timeline.message_epoch(book.topology, dst_stage, kind == "activation", microbatch, chunk)

    def _arriving_epoch(self, pair: _Pair, index: int, header: Header) -> Optional[int]:
        """The epoch of the ``index``-th message from ``pair.peer``; None if it belongs to the
        peer's next iteration (beyond what this one expects), which waits for this rank's."""
        if index >= self._budget[pair.peer]:
            return None
        return self._epoch(self._stage, header.kind, header.microbatch, header.chunk)

    def _lead_epoch(self, pair: _Pair, agreed_announcements: int) -> None:
        """Rounds of one epoch each, the lowest first, while this rank's book lets them go."""
        while True:
            with self._lock:
                own = list(pair.own)
                takeable = [(i, h) for i, h in pair.announced if i < agreed_announcements]
            arriving = [(i, h, self._arriving_epoch(pair, i, h)) for i, h in takeable]
            epochs = [out.epoch for out in own] + [e for _, _, e in arriving if e is not None]
            if not epochs or not self._book.may_issue(epoch := min(epochs)):
                return
            outgoing = [out for out in own if out.epoch == epoch]
            incoming = [(i, h) for i, h, e in arriving if e == epoch]
            taken = {i for i, _ in incoming}
            with self._lock:
                pair.own = [out for out in pair.own if out.epoch != epoch]
                pair.announced = [(i, h) for i, h in pair.announced if i not in taken]
            self._issue_and_post(pair, outgoing, [h for _, h in incoming], LISTED, tuple(i for i, _ in incoming))
            pair.covered += len(incoming)
            self._book.issued(epoch, len(outgoing) + len(incoming))

    def _follow_epoch(self, pair: _Pair, agreed_decisions: int) -> None:
        """The leader's rounds in its order, each once this rank's book lets its epoch go."""
        while pair.issued < agreed_decisions:
            with self._lock:
                headers, covers = pair.decisions[0]
                outgoing = self._covered(pair, covers)
            first = pair.arrived
            arriving = [self._arriving_epoch(pair, first + n, h) for n, h in enumerate(headers)]
            if None in arriving:
                return  # the leader's next iteration: after this rank's
            epochs = set(arriving) | {out.epoch for out in outgoing}
            if len(epochs) != 1:
                raise TransportError(f"rank {self.rank}{self._tag()}: round {pair.issued} from rank {pair.peer} "
                                     f"carries messages of epochs {sorted(epochs)}; the epoch rule allows one")
            epoch = epochs.pop()
            if not self._book.may_issue(epoch):
                return
            with self._lock:
                pair.decisions.pop(0)
                taken = {id(out) for out in outgoing}
                pair.own = [out for out in pair.own if id(out) not in taken]
            self._issue(pair, outgoing, headers)
            pair.covered += len(outgoing)
            self._book.issued(epoch, len(outgoing) + len(headers))

    def _covered(self, pair: _Pair, covers) -> list[_Out]:
        """The follower's own messages a decision carries (a count since start-up, or listed)."""
        if isinstance(covers, tuple):
            wanted = set(covers)
            found = [out for out in pair.own if out.index in wanted]
        else:
            found = pair.own[:covers - pair.covered]
            wanted = range(pair.covered, covers)
        if len(found) != len(wanted):
            raise TransportError(f"rank {self.rank}{self._tag()}: round {pair.issued} from rank {pair.peer} covers "
                                 f"messages of ours that were not announced ({pair.produced} were)")
        return found

    def _follow(self, pair: _Pair, agreed_decisions: int) -> None:
        while pair.issued < agreed_decisions:
            with self._lock:
                headers, covers = pair.decisions.pop(0)
                outgoing = self._covered(pair, covers)
                taken = {id(out) for out in outgoing}
                pair.own = [out for out in pair.own if id(out) not in taken]
            self._issue(pair, outgoing, headers)
            pair.covered += len(outgoing)

    def _issue(self, pair: _Pair, outgoing: list[_Out], incoming: list[Header]) -> None:
        if self._exclusive:
            for other in self._pairs.values():
                if other is not pair:
                    self._drain(other, None, "ring rule")
        buffers = [self.device.empty(h.shape, h.dtype) for h in incoming]
        completion = self.device.exchange(pair.peer, [o.tensor for o in outgoing], buffers)
        pair.issued += 1
        pair.arrived += len(incoming)
        pair.in_flight.append((completion, [o.tensor for o in outgoing] + buffers))
        pair.in_flight = [(c, keep) for c, keep in pair.in_flight if not c.done()]
        with self._lock:
            self._stats.rendezvous += 1
            self._stats.messages_received += len(incoming)
            self._stats.bytes_received += sum(b.numel() * b.element_size() for b in buffers)
        arrival = _Arrival(completion)
        for header, buffer in zip(incoming, buffers):
            msg = Message(header.kind, header.microbatch, header.chunk, buffer, pair.peer, arrival)
            self._held[pair.peer].append(msg)
        self._release(pair.peer)

    def _release(self, src: int) -> None:
        """Deliver what the executor expects; hold the rest (the peer's next iteration)."""
        held = self._held[src]
        while held and self._delivered[src] < self._budget[src]:
            self._delivered[src] += 1
            self._on_message(held.pop(0))

    def _drain(self, pair: _Pair, timeout: Optional[float], why: str) -> None:
        for completion, _ in pair.in_flight:
            limit = timeout if timeout is not None else self.timeout_s  # its peer issued it: it runs
            try:
                done = completion.synchronize(limit)
            except Exception as exc:  # e.g. the peer died
                raise TransportError(f"rank {self.rank}{self._tag()}: {why}: a round with rank {pair.peer} failed: "
                                     f"{type(exc).__name__}: {exc}") from exc
            if not done:
                raise TransportError(f"rank {self.rank}{self._tag()}: {why}: a round with rank {pair.peer} did not "
                                     f"complete within {limit}s")
        pair.in_flight = []

    def _has_room(self) -> bool:
        while self._tasks and self._tasks[0].done():
            self._tasks.pop(0)
        return len(self._tasks) <= self.max_tasks_ahead

    # ---- host channel ----------------------------------------------------------------
    def _on_record(self, src: int, rec: list[int]) -> None:
        pair = self._pairs.get(src)
        kind, a, b, c = rec[:4]
        try:
            if pair is None:
                raise TransportError(f"record from rank {src}, which is not a neighbour")
            header = decode_header(torch.tensor(rec[4:], dtype=torch.int64)) if kind in (ANNOUNCE, HEADER) else None
            with self._lock:
                if kind == ANNOUNCE and pair.leader and a == pair.received:
                    pair.announced.append((a, header))
                    pair.received += 1
                elif kind == HEADER and not pair.leader and a == pair.received and b == len(pair.partial):
                    pair.partial.append(header)
                elif kind == COVER and not pair.leader and a == pair.received and b == len(pair.partial_covers):
                    pair.partial_covers.append(c)
                elif kind == ROUND and not pair.leader and a == pair.received and c == len(pair.partial):
                    covers = tuple(pair.partial_covers) if b == LISTED else b
                    pair.decisions.append((pair.partial, covers))
                    pair.partial, pair.partial_covers = [], []
                    pair.received += 1
                else:
                    raise TransportError(f"out-of-order or foreign record {rec[:4]} from rank {src}")
        except BaseException as exc:  # noqa: BLE001 - reported once through on_error
            self._fail(exc)
            return
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        err = exc if isinstance(exc, TransportError) else TransportError(
            f"rank {self.rank}{self._tag()}: host channel failed: {type(exc).__name__}: {exc}")
        with self._lock:
            first = self._error is None
            self._error = self._error or err
        if first:
            self._on_error(err)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _tag(self) -> str:
        return f" [{self.name}]" if self.name else ""


__all__ = ["ANNOUNCE", "BYE", "COVER", "HEADER", "LISTED", "RECORD_LEN", "ROUND", "Completion", "Device", "HostChannel",
           "RoundTransport", "record"]
