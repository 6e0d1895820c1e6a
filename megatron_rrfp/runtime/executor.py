"""The readiness-first runtime loop of one pipeline rank, for one iteration.

Framework-agnostic: it owns readiness (which inputs arrived), asks the ``Arbiter`` (or,
with tensor parallelism, ``TPAgreement``) what to run, and hands the task to a
``StageWork`` that knows how to compute it (``schedule.py`` plugs Megatron-core in).
Messages arrive on transport threads into an ``Inbox``; the loop never blocks on one
particular microbatch — it waits only when nothing allowed is ready.

Failure handling: a transport error (peer died) or ``timeout_s`` without any progress
raises ``PipelineStallError`` carrying a dump of this rank's ready set and counters.

Profiling: every task runs inside a ``record_function`` / NVTX range named like "0F3"
(``profiling.py``). With ``record_spans`` the report keeps each task's span (device time on
CUDA), each wait, and each received message ("recv" spans from its arrival to its
absorption); a task that sent a message and the receiver's "recv" span carry the same
message key, from which traces draw a flow arrow from the send to the receive.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Optional, Protocol

import torch

from ..policy.actions import Kind, Task, format_order
from ..policy.arbiter import Arbiter
from ..policy.topology import Topology
from ..trace.chrome import Span, message_key
from .agreement import TPAgreement
from .profiling import TaskClock
from .report import BREAKDOWN_FIELDS, IterationReport


class PipelineStallError(RuntimeError):
    """No progress within the timeout, or a peer failed: carries this rank's state."""


class StageWork(Protocol):
    def forward(self, task: Task, input_tensor: Optional[torch.Tensor],
                send: Optional[Callable[[torch.Tensor], None]]) -> None: ...

    def backward(self, task: Task, output_grad: Optional[torch.Tensor],
                 send: Optional[Callable[[torch.Tensor], None]]) -> None: ...

    def weight(self, task: Task) -> None: ...


class Inbox:
    """Thread-safe mailbox between transport threads and the compute loop."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._messages: list = []
        self._error: Optional[BaseException] = None

    def put(self, message) -> None:
        arrived = time.time()  # on the transport thread: when the message was complete here
        with self._cv:
            self._messages.append((arrived, message))
            self._cv.notify()

    def fail(self, error: BaseException) -> None:
        with self._cv:
            self._error = error
            self._cv.notify()

    def drain(self) -> list:
        return [message for _, message in self.drain_timed()]

    def drain_timed(self) -> list:
        """[(arrival time, message)]; raises the transport's error if it failed."""
        with self._cv:
            if self._error is not None:
                raise self._error
            messages, self._messages = self._messages, []
            return messages

    def wait(self, timeout: float) -> None:
        with self._cv:
            if not self._messages and self._error is None:
                self._cv.wait(timeout)


