"""Message-driven asynchronous point-to-point transport between pipeline stages.

Every activation / gradient travels as a ``Message`` (kind, microbatch, receiver's chunk,
tensor, src) and is handed to ``on_message`` (the executor's inbox). Two transports:

* ``StageTransport`` (here): host tensors over gloo, the CPU path. One *directed* 2-rank
  group per neighbour pair and direction, a sender thread per destination and a receiver
  thread per source (blocking ``dist.send`` / ``dist.recv``: on gloo an ``irecv`` polled
  with ``is_completed()`` stays False until ``wait()``). A message is ONE frame, the
  int64 header followed by the payload bytes: gloo accepts a frame shorter than the posted
  buffer, so the receiver posts a buffer as large as the largest payload seen on the link
  and only a message larger than that costs a second rendezvous (a header-only frame
  announcing the new size first; both ends grow in step, FIFO). A receiver posts only
  receives announced with ``expect()``, so nothing is left posted at iteration end.
* ``rounds.RoundTransport``: device tensors over NCCL, built for NCCL's semantics (a
  send or receive kernel blocks its GPU queue until the peer's matching one runs; with
  ``CUDA_DEVICE_MAX_CONNECTIONS=1`` every stream shares one hardware queue). Headers go
  over a host channel; the payloads of one neighbour pair move in *rounds*: batched
  ``batch_isend_irecv`` groups that both ends issue in the same order.

Why the round protocol cannot deadlock (worst case: each GPU runs its operations strictly
one at a time, in issue order, and a p2p group completes only while its peer's runs too):
(1) a round is decided by the pair's lower stage (the leader) from messages already
produced, and its follower issues it only after the leader did; (2) both ends issue a
pair's rounds in one order, each as one group, so opposite directions never wait on each
other; (3) every TP rank issues rounds at the same points of its (agreed) task sequence,
so TP collectives and rounds sit in one order on all of a stage's GPUs; (4) no other
operation can wait on a partner: a receive exists only inside the round that carries its
send, the compute stream waits only for rounds already issued, and the host throttles
itself by declining tasks (it keeps issuing rounds), never by blocking. Then the union of
all GPUs' issue orders is acyclic (on a line every chain of "waits for its partner, which
is behind X" runs in one direction and ends at a pipeline end; the interleaved ring's
closing pair is led by stage 0, which never has a ring round and a line round in flight
together), so the earliest unfinished operation in that order can
always run. ``rounds.py`` gives the details; ``tests/unit/test_transport_emulated.py`` checks
it against a single-queue device emulation, where the old early-receive protocol hangs.

Usage of ``StageTransport`` (all ranks)::

    groups = create_directed_groups(pp_ranks, timeout=datetime.timedelta(minutes=5))
    tr = StageTransport(rank=rank, groups=groups, device=torch.device("cpu"),
                        on_message=buf.put, on_error=buf.fail)
    tr.expect(prev_rank, num_microbatches); tr.send(next_rank, "activation", mb, 0, y)
    ...; tr.flush(60.0); tr.close()
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .agreement import wait_in_slices

log = logging.getLogger(__name__)

MESSAGE_KINDS = ("activation", "gradient")
MAX_DIMS = 8
_MAGIC = 0x52524650_0001  # "RRFP", header format version 1
_CLOSE_MAGIC = 0x52524650_00FF  # a frame that only says "the sender closed this link" (close(release_peers=True))
HEADER_LEN = 6 + MAX_DIMS  # magic, kind, microbatch, chunk, dtype code, ndim, shape[8]
HEADER_BYTES = HEADER_LEN * 8  # a multiple of 8: the payload after it is aligned for every dtype
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
_DTYPE_CODE = {dt: code for code, dt in enumerate(_DTYPES)}


class TransportError(RuntimeError):
    """A send/receive failed (peer died, timeout, corrupt header) or the transport is shut."""


@dataclass(frozen=True, slots=True)
class Header:
    kind: str
    microbatch: int
    chunk: int  # the receiver's model-chunk index
    dtype: torch.dtype
    shape: tuple[int, ...]

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        return f"{self.kind}(mb={self.microbatch}, chunk={self.chunk}, {dt}{list(self.shape)})"


def encode_header(kind: str, microbatch: int, chunk: int, tensor: torch.Tensor) -> torch.Tensor:
    """The int64 wire header (length HEADER_LEN, CPU) describing ``tensor``."""
    if kind not in MESSAGE_KINDS:
        raise ValueError(f"message kind must be one of {MESSAGE_KINDS}, got {kind!r}")
    if tensor.dtype not in _DTYPE_CODE:
        raise ValueError(f"unsupported dtype {tensor.dtype} for a pipeline message; "
                         f"supported: {[str(d) for d in _DTYPES]}")
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"tensor has {tensor.dim()} dims {list(tensor.shape)}; "
                         f"the wire header holds at most {MAX_DIMS}")
    shape = list(tensor.shape) + [0] * (MAX_DIMS - tensor.dim())
    fields = [_MAGIC, MESSAGE_KINDS.index(kind), microbatch, chunk, _DTYPE_CODE[tensor.dtype],
              tensor.dim(), *shape]
    return torch.tensor(fields, dtype=torch.int64)


MAX_MESSAGE_BYTES = 2**35
"""32 GiB: no pipeline activation is larger; a header asking for more is corrupt."""


def decode_header(header: torch.Tensor) -> Header:
    return header_from_fields(header.tolist())


def header_from_fields(fields: list[int]) -> Header:
    """The header a peer sent, or TransportError naming what is wrong with it: magic,
    kind, dtype code, dimension count, every dimension >= 0 (unused ones 0), the payload
    at most MAX_MESSAGE_BYTES, microbatch and chunk >= 0 (their range is the executor's
    check). Checked before any buffer is allocated for the payload."""
    if len(fields) != HEADER_LEN or fields[0] != _MAGIC:
        raise TransportError(f"corrupt or foreign message header {fields[:HEADER_LEN]} (expected {HEADER_LEN} "
                             f"fields starting with magic {_MAGIC:#x})")
    _, kind, mb, chunk, code, ndim, *shape = fields
    problem = None
    if not 0 <= kind < len(MESSAGE_KINDS):
        problem = f"unknown message kind code {kind}"
    elif not 0 <= code < len(_DTYPES):
        problem = f"unknown dtype code {code}"
    elif not 0 <= ndim <= MAX_DIMS:
        problem = f"{ndim} dimensions (0..{MAX_DIMS} allowed)"
    elif any(d < 0 for d in shape[:ndim]) or any(shape[ndim:]):
        problem = f"shape {shape[:ndim]} with padding {shape[ndim:]} (dimensions must be >= 0, padding 0)"
    elif mb < 0 or chunk < 0:
        problem = f"microbatch {mb}, chunk {chunk} (must be >= 0)"
    else:
        nbytes = _DTYPES[code].itemsize
        for d in shape[:ndim]:
            nbytes *= d
        if nbytes > MAX_MESSAGE_BYTES:
            problem = f"a payload of {nbytes} bytes (shape {shape[:ndim]}), over the {MAX_MESSAGE_BYTES} byte limit"
    if problem is not None:
        raise TransportError(f"invalid message header {fields}: {problem}")
    return Header(MESSAGE_KINDS[kind], mb, chunk, _DTYPES[code], tuple(shape[:ndim]))


def payload_bytes(header: Header) -> int:
    numel = 1
    for size in header.shape:
        numel *= size
    return numel * torch.empty((), dtype=header.dtype).element_size()


def pack_frame(header: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """One uint8 frame: the header's bytes, then the (CPU) tensor's bytes."""
    data = tensor.reshape(-1).view(torch.uint8)
    frame = torch.empty(HEADER_BYTES + data.numel(), dtype=torch.uint8)
    frame[:HEADER_BYTES] = header.view(torch.uint8)
    frame[HEADER_BYTES:] = data
    return frame


def unpack_payload(frame: torch.Tensor, header: Header) -> torch.Tensor:
    """The payload inside ``frame`` as a tensor of the header's dtype and shape (a view)."""
    data = frame[HEADER_BYTES:HEADER_BYTES + payload_bytes(header)]
    return data.view(header.dtype).view(header.shape)


