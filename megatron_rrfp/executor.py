"""The readiness-first runtime loop of one pipeline rank, for one iteration.

Framework-agnostic: it owns readiness (which inputs arrived), asks the ``Arbiter`` (or,
with tensor parallelism, ``TPAgreement``) what to run, and hands the task to a
``StageWork`` that knows how to compute it (``schedule.py`` plugs Megatron-core in).
Messages arrive on transport threads into an ``Inbox``; the loop never blocks on one
particular microbatch — it waits only when nothing allowed is ready.

Failure handling: a transport error (peer died) or ``timeout_s`` without any progress
raises ``PipelineStallError`` carrying a dump of this rank's ready set and counters.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

import torch

from .actions import Kind, Task, format_order
from .agreement import TPAgreement
from .arbiter import Arbiter
from .topology import Topology
from .trace import Span


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
        with self._cv:
            self._messages.append(message)
            self._cv.notify()

    def fail(self, error: BaseException) -> None:
        with self._cv:
            self._error = error
            self._cv.notify()

    def drain(self) -> list:
        with self._cv:
            if self._error is not None:
                raise self._error
            messages, self._messages = self._messages, []
            return messages

    def wait(self, timeout: float) -> None:
        with self._cv:
            if not self._messages and self._error is None:
                self._cv.wait(timeout)


@dataclass(slots=True)
class IterationReport:
    """What one rank did in one iteration (measured)."""

    rank: int
    stage: int
    order: list[Task]
    wall_s: float = 0.0
    compute_s: float = 0.0
    wait_s: float = 0.0  # blocked on readiness: the pipeline bubble seen by this rank
    backpressure_s: float = 0.0  # blocked while forwards were ready but the buffer was full
    agree_s: float = 0.0  # inside TP agreement collectives
    agree_rounds: int = 0
    flush_s: float = 0.0  # waiting for the last sends to be taken by the peers
    peak_in_flight: int = 0
    peak_deferred_wgrad_bytes: int = 0  # BFW: activations/grads held for deferred W tasks
    spans: list[Span] = field(default_factory=list)

    @property
    def order_string(self) -> str:
        return format_order(self.order)


class PipelineIteration:
    """Run every task of one stage for one iteration."""

    def __init__(self, *, work: StageWork, arbiter: Arbiter, topology: Topology, stage: int,
                 stage_ranks: list[int], transport, inbox: Inbox, agreement: Optional[TPAgreement],
                 timeout_s: float, forward_only: bool, record_spans: bool = False,
                 task_delay: Optional[Callable[[Task], float]] = None) -> None:
        self.work, self.arbiter, self.topology, self.stage = work, arbiter, topology, stage
        self.stage_ranks, self.transport, self.inbox, self.agreement = stage_ranks, transport, inbox, agreement
        self.timeout_s, self.forward_only, self.record_spans = timeout_s, forward_only, record_spans
        self.task_delay = task_delay
        self.rank = stage_ranks[stage]
        self.ready: set[Task] = set()
        self.activations: dict[tuple[int, int], torch.Tensor] = {}
        self.gradients: dict[tuple[int, int], torch.Tensor] = {}
        self.forward_done: set[tuple[int, int]] = set()
        self.backwards_left = 0 if forward_only else arbiter.num_microbatches * topology.num_chunks
        self.report = IterationReport(rank=self.rank, stage=stage, order=arbiter.dispatched)
        self._last_progress = time.monotonic()
        self._t0 = 0.0

    # -- the loop --------------------------------------------------------------------

    def run(self) -> IterationReport:
        self._t0 = time.time()
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
            messages = self.inbox.drain()
        except Exception as exc:
            raise PipelineStallError(self._diagnosis(f"transport failed: {exc}")) from exc
        for message in messages:
            key = (message.microbatch, message.chunk)
            self._last_progress = time.monotonic()
            if message.kind == "activation":
                if key in self.activations or Task(Kind.F, *key) in self.arbiter.dispatched_set:
                    raise PipelineStallError(self._diagnosis(f"duplicate activation {key} from rank {message.src}"))
                self.activations[key] = message.wait()
                self.ready.add(Task(Kind.F, *key))
            else:
                if key in self.gradients or self.forward_only:
                    raise PipelineStallError(self._diagnosis(f"unexpected gradient {key} from rank {message.src}"))
                self.gradients[key] = message.wait()
                if key in self.forward_done:
                    self.ready.add(Task(Kind.B, *key))

    # -- executing one task ----------------------------------------------------------

    def _execute(self, task: Task) -> None:
        mb, chunk = task.microbatch, task.chunk
        start = time.time()
        if self.task_delay is not None:
            time.sleep(max(0.0, self.task_delay(task)))  # emulated device time (benchmarks, tests)
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
        end = time.time()
        self.report.compute_s += end - start
        self._span(str(task), task.kind.value, start, end)

    def _sender(self, kind: str, mb: int, peer: tuple[int, int]) -> Callable[[torch.Tensor], None]:
        dst = self.stage_ranks[peer[0]]
        return lambda tensor: self.transport.send(dst, kind, mb, peer[1], tensor)

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

    def _span(self, name: str, category: str, start: float, end: float) -> None:
        if self.record_spans and end > start:
            self.report.spans.append(Span(self.rank, name, category, start - self._t0, end - self._t0))

    def _diagnosis(self, reason: str) -> str:
        state = self.arbiter.describe()
        return (f"rank {self.rank} (pipeline stage {self.stage}): {reason}\n"
                f"  arbiter: {state}\n"
                f"  ready: {format_order(sorted(self.ready, key=str)) or '-'}\n"
                f"  activations waiting: {sorted(self.activations)}  gradients waiting: {sorted(self.gradients)}\n"
                f"  forwards done: {len(self.forward_done)}  backwards left: {self.backwards_left}\n"
                f"  dispatched: {format_order(self.arbiter.dispatched) or '-'}\n"
                f"  peers (stage -> rank): {dict(enumerate(self.stage_ranks))}")
