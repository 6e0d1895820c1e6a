"""Message-driven asynchronous point-to-point transport between pipeline stages.

Every activation / gradient travels as a ``Message`` (kind, microbatch, receiver's chunk,
tensor, src). On the wire: a fixed-size int64 header, then the payload, both on a
dedicated *directed* 2-rank process group (src -> dst carries one direction only), so a
send and a receive of opposite directions never queue behind each other on one
communicator (NCCL ordering deadlock) and per-pair FIFO order is simple on gloo.

Threads, per ``StageTransport``: one sender per destination (a queue, blocking
``dist.send``), one receiver per source (blocking ``dist.recv``, then ``on_message``).
Blocking receives on
threads are the only readiness signal that works on gloo: an ``irecv`` polled with
``is_completed()`` stays False until ``wait()``. A receiver posts a receive only for
messages announced with ``expect()``, so nothing is left posted at iteration end or exit.
On gloo a send completes only once the peer has posted the matching receive (rendezvous),
so ``flush()`` also waits for the peer's ``expect()``.

Usage (all ranks)::

    groups = create_directed_groups(pp_ranks, timeout=datetime.timedelta(minutes=5))
    tr = StageTransport(rank=rank, groups=groups, device=dev, on_message=buf.put,
                        on_error=buf.fail)
    tr.expect(prev_rank, num_microbatches); tr.send(next_rank, "activation", mb, 0, y)
    ...; tr.flush(60.0); tr.close()
"""
from __future__ import annotations

import contextlib
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

log = logging.getLogger(__name__)

MESSAGE_KINDS = ("activation", "gradient")
MAX_DIMS = 8
_MAGIC = 0x52524650_0001  # "RRFP", header format version 1
HEADER_LEN = 6 + MAX_DIMS  # magic, kind, microbatch, chunk, dtype code, ndim, shape[8]
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


def decode_header(header: torch.Tensor) -> Header:
    f = header.tolist()
    if len(f) != HEADER_LEN or f[0] != _MAGIC:
        raise TransportError(f"corrupt or foreign message header {f} (expected magic {_MAGIC:#x})")
    magic, kind, mb, chunk, code, ndim, *shape = f
    if not (0 <= kind < len(MESSAGE_KINDS) and 0 <= code < len(_DTYPES) and 0 <= ndim <= MAX_DIMS):
        raise TransportError(f"invalid message header {f}")
    return Header(MESSAGE_KINDS[kind], mb, chunk, _DTYPES[code], tuple(shape[:ndim]))


@dataclass(frozen=True, slots=True)
class Message:
    kind: str  # "activation" | "gradient"
    microbatch: int
    chunk: int  # the receiver's model-chunk index (computed by the sender)
    tensor: torch.Tensor
    src: int  # global rank of the sender
    ready_event: Optional[torch.cuda.Event] = None  # CUDA: recorded after the recv

    def wait(self, stream: Optional[torch.cuda.Stream] = None) -> torch.Tensor:
        """Order ``stream`` (default: current) after the receive; no-op on CPU."""
        if self.ready_event is not None:
            stream = stream or torch.cuda.current_stream(self.tensor.device)
            stream.wait_event(self.ready_event)
            # Allocated on the comm stream: keep the block alive for work queued on `stream`.
            self.tensor.record_stream(stream)
        return self.tensor


@dataclass(slots=True)
class TransportStats:
    messages_sent: int = 0
    bytes_sent: int = 0  # payload bytes; each message also carries HEADER_LEN * 8 header bytes
    messages_received: int = 0
    bytes_received: int = 0
    send_seconds: float = 0.0  # wall time inside send calls, incl. waiting for the peer's recv
    recv_seconds: float = 0.0  # wall time inside recv calls, incl. waiting for the peer's send


def create_directed_groups(pp_group_ranks: list[int], *, timeout: datetime.timedelta, ring: bool = True
                           ) -> dict[tuple[int, int], dist.ProcessGroup]:
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
        group = dist.new_group([a, b], timeout=timeout)
        if me in (a, b):
            groups[(a, b)] = group
    return groups


@dataclass(slots=True)
class _Outgoing:
    header: torch.Tensor
    tensor: torch.Tensor  # referenced until the payload send completed
    ready: Optional[torch.cuda.Event]  # CUDA: recorded on the producer's stream
    on_sent: Optional[Callable[[], None]]