@dataclass(frozen=True, slots=True)
class Message:
    kind: str  # "activation" | "gradient"
    microbatch: int
    chunk: int  # the receiver's model-chunk index (computed by the sender)
    tensor: torch.Tensor
    src: int  # global rank of the sender
    ready_event: Optional[object] = None  # device transports: what to wait for before use

    def wait(self) -> torch.Tensor:
        """The tensor, safe to use on the current stream: device transports order the
        current stream after the receive here (call it right before the tensor's first
        use, not when the message arrives); no-op on the host transport."""
        if self.ready_event is not None:
            self.ready_event.wait()
        return self.tensor


@dataclass(slots=True)
class TransportStats:
    messages_sent: int = 0
    bytes_sent: int = 0  # payload bytes; each message also carries HEADER_BYTES header bytes
    messages_received: int = 0
    bytes_received: int = 0
    send_seconds: float = 0.0  # wall time inside send calls, incl. waiting for the peer's recv
    recv_seconds: float = 0.0  # wall time inside recv calls, incl. waiting for the peer's send
    rendezvous: int = 0  # frames sent: one per message, two when a message outgrew the link's buffer


def create_directed_groups(pp_group_ranks: list[int], *, timeout: datetime.timedelta, ring: bool = True,
                           backend: Optional[str] = None) -> dict[tuple[int, int], dist.ProcessGroup]:
    """Create one 2-rank group per directed neighbour pair of every pipeline.

    Collective over the whole world (``new_group`` must be called by every rank in the
    same order); ``pp_group_ranks`` is this rank's pipeline, in stage order. Returns this
    rank's groups keyed ``(src, dst)`` by global rank. ``ring`` adds last <-> first links
    (interleaved pipelines: last stage's chunk c feeds stage 0's chunk c+1).
    """
    me = dist.get_rank()
    if me not in pp_group_ranks:
        raise ValueError(f"rank {me} is not in its own pipeline group {pp_group_ranks}")
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [int(r) for r in pp_group_ranks])
    pipelines = sorted({tuple(r) for r in gathered})  # keeps stage order within a pipeline
    owner: dict[int, tuple[int, ...]] = {}
    for p in pipelines:
        for r in p:
            if owner.setdefault(r, p) != p:
                raise ValueError(f"rank {r} is in two pipeline groups: {owner[r]} and {p}")
    pairs: list[tuple[int, int]] = []
    for p in pipelines:
        links = list(zip(p, p[1:])) + ([(p[-1], p[0])] if ring and len(p) > 2 else [])
        for a, b in links:
            pairs += [(a, b), (b, a)]
    groups = {}
    for a, b in dict.fromkeys(pairs):  # dedupe, keeping the same order on every rank
        group = dist.new_group([a, b], timeout=timeout, backend=backend)
        if me in (a, b):
            groups[(a, b)] = group
    return groups