class PipelineIteration:
    """Run every task of one stage for one iteration."""

    def __init__(self, *, work: StageWork, arbiter: Arbiter, topology: Topology, stage: int,
                 stage_ranks: list[int], transport, inbox: Inbox, agreement: Optional[TPAgreement],
                 timeout_s: float, forward_only: bool, record_spans: bool = False) -> None:
        self.work, self.arbiter, self.topology, self.stage = work, arbiter, topology, stage
        self.stage_ranks, self.transport, self.inbox, self.agreement = stage_ranks, transport, inbox, agreement
        self.timeout_s, self.forward_only, self.record_spans = timeout_s, forward_only, record_spans
        self.rank = stage_ranks[stage]
        self.ready: set[Task] = set()
        self.activations: dict[tuple[int, int], torch.Tensor] = {}
        self.gradients: dict[tuple[int, int], torch.Tensor] = {}
        self.forward_done: set[tuple[int, int]] = set()
        self.backwards_left = 0 if forward_only else arbiter.num_microbatches * topology.num_chunks
        self.report = IterationReport(rank=self.rank, stage=stage, order=arbiter.dispatched)
        self.clock = TaskClock(record_spans=record_spans)
        self._sent: list[tuple[str, float]] = []  # (message key, host time) of the running task's sends
        self._last_progress = time.monotonic()
        self._t0 = 0.0

    # -- the loop --------------------------------------------------------------------

    def run(self) -> IterationReport:
        self._t0 = self.report.started_at = time.time()
        self._post_expectations()
        m = self.arbiter.num_microbatches
        if self.topology.is_first(self.stage, 0):
            self.ready.update(Task(Kind.F, mb, 0) for mb in range(m))
        while not self.arbiter.done:
            task = self._next_task()
            self.ready.discard(task)
            self.arbiter.record(task)
            self._execute(task)
            self._last_progress = time.monotonic()
        start = time.time()
        self.transport.flush(self.timeout_s)
        self.report.flush_s = time.time() - start
        self.clock.resolve(self._t0)
        self.report.wall_s = time.time() - self._t0
        self.report.peak_in_flight = self.arbiter.peak_in_flight
        if self.agreement is not None:
            self.report.agree_s = self.agreement.stats.seconds
            self.report.agree_rounds = self.agreement.stats.rounds
        return self.report

    def _next_task(self) -> Task:
        self._absorb()
        if self.agreement is not None:
            start = time.time()
            before = self.agreement.stats.seconds
            task = self.agreement.decide(self._ready_snapshot, self.arbiter.choose,
                                         lambda: len(self.arbiter.dispatched), self._wait_for_change)
            self._span("agree", "agree", start, start + (self.agreement.stats.seconds - before))
            return task
        while True:
            task = self.arbiter.choose(self.ready)
            if task is not None:
                return task
            self._wait_for_change(set(self.ready))

    def _ready_snapshot(self) -> set[Task]:
        self._absorb()
        return set(self.ready)

    def _wait_for_change(self, seen: set[Task]) -> None:
        """Block until the ready set differs from ``seen`` (or fail after timeout_s)."""
        start = time.time()
        blocked_by_limit = self.arbiter.at_limit and any(t.kind is Kind.F for t in self.ready)
        while True:
            self._absorb()
            if self.ready != seen:
                break
            idle = time.monotonic() - self._last_progress
            if idle > self.timeout_s:
                raise PipelineStallError(self._diagnosis(f"no progress for {idle:.1f}s (timeout {self.timeout_s}s)"))
            self.inbox.wait(min(1.0, self.timeout_s - idle + 0.01))
        end = time.time()
        if blocked_by_limit:
            self.report.backpressure_s += end - start
        else:
            self.report.wait_s += end - start
        category = "backpressure" if blocked_by_limit else "wait"
        self._span(category, category, start, end)

    def _absorb(self) -> None:
        try:
            messages = self.inbox.drain_timed()
        except Exception as exc:
            raise PipelineStallError(self._diagnosis(f"transport failed: {exc}")) from exc
        absorbed = time.time()
        for arrived, message in messages:
            self._check_message(message)
            if self.record_spans:
                kind = Kind.F if message.kind == "activation" else Kind.B
                key = message_key(message.src, self.rank, message.kind, message.microbatch, message.chunk)
                self._span(f"recv {Task(kind, message.microbatch, message.chunk)}", "recv", arrived,
                           max(absorbed, arrived + 1e-6), {"flow_in": key, "from": message.src})
            key = (message.microbatch, message.chunk)
            self._last_progress = time.monotonic()
            if message.kind == "activation":
                self.activations[key] = message.wait()
                self.ready.add(Task(Kind.F, *key))
            else:
                self.gradients[key] = message.wait()
                if key in self.forward_done:
                    self.ready.add(Task(Kind.B, *key))

    def _check_message(self, message) -> None:
        """Only a message this iteration is waiting for is accepted: right kind from the
        right neighbour, microbatch and chunk in range, not seen before. Anything else is
        a bug or a stray peer, and fails the iteration at once rather than corrupting it."""
        what = f"{message.kind} for microbatch {message.microbatch}, chunk {message.chunk} from rank {message.src}"
        m, chunks = self.arbiter.num_microbatches, self.topology.num_chunks
        if not (0 <= message.microbatch < m and 0 <= message.chunk < chunks):
            raise PipelineStallError(self._diagnosis(f"unexpected {what}: this iteration has microbatches 0..{m - 1}"
                                                     f" and chunks 0..{chunks - 1}"))
        if message.kind == "activation":
            peer, done = self.topology.upstream(self.stage, message.chunk), Task(Kind.F, message.microbatch,
                                                                                 message.chunk)
            duplicate = (message.microbatch, message.chunk) in self.activations or done in self.arbiter.dispatched_set
        elif message.kind == "gradient" and not self.forward_only:
            peer, done = self.topology.downstream(self.stage, message.chunk), Task(Kind.B, message.microbatch,
                                                                                   message.chunk)
            duplicate = (message.microbatch, message.chunk) in self.gradients or done in self.arbiter.dispatched_set
        else:
            raise PipelineStallError(self._diagnosis(f"unexpected {what}" + (" in a forward-only iteration"
                                                                            if self.forward_only else "")))
        if peer is None or self.stage_ranks[peer[0]] != message.src:
            sender = "no rank" if peer is None else f"rank {self.stage_ranks[peer[0]]}"
            raise PipelineStallError(self._diagnosis(f"unexpected {what}: it must come from {sender}"))
        if duplicate:
            raise PipelineStallError(self._diagnosis(f"duplicate {what}"))

    # -- executing one task ----------------------------------------------------------

    def _execute(self, task: Task) -> None:
        name = str(task)
        start = time.time()
        with self.clock.task(name) as events:
            self._run_task(task)
        end = time.time()
        self.report.compute_s += end - start
        if self.record_spans:
            sends = [(key, sent - start) for key, sent in self._sent]  # seconds into the task
            span = self._span(name, task.kind.value, start, end, {"flow_out": sends} if sends else None)
            self.clock.on_device(span, events)
            self._sent = []

    def _run_task(self, task: Task) -> None:
        mb, chunk = task.microbatch, task.chunk
        if task.kind is Kind.F:
            downstream = self.topology.downstream(self.stage, chunk)
            send = None if downstream is None else self._sender("activation", mb, downstream)
            self.work.forward(task, self.activations.pop((mb, chunk), None), send)
            self.forward_done.add((mb, chunk))
            if not self.forward_only and (downstream is None or (mb, chunk) in self.gradients):
                self.ready.add(Task(Kind.B, mb, chunk))
        elif task.kind is Kind.B:
            upstream = self.topology.upstream(self.stage, chunk)
            send = None if upstream is None else self._sender("gradient", mb, upstream)
            self.backwards_left -= 1
            self.work.backward(task, self.gradients.pop((mb, chunk), None), send)
            if self.arbiter.split_backward:
                self.ready.add(Task(Kind.W, mb, chunk))  # its weight gradients may now run
        else:
            self.work.weight(task)

    def _sender(self, kind: str, mb: int, peer: tuple[int, int]) -> Callable[[torch.Tensor], None]:
        dst = self.stage_ranks[peer[0]]

        def send(tensor: torch.Tensor) -> None:
            if self.record_spans:  # the arrow starts at the send, inside the task's span
                self._sent.append((message_key(self.rank, dst, kind, mb, peer[1]), time.time()))
            self.transport.send(dst, kind, mb, peer[1], tensor)
        return send

    def _post_expectations(self) -> None:
        counts: dict[int, int] = {}
        m = self.arbiter.num_microbatches
        for chunk in range(self.topology.num_chunks):
            up = self.topology.upstream(self.stage, chunk)
            if up is not None:
                counts[self.stage_ranks[up[0]]] = counts.get(self.stage_ranks[up[0]], 0) + m
            down = self.topology.downstream(self.stage, chunk)
            if down is not None and not self.forward_only:
                counts[self.stage_ranks[down[0]]] = counts.get(self.stage_ranks[down[0]], 0) + m
        for src, count in counts.items():
            self.transport.expect(src, count)

    # -- diagnostics -----------------------------------------------------------------

    def _span(self, name: str, category: str, start: float, end: float, args: Optional[dict] = None
              ) -> Optional[Span]:
        if self.record_spans and end > start:
            span = Span(self.rank, name, category, start - self._t0, end - self._t0, args or {})
            self.report.spans.append(span)
            return span
        return None

    def _diagnosis(self, reason: str) -> str:
        state = self.arbiter.describe()
        return (f"rank {self.rank} (pipeline stage {self.stage}): {reason}\n"
                f"  arbiter: {state}\n"
                f"  ready: {format_order(sorted(self.ready, key=str)) or '-'}\n"
                f"  activations waiting: {sorted(self.activations)}  gradients waiting: {sorted(self.gradients)}\n"
                f"  forwards done: {len(self.forward_done)}  backwards left: {self.backwards_left}\n"
                f"  dispatched: {format_order(self.arbiter.dispatched) or '-'}\n"
                f"  peers (stage -> rank): {dict(enumerate(self.stage_ranks))}")


__all__ = ["BREAKDOWN_FIELDS", "Inbox", "IterationReport", "PipelineIteration", "PipelineStallError", "StageWork"]