class StageTransport:
    """Asynchronous message transport of one pipeline rank (see module docstring).

    ``on_message`` / ``on_error`` run on transport threads, possibly concurrently: they
    must be thread-safe and quick. ``on_error`` is called at most once, with a
    ``TransportError``; afterwards ``send``/``flush`` raise that error.
    """

    def __init__(self, *, rank: int, groups: dict[tuple[int, int], dist.ProcessGroup],
                 device: torch.device, on_message: Callable[[Message], None],
                 on_error: Callable[[BaseException], None], name: str = "") -> None:
        self.rank, self.device, self.name = rank, torch.device(device), name
        self._groups = groups
        self._on_message, self._on_error = on_message, on_error
        self._cuda = self.device.type == "cuda"
        self._cv = threading.Condition()  # guards everything below
        self._error: Optional[TransportError] = None
        self._closed = False
        self._pending_sends = 0
        self._expected = {src: 0 for (src, dst) in groups if dst == rank}
        self._stats = TransportStats()
        self._queues = {dst: queue.SimpleQueue() for (src, dst) in groups if src == rank}
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
        ready = None
        if self._cuda:  # the comm stream must not read the tensor before its producer wrote it
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        with self._cv:
            self._pending_sends += 1
        self._queues[dst].put(_Outgoing(header, tensor, ready, on_sent))

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
            done = self._cv.wait_for(lambda: self._pending_sends == 0 or self._error, timeout)
            if self._error:
                raise self._error
            if not done:
                raise TransportError(f"rank {self.rank}{self._tag()}: flush timed out after "
                                     f"{timeout}s with {self._pending_sends} sends pending")

    def close(self, timeout: float = 5.0) -> None:
        """Stop all threads. Queued sends are dropped."""
        with self._cv:
            self._closed = True
            outstanding = {s: n for s, n in self._expected.items() if n}
            self._cv.notify_all()
        for q in self._queues.values():
            q.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck or outstanding:  # a thread blocked in dist.send/recv cannot be interrupted
            log.warning("rank %d%s: close() left threads %s blocked; receives still expected "
                        "per source %s", self.rank, self._tag(), stuck, outstanding)

    # ---- the executor's progress hooks: nothing to do, receiver threads deliver --------
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
        return True  # flush() waits for the last sends

    def stats(self) -> TransportStats:
        with self._cv:
            return dataclasses.replace(self._stats)

    def reset_stats(self) -> None:
        with self._cv:
            self._stats = TransportStats()

    # ---- threads ----------------------------------------------------------------------
    def _send_loop(self, dst: int) -> None:
        group, stream = self._groups[(self.rank, dst)], self._new_stream()
        while True:
            item = self._queues[dst].get()
            if item is None or self._closed or self._error:
                return
            try:
                t0 = time.perf_counter()
                with self._on(stream):
                    if item.ready is not None:
                        stream.wait_event(item.ready)
                    dist.send(item.header.to(self.device), dst, group=group)
                    if item.tensor.numel():
                        dist.send(item.tensor, dst, group=group)
                    if stream is not None:  # NCCL send returns once queued: wait for the wire
                        stream.synchronize()
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
                self._pending_sends -= 1  # after on_sent: flush() implies every on_sent ran
                if self._pending_sends == 0:  # only flush() waits on this; waking it per
                    self._cv.notify_all()     # message costs a GIL hand-off each time

    def _recv_loop(self, src: int) -> None:
        group, stream = self._groups[(src, self.rank)], self._new_stream()
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._expected[src] or self._closed or self._error)
                if self._closed or self._error:
                    return
            header: object = "(header not yet received)"
            try:
                t0 = time.perf_counter()
                with self._on(stream):
                    raw = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
                    dist.recv(raw, src, group=group)
                    header = decode_header(raw.cpu())  # CUDA: syncs the comm stream
                    payload = torch.empty(header.shape, dtype=header.dtype, device=self.device)
                    if payload.numel():
                        dist.recv(payload, src, group=group)
                    ready = None
                    if stream is not None:
                        ready = torch.cuda.Event()
                        ready.record(stream)
                elapsed = time.perf_counter() - t0
            except BaseException as exc:
                self._fail("recv from", src, header, exc)
                return
            msg = Message(header.kind, header.microbatch, header.chunk, payload, src, ready)
            with self._cv:
                s = self._stats
                s.messages_received += 1
                s.bytes_received += payload.numel() * payload.element_size()
                s.recv_seconds += elapsed
                self._expected[src] -= 1
            if not self._deliver(msg):
                return

    # ---- helpers ----------------------------------------------------------------------
    def _deliver(self, msg: Message) -> bool:
        try:
            self._on_message(msg)
            return True
        except BaseException as exc:
            self._fail("deliver from", msg.src, f"{msg.kind}(mb={msg.microbatch}, chunk={msg.chunk})", exc)
            return False

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

    def _new_stream(self) -> Optional[torch.cuda.Stream]:
        # One stream per thread: NCCL ops of different peers on one stream would serialize
        # on the GPU, re-creating the cross-direction ordering deadlock the groups avoid.
        return torch.cuda.Stream(device=self.device) if self._cuda else None

    @staticmethod
    def _on(stream: Optional[torch.cuda.Stream]):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