class SelfDelivering:
    """The executor's progress hooks for a transport whose own threads deliver every
    message: nothing to advance or agree on, never throttles the host, idle once sent
    (``flush`` waits for the last sends). The device transport (``rounds.py``) is the one
    that needs them."""

    state_words = 0
    poll_interval = None

    def local_state(self) -> tuple[int, ...]:
        return ()

    def advance(self, state: tuple[int, ...]) -> None:
        pass

    def can_dispatch(self) -> bool:
        return True

    def task_launched(self) -> None:
        pass

    def idle(self) -> bool:
        return True


@dataclass(slots=True)
class _Outgoing:
    header: torch.Tensor
    tensor: torch.Tensor  # referenced until the payload send completed
    on_sent: Optional[Callable[[], None]]


class StageTransport(SelfDelivering):
    """Asynchronous host-tensor (gloo) transport of one pipeline rank (module docstring).

    ``on_message`` / ``on_error`` run on transport threads, possibly concurrently: they
    must be thread-safe and quick. ``on_error`` is called at most once, with a
    ``TransportError``; afterwards ``send``/``flush`` raise that error.
    """

    def __init__(self, *, rank: int, groups: dict[tuple[int, int], dist.ProcessGroup],
                 device: torch.device, on_message: Callable[[Message], None],
                 on_error: Callable[[BaseException], None], name: str = "") -> None:
        self.rank, self.device, self.name = rank, torch.device(device), name
        if self.device.type != "cpu":
            raise ValueError(f"StageTransport carries host tensors over gloo, got device {self.device}; "
                             "device tensors go through megatron_rrfp.runtime.rounds.RoundTransport")
        self._groups = groups
        self._on_message, self._on_error = on_message, on_error
        self._cv = threading.Condition()  # guards everything below
        self._error: Optional[TransportError] = None
        self._closed = False
        self._pending_sends = 0
        self._expected = {src: 0 for (src, dst) in groups if dst == rank}
        self._stats = TransportStats()
        self._queues = {dst: queue.SimpleQueue() for (src, dst) in groups if src == rank}
        # the receiver's rank inside each outgoing group, known while the world exists (close may run after)
        self._peer_index = {dst: dist.get_group_rank(groups[(rank, dst)], dst) for dst in self._queues}
        self._close_frames: list = []  # (work, frame) of close frames sent: referenced until the process ends
        tag = f"rrfp-{name}-r{rank}" if name else f"rrfp-r{rank}"
        self._threads = [threading.Thread(target=self._send_loop, args=(dst,), daemon=True,
                                          name=f"{tag}-send{dst}") for dst in self._queues]
        self._threads += [threading.Thread(target=self._recv_loop, args=(src,), daemon=True,
                                           name=f"{tag}-recv{src}") for src in self._expected]
        for t in self._threads:
            t.start()

    # ---- caller API -------------------------------------------------------------------
    def send(self, dst: int, kind: str, microbatch: int, chunk: int, tensor: torch.Tensor,
             on_sent: Optional[Callable[[], None]] = None) -> None:
        """Queue a message to ``dst``; returns at once. Do not modify ``tensor`` before
        ``on_sent`` (called on the sender thread once the payload send completed)."""
        self._raise_if_unusable()
        if dst not in self._queues:
            raise ValueError(f"rank {self.rank}: no directed group {self.rank}->{dst}; "
                             f"destinations: {sorted(self._queues)}")
        if tensor.device != self.device:
            raise ValueError(f"rank {self.rank}: tensor on {tensor.device}, transport on {self.device}")
        tensor = tensor.detach().contiguous()
        header = encode_header(kind, microbatch, chunk, tensor)
        with self._cv:
            self._pending_sends += 1
        self._queues[dst].put(_Outgoing(header, tensor, on_sent))

    def expect(self, src: int, count: int) -> None:
        """Let the receiver for ``src`` post ``count`` more receives."""
        if src not in self._expected:
            raise ValueError(f"rank {self.rank}: no directed group {src}->{self.rank}; "
                             f"sources: {sorted(self._expected)}")
        if count < 0:
            raise ValueError(f"expect count must be >= 0, got {count}")
        with self._cv:
            self._expected[src] += count
            self._cv.notify_all()

    def flush(self, timeout: float) -> None:
        """Block until every queued send completed (gloo: the peer received it)."""
        with self._cv:
            done = wait_in_slices(self._cv, lambda: self._pending_sends == 0 or self._error, timeout)
            if self._error:
                raise self._error
            if not done:
                raise TransportError(f"rank {self.rank}{self._tag()}: flush timed out after "
                                     f"{timeout}s with {self._pending_sends} sends pending")

    def close(self, timeout: float = 5.0, *, release_peers: bool = False) -> None:
        """Stop all threads. Queued sends are dropped.

        ``release_peers`` (after a failure): first send each receiver a close frame, which ends a
        receive it has posted for a message that will never come. A thread blocked in a gloo
        receive cannot be interrupted otherwise (neither aborting nor destroying the group wakes
        it; its group's timeout is the stall timeout), and one still blocked when the process
        re-creates its process groups (an in-process restart) makes the process abort at exit.
        Sent on the group object itself, so it also works after the process groups were destroyed."""
        with self._cv:
            self._closed = True
            outstanding = {s: n for s, n in self._expected.items() if n}
            self._cv.notify_all()
        if release_peers:
            self._release_peers()
        for q in self._queues.values():
            q.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck or outstanding:  # a thread blocked in dist.send/recv cannot be interrupted
            log.warning("rank %d%s: close() left threads %s blocked; receives still expected "
                        "per source %s", self.rank, self._tag(), stuck, outstanding)

    def stats(self) -> TransportStats:
        with self._cv:
            return dataclasses.replace(self._stats)

    def reset_stats(self) -> None:
        with self._cv:
            self._stats = TransportStats()

    # ---- threads ----------------------------------------------------------------------
    def _send_loop(self, dst: int) -> None:
        group = self._groups[(self.rank, dst)]
        capacity = 0  # payload bytes the peer's posted buffer holds (grows in step with it)
        while True:
            item = self._queues[dst].get()
            if item is None or self._closed or self._error:
                return
            try:
                t0 = time.perf_counter()
                frame = pack_frame(item.header, item.tensor)
                frames = 1
                if frame.numel() - HEADER_BYTES > capacity:  # announce the larger frame first
                    dist.send(frame[:HEADER_BYTES], dst, group=group)
                    capacity, frames = frame.numel() - HEADER_BYTES, 2
                dist.send(frame, dst, group=group)
                elapsed = time.perf_counter() - t0
                if item.on_sent is not None:
                    item.on_sent()
            except BaseException as exc:
                self._fail("send to", dst, decode_header(item.header), exc)
                return
            with self._cv:
                s = self._stats
                s.messages_sent += 1
                s.bytes_sent += item.tensor.numel() * item.tensor.element_size()
                s.send_seconds += elapsed
                s.rendezvous += frames
                self._pending_sends -= 1  # after on_sent: flush() implies every on_sent ran
                if self._pending_sends == 0:  # only flush() waits on this; waking it per
                    self._cv.notify_all()     # message costs a GIL hand-off each time

    def _recv_loop(self, src: int) -> None:
        group = self._groups[(src, self.rank)]
        capacity = 0  # payload bytes of the buffer posted for the next frame
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._expected[src] or self._closed or self._error)
                if self._closed or self._error:
                    return
            header: object = "(header not yet received)"
            try:
                t0 = time.perf_counter()
                frame = torch.empty(HEADER_BYTES + capacity, dtype=torch.uint8)
                dist.recv(frame, src, group=group)
                if int(frame[:8].view(torch.int64)[0]) == _CLOSE_MAGIC:
                    self._peer_closed(src)
                    return
                header = decode_header(frame[:HEADER_BYTES].view(torch.int64))
                if payload_bytes(header) > capacity:  # a header-only frame: the message follows
                    capacity = payload_bytes(header)
                    frame = torch.empty(HEADER_BYTES + capacity, dtype=torch.uint8)
                    dist.recv(frame, src, group=group)
                    header = decode_header(frame[:HEADER_BYTES].view(torch.int64))
                payload = unpack_payload(frame, header)
                elapsed = time.perf_counter() - t0
            except BaseException as exc:
                self._fail("recv from", src, header, exc)
                return
            msg = Message(header.kind, header.microbatch, header.chunk, payload, src)
            with self._cv:
                s = self._stats
                s.messages_received += 1
                s.bytes_received += payload.numel() * payload.element_size()
                s.recv_seconds += elapsed
                self._expected[src] -= 1
            if not self._deliver(msg):
                return

    # ---- helpers ----------------------------------------------------------------------
    def _release_peers(self) -> None:
        frame = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        frame.view(torch.int64)[0] = _CLOSE_MAGIC
        for dst in self._queues:
            try:  # never waited: the peer may have nothing posted, or be gone
                work = self._groups[(self.rank, dst)].send([frame], self._peer_index[dst], 0)
                self._close_frames.append((work, frame))
            except Exception as exc:  # noqa: BLE001 - best effort; the failure that closed us is what counts
                log.debug("rank %d%s: no close frame to rank %d: %s", self.rank, self._tag(), dst, exc)

    def _deliver(self, msg: Message) -> bool:
        try:
            self._on_message(msg)
            return True
        except BaseException as exc:
            self._fail("deliver from", msg.src, f"{msg.kind}(mb={msg.microbatch}, chunk={msg.chunk})", exc)
            return False

    def _peer_closed(self, src: int) -> None:
        """``src`` closed its end after a failure there: ours is one now too, unless we closed first."""
        with self._cv:
            if self._closed or self._error:
                return
            expected = self._expected[src]
        self._fail("recv from", src, f"a close frame ({expected} messages still expected)",
                   TransportError(f"rank {src} closed the link (a failure there)"))

    def _fail(self, direction: str, peer: int, header: object, exc: BaseException) -> None:
        err = TransportError(f"rank {self.rank}{self._tag()}: {direction} rank {peer} failed "
                             f"while processing {header}: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        with self._cv:
            first = self._error is None
            if first:
                self._error = err
            self._cv.notify_all()
        if first:
            self._on_error(err)
        else:
            log.error("%s (after an earlier transport error)", err)

    def _raise_if_unusable(self) -> None:
        with self._cv:
            if self._error:
                raise self._error
            if self._closed:
                raise TransportError(f"rank {self.rank}{self._tag()}: transport is closed")

    def _tag(self) -> str:
        return f" [{self.name}]" if self.name else ""
