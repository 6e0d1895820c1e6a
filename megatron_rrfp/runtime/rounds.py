"""The device transport: pipeline messages in *rounds*, built on NCCL's semantics.

A NCCL send or receive kernel blocks its GPU queue until the peer's matching kernel runs
("blocking for the GPU"; operations that must progress together must share one
``ncclGroupStart/End``), and with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` every stream feeds
one hardware queue. So a receive may only enter a queue together with its send, and
every GPU must see the operations it shares with others in one consistent order.

Protocol, per neighbour pair (the lower pipeline stage leads, also for the interleaved
ring's closing pair, which stage 0 leads):

* the follower *announces* each message it produces (its header) over the host channel;
* at a decision point of its task loop, the leader forms round k from its own messages
  produced so far and the follower messages announced to it (with tensor parallelism:
  announced to *every* TP rank — the count is agreed with the task), issues it as ONE
  batched group (``batch_isend_irecv``: its sends and the matching receives), and sends
  the round's content (its headers, how many announcements it covers) to the follower;
* the follower issues round k, mirrored, at its next decision point after every one of
  its TP ranks has the decision; rounds of a pair are issued in the same order on both
  ends. A received tensor is delivered at once; its task waits for the round on the
  device (``Message.wait()``) right before it uses it.

Why this cannot deadlock, in the worst case (each GPU runs its operations one at a time
in issue order; a round runs only while its partner's runs): order all device operations
by the issue order of each GPU, identifying the two ends of a round and the ranks of a TP
collective. The follower issues after the leader, rounds of a pair in one order, and TP
ranks at the same points of the same task sequence, so this order has no cycle: a chain
of "waits for its partner, which is behind X" moves along the pipeline in one direction
and ends at a pipeline end (on the ring, stage 0 never has rounds of both its pairs in
flight, so no chain closes the ring). The earliest unfinished operation therefore always
runs.

The hosts, too, must keep issuing: a round's follower end is issued only when the
follower's host reaches its next decision point. The executor itself never waits on the
device while it has rounds to issue: it *declines* tasks (``can_dispatch``) while more
than ``max_tasks_ahead`` launched tasks are unfinished on the device, and keeps issuing
rounds meanwhile. (So up to ``max_tasks_ahead + 1`` tasks are unfinished right after a
launch, and one more under TP agreement, whose offer for the next task is posted as the
current one launches.) But hosts *do* block on operations whose partner may not be issued
yet, in three places:

* ``flush`` (end of the call) waits for this rank's last rounds;
* stage 0's ring rule (``_issue`` -> ``_drain``) waits for the rounds of its other pair
  before issuing on this one, and the follower end of those rounds may not be issued yet;
* host syncs inside a task: Megatron's own (the MoE alltoall dispatcher's
  ``d2h_event.synchronize()`` in every MoE forward, ``--check-for-nan-in-loss-and-grad``
  reading each bucket inside the last B / W, ``validate_result`` in the loss), which wait
  for every operation queued before them on this rank's device.

Each such wait is for an operation of the waiting rank's *own* queue, so it returns once
the earliest unfinished operations of that queue run, and by the order above those run as
long as every follower host eventually reaches its next decision point. A follower host is
either at a decision point (it issues) or in one of these waits, on its own queue; chains
of such waits follow the follower relation, i.e. move down the pipeline (the lower stage
leads), and end at the last stage, which follows only, or — on the ring — at stage 0,
which by the ring rule has rounds of one pair only in flight while it drains the other,
so the drain's chain cannot come back to it. So every host wait returns; each one is also
bounded by ``timeout_s`` — below NCCL's own timeout (``mcore.session.device_timeout``;
Megatron's groups: ``--distributed-timeout-minutes``, held above it by
``megatron_lm.flags.check_distributed_timeout``), so RRFP's diagnosis comes first. What
these waits cost is the issuing host's lead: the device runs dry behind a host sync until
the host catches up (the emulation issues the dispatcher's sync in every MoE forward).

Expert parallelism (MoE all-to-alls on NCCL, inside F and B): the expert-parallel group
spans data-parallel replicas, i.e. ranks of *different pipelines*, so the agreement group is
every rank of this stage that shares a collective with it (TP x CP joined with expert-TP x
EP). All of them dispatch one task sequence and issue their rounds at the same points of it
(the counters are agreed over the whole group, and replicas' messages follow one sequence
because their producers run one sequence too). Identify, per stage, the group's ranks at
the same position of that sequence: each collective (TP, CP, expert all-to-all) then lies
at one such position, each round joins position i of stage s to position j of stage s+1 in
the same way in every replica, and the graph of these positions is the graph of a single
pipeline whose stages are the groups — the argument above applies to it unchanged. A
task's own dependencies (its input message, the rounds before it) are the same in every
replica, so no replica waits on something that only another replica's progress produces.
The agreement itself runs on separate gloo groups, off the device queues.

TP collectives inside W (sequence parallelism under the B/W split: ``mcore/wgrad.py``'s W
re-gathers its linear's input over the TP group) are covered the same way: the agreed task
universe holds every W, each dispatch enters the digest checked at every exchange, so all TP
ranks issue W's all-gathers at the same position of one task sequence (in the store's fixed
order), on the compute stream like the TP collectives inside F and B.

Data-parallel collectives join ranks of *other* pipelines at points of their own task
sequences (``mcore/dp_overlap.py`` decides where they may overlap the task loop). Where
megatron issues them (``mcore/grad_sync.py``): a chunk's bucket reductions in its last
backward (``overlap_grad_reduce``; under the B/W split in the last B for what B completes
and weight by weight inside the last W, ``SplitReadiness``); the distributed optimizer's
parameter all-gathers (``overlap_param_gather``) in the chunk's first forward (DDP's
forward pre-hook chain), with interleaving chunks 0 and 1 at the start of the call and
chunk c + 1 before chunk c's first forward (``param_sync_func``). Their order on a stage
is the same in every replica whatever the timing, by data dependency alone: chunk c's
first forward follows chunk c - 1's, and chunk c's last backward follows chunk c + 1's
(each backward of chunk c needs the same microbatch's backward of chunk c + 1), so a
stage issues all-gathers 0, 1, ..., C - 1, then reductions C - 1, ..., 0. Their position
*relative to the stage's rounds* is not:

* without interleaving it is: a stage's reductions sit in its last backward, after every
  round it still needs from downstream and before any round upstream needs from it; by
  induction from the last stage up (the last stages' reductions need nothing from upstream
  that is queued after an upstream reduction) every stage's reductions complete. Its
  all-gathers sit in its first forward, before any round but the one carrying that
  forward's input: by induction from stage 0 down they complete;
* with interleaving chunk c's reductions and chunk c + 1's all-gathers fall between rounds
  of other chunks, at points that differ per replica (readiness differs per pipeline). A
  cycle is then possible: replica A's stage s issues reduction R(c) before a round j with
  s + 1 that A's stage s + 1 issues before its R'(c - 1), while replica B's stage s + 1 issues
  R'(c - 1) before a round i that B's stage s issued before R(c) — each collective waits
  for its other replica, which is behind a round whose partner is behind the collective.
  **The rule** (``dp_overlap.whole_stage_agreement``): on CUDA with interleaving, DP > 1 and
  either flag, the agreement group spans every rank of the stage (TP x DP x CP). Every DP
  replica of a stage then dispatches one agreed task sequence and issues its rounds at the
  agreed points of it, so its DP collectives lie at the same positions in every replica:
  exactly the expert-parallel case above (identify the group's ranks at one position; the
  graph is a single pipeline's), and the argument applies unchanged, the split's in-loop
  reductions included (``SplitReadiness(overlap_allowed=True)``). Without the rule the
  interleaved case stays outside the argument (``overlapped_dp_communication_allowed(...,
  whole_stage=False)``). **The other choice** (``--rrfp-dp-overlap after-loop``,
  ``grad_sync``'s ``in_loop=False``): no DP collective inside the loop at all — every
  all-gather completes before the first round of the call is issued and every reduction is
  issued after the last round has completed (the loop ends with ``flush``), in one static
  order (chunk, bucket) on every replica; they then sit where the optimizer step's
  collectives sit, and each pipeline's rounds are again a single pipeline's graph.

The device and the host channel are injected (``Device``, ``HostChannel``):
``device.py`` ships NCCL and gloo ones; tests drive the same protocol on an emulated
single-queue device (``megatron_rrfp/verify/queue_device.py``).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

from .transport import HEADER_LEN, Header, Message, TransportError, TransportStats, decode_header, encode_header

RECORD_LEN = 4 + HEADER_LEN  # type, three fields, a message header
ANNOUNCE, HEADER, ROUND, BYE = 1, 2, 3, 4


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


@dataclass(slots=True)
class _Pair:
    """One neighbour pair. Counts are totals since start-up; lists hold only what is open."""

    peer: int
    leader: bool
    own: list = field(default_factory=list)  # produced here, not yet in an issued round
    announced: list = field(default_factory=list)  # leader: follower headers not yet in a round
    received: int = 0  # leader: announcements received; follower: decisions received
    covered: int = 0  # announcements (of the follower's messages) in issued rounds
    produced: int = 0  # follower: own messages announced
    decisions: list = field(default_factory=list)  # follower: (leader headers, covered after it), not issued
    partial: list = field(default_factory=list)  # follower: headers of the round being received
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
        with self._lock:
            pair.own.append(_Out(header, tensor))
            index, pair.produced = pair.produced, pair.produced + 1
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

    def local_state(self) -> tuple[int, ...]:
        """Per pair (by peer rank): announcements received (leader) / decisions received (follower)."""
        with self._lock:
            return tuple(p.received for p in self._pairs.values())

    def advance(self, state: tuple[int, ...]) -> None:
        """Issue every round ``state`` allows (the agreed counters: the same on all TP ranks)."""
        self._raise_if_failed()
        for pair, agreed in zip(self._pairs.values(), state):
            if pair.leader:
                self._lead(pair, agreed)
            else:
                self._follow(pair, agreed)

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
        k = pair.issued
        self._issue(pair, outgoing, incoming)
        for position, out in enumerate(outgoing):
            self._channel.post(pair.peer, record(HEADER, k, position, header=out.header))
        self._channel.post(pair.peer, record(ROUND, k, agreed_announcements, len(outgoing)))
        pair.covered = agreed_announcements

    def _follow(self, pair: _Pair, agreed_decisions: int) -> None:
        while pair.issued < agreed_decisions:
            with self._lock:
                headers, covers = pair.decisions.pop(0)
                take = covers - pair.covered
                outgoing, pair.own = pair.own[:take], pair.own[take:]
            if len(outgoing) != take:
                raise TransportError(f"rank {self.rank}: round {pair.issued} from rank {pair.peer} covers "
                                     f"{covers} of our messages, only {pair.produced} were announced")
            self._issue(pair, outgoing, headers)
            pair.covered = covers

    def _issue(self, pair: _Pair, outgoing: list[_Out], incoming: list[Header]) -> None:
        if self._exclusive:
            for other in self._pairs.values():
                if other is not pair:
                    self._drain(other, None, "ring rule")
        buffers = [self.device.empty(h.shape, h.dtype) for h in incoming]
        completion = self.device.exchange(pair.peer, [o.tensor for o in outgoing], buffers)
        pair.issued += 1
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
                    pair.announced.append(header)
                    pair.received += 1
                elif kind == HEADER and not pair.leader and a == pair.received and b == len(pair.partial):
                    pair.partial.append(header)
                elif kind == ROUND and not pair.leader and a == pair.received and c == len(pair.partial):
                    pair.decisions.append((pair.partial, b))
                    pair.partial = []
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


__all__ = ["ANNOUNCE", "BYE", "HEADER", "RECORD_LEN", "ROUND", "Completion", "Device", "HostChannel",
           "RoundTransport", "record"]
