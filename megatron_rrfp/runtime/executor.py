"""The readiness-first runtime loop of one pipeline rank, for one iteration.

Framework-agnostic: it owns readiness (which inputs arrived), asks the ``Arbiter`` (with
tensor parallelism, from values the TP group agreed: ``agreed_choice.py``) what to run, and hands the task to a
``StageWork`` that knows how to compute it (``schedule.py`` plugs Megatron-core in).
Messages arrive on transport threads into an ``Inbox``; the loop never blocks on one
particular microbatch — it waits only when nothing allowed is ready.

Failure handling: a transport error (peer died) or ``timeout_s`` without any progress
raises ``PipelineStallError`` carrying a dump of this rank's ready set and counters.

The transport is driven from this loop at every decision: ``advance(state)`` lets it
issue what the (agreed) progress counters allow (``rounds.py`` issues device
rounds there, so every TP rank issues them at the same point of its task sequence),
``can_dispatch()`` keeps the host at most a few tasks ahead of the device, and a
received tensor is waited for (``Message.wait()``) only when the task that uses it runs.

Under the DP epoch rule (``epochs``: an ``EpochBook``, docs/design/dp-epochs.md) the choice is
``policy.epochs.choose`` — readiness-first between this stage's DP points, each DP point in its
place of Megatron's order — and the transport issues rounds in epoch order.

Profiling: every task runs inside a ``record_function`` / NVTX range named like "0F3"
(``profiling.py``). With ``record_spans`` the report keeps each task's span (device time on
CUDA), each wait, and each received message ("recv" spans from its arrival to its
absorption); a task that sent a message and the receiver's "recv" span carry the same
message key, from which traces draw a flow arrow from the send to the receive.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Optional, Protocol

import torch

from ..policy.actions import Kind, Task, format_order
from ..policy.arbiter import Arbiter
from ..policy.epochs import EpochBook
from ..policy.epochs import choose as choose_under_rule
from ..policy.topology import Topology
from ..trace.chrome import Span, message_key
from .agreed_choice import AgreedChoice
from .agreement import TPAgreement
from .inbox import Deliver, Inbox
from .memory import ActivationMeter, TaskBytes
from .profiling import TaskClock
from .report import BREAKDOWN_FIELDS, IterationReport, PipelineStallError
from .transport import TransportError


class StageWork(Protocol):
    def forward(self, task: Task, input_tensor: Optional[torch.Tensor],
                send: Optional[Callable[[torch.Tensor], None]]) -> None: ...

    def backward(self, task: Task, output_grad: Optional[torch.Tensor],
                 send: Optional[Callable[[torch.Tensor], None]]) -> None: ...

    def weight(self, task: Task) -> None: ...

    # with ``ArbiterConfig.pair_forward_backward`` only: (F task, input, send) and (B task, output
    # gradient, send) run as one combined step
    def pair(self, forward: tuple, backward: tuple) -> None: ...


AroundTask = Callable[[Task, Callable[[], None]], None]
"""``around_task(task, run)``: called for each F / B / W with ``run()``, which does the task's
work; runs it once, on the loop's thread (instrumentation: profiler ranges, emulated device time)."""


class Transport(Protocol):
    """What the loop needs from a transport (``transport.StageTransport``,
    ``rounds.RoundTransport``)."""

    state_words: int  # length of local_state(): progress counters agreed across TP ranks
    poll_interval: Optional[float]  # re-check this often while waiting (None: the inbox wakes us)

    def send(self, dst: int, kind: str, microbatch: int, chunk: int, tensor: torch.Tensor) -> None: ...

    def expect(self, src: int, count: int) -> None: ...

    def local_state(self) -> tuple[int, ...]: ...

    def advance(self, state: tuple[int, ...]) -> None: ...

    def can_dispatch(self) -> bool: ...

    def task_launched(self) -> None: ...

    def idle(self) -> bool: ...

    def flush(self, timeout: float) -> None: ...


class PipelineIteration(AgreedChoice):
    """Run every task of one stage for one iteration."""

    def __init__(self, *, work: StageWork, arbiter: Arbiter, topology: Topology, stage: int,
                 stage_ranks: list[int], transport, inbox: Inbox, agreement: Optional[TPAgreement],
                 timeout_s: float, forward_only: bool, record_spans: bool = False,
                 memory: Optional[ActivationMeter] = None, measure_task_bytes: bool = False,
                 around_task: Optional[AroundTask] = None, deliver_message: Optional[Deliver] = None,
                 epochs: Optional[EpochBook] = None) -> None:
        self.work, self.arbiter, self.topology, self.stage = work, arbiter, topology, stage
        self.epochs = epochs  # the DP epoch rule's book for this stage and iteration, or None
        self.around_task = around_task  # RRFPConfig.around_task: each F / B / W's work runs inside it
        inbox.deliver = deliver_message  # RRFPConfig.deliver_message: how arriving messages reach this loop
        self.memory = memory  # counts the messages waiting here as held activation memory
        # what each task weighs, for the byte budget's calibration call only (mcore/byte_limit.py):
        # every other call keeps the per-task windows off its hot path
        measuring = measure_task_bytes and memory is not None and not forward_only
        self.task_bytes = TaskBytes(memory) if measuring else None
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
        self._posted_view: tuple = ()
        self._first_decision = True
        self._expected: dict[int, int] = {}  # messages this iteration per source rank
        self._links: list[int] = []
        self._arrivals: dict[int, list] = {}  # per source, in arrival order: (kind, (mb, chunk))
        self._initial: set[Task] = set()

    # -- the loop --------------------------------------------------------------------

    def run(self) -> IterationReport:
        self._t0 = self.report.started_at = time.time()
        use_epochs = getattr(self.transport, "use_epochs", None)
        if use_epochs is not None:
            use_epochs(self.epochs)  # set (or cleared) before this iteration's first message
        elif self.epochs is not None:
            raise ValueError("the DP epoch rule needs the rounds transport (--rrfp-transport rounds)")
        self._post_expectations()
        m = self.arbiter.num_microbatches
        if self.topology.is_first(self.stage, 0):
            self.ready.update(Task(Kind.F, mb, 0) for mb in range(m))
        self._initial = set(self.ready)
        try:
            try:
                while (task := self._next_task()) is not None:
                    self._dispatch(task)
            finally:
                if self.agreement is not None:
                    self.agreement.close()
            start = time.time()
            self.transport.flush(self.timeout_s)
        except TransportError as exc:  # a send, an issued round or the flush found the peer gone
            raise PipelineStallError(self._diagnosis(f"transport failed: {exc}")) from exc
        self.report.flush_s = time.time() - start
        self.clock.resolve(self._t0)
        self.report.wall_s = time.time() - self._t0
        self.report.peak_in_flight = self.arbiter.peak_in_flight
        if self.task_bytes is not None:
            self.report.task_bytes = self.task_bytes.figures()
        self.report.unsplit_backwards = self.arbiter.unsplit_backwards
        self.report.pairs = list(self.arbiter.pairs)
        if self.agreement is not None:
            stats = self.agreement.stats
            self.report.agree_s = stats.blocked_s
            self.report.agree_rounds = stats.rounds
            self.report.agree_collective_s = stats.collective_s
            self.report.agree_peer_wait_s = stats.peer_wait_s
        return self.report

    def _dispatch(self, task: Task) -> None:
        partner = self.arbiter.take_partner(task)  # the same on every agreeing rank: chosen from the same set
        if partner is not None and self.task_bytes is None:  # the byte calibration weighs tasks one by one
            self._dispatch_pair(task, partner)
            return
        enabled = self._enabled_by(task)  # decided now, so the next offer can include it
        self.ready.discard(task)
        self.arbiter.record(task)
        if self.epochs is not None:
            self.epochs.dispatched(task)
        if self.agreement is not None:
            self.agreement.commit(task)
            self._absorb()
            self._post_offer(enabled)  # the next decision's exchange runs while this task computes
        self._execute(task, enabled)
        self.transport.task_launched()
        self._last_progress = time.monotonic()

    def _next_task(self) -> Optional[Task]:
        """The next task (the same on every rank of the TP group), or None when the
        iteration is over here: every task dispatched, nothing left for the transport to issue."""
        if self.agreement is not None:
            return self._agreed_task()
        while True:
            state = self.transport.local_state()  # what advance() saw: a later record is a change
            self.transport.advance(state)
            self._absorb()
            if self.arbiter.done and self.transport.idle():
                return None
            room = self.transport.can_dispatch()
            if not self.arbiter.done and room:
                task = self._choose(self.ready)
                if task is not None:
                    return task
            self._wait_for_change((frozenset(self.ready), state, room))

    def _choose(self, candidates) -> Optional[Task]:
        if self.epochs is None:
            return self.arbiter.choose(candidates)
        return choose_under_rule(self.epochs, self.arbiter, candidates)

    def _view(self) -> tuple:
        """What can change the next decision: the ready set, the transport's counters and
        whether the device has room for another task."""
        return frozenset(self.ready), self.transport.local_state(), self.transport.can_dispatch()

    def _wait_for_change(self, seen: tuple) -> None:
        """Block until ``_view()`` differs from ``seen`` (or fail after timeout_s)."""
        self._await(lambda: self._view() != seen)

    def _await(self, condition: Callable[[], bool]) -> None:
        """Absorb arrivals until ``condition()`` holds; the time is the stage's bubble."""
        self._absorb()
        if condition():
            return
        start = time.time()
        blocked_by_limit = self.arbiter.memory_blocked(self.ready)
        poll = self.transport.poll_interval or 1.0
        while True:
            self._absorb()
            if condition():
                break
            idle = time.monotonic() - self._last_progress
            if idle > self.timeout_s:
                raise PipelineStallError(self._diagnosis(f"no progress for {idle:.1f}s (timeout {self.timeout_s}s)"))
            self.inbox.wait(min(poll, self.timeout_s - idle + 0.01))
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
            self._arrivals[message.src].append((message.kind, key))
            if self.memory is not None:
                self.memory.hold(message.tensor)  # its buffer is held from now on, waited on or not
            if message.kind == "activation":  # message.wait() only when its task runs
                self.activations[key] = message
                self.ready.add(Task(Kind.F, *key))
            else:
                self.gradients[key] = message
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

    def _enabled_by(self, task: Task) -> set[Task]:
        """What becomes ready once ``task`` ran (known before it runs)."""
        mb, chunk = task.microbatch, task.chunk
        if task.kind is Kind.F and not self.forward_only:
            if self.topology.downstream(self.stage, chunk) is None or (mb, chunk) in self.gradients:
                return {Task(Kind.B, mb, chunk)}
        if task.kind is Kind.B and self.arbiter.split_backward:
            return {Task(Kind.W, mb, chunk)}  # its weight gradients may then run
        return set()

    def _execute(self, task: Task, enabled: set[Task]) -> None:
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
        self.ready |= enabled

    def _run_task(self, task: Task) -> None:
        mb, chunk = task.microbatch, task.chunk
        if task.kind is Kind.F:
            downstream = self.topology.downstream(self.stage, chunk)
            send = None if downstream is None else self._sender("activation", mb, downstream)
            received = self._take(self.activations, (mb, chunk))
            if self.task_bytes is not None:
                self.task_bytes.begin()
            self._work(task, self.work.forward, received, send)
            self._released(received)
            if self.task_bytes is not None:
                self.task_bytes.end_forward(received)
            self.forward_done.add((mb, chunk))
        elif task.kind is Kind.B:
            upstream = self.topology.upstream(self.stage, chunk)
            send = None if upstream is None else self._sender("gradient", mb, upstream)
            self.backwards_left -= 1
            received = self._take(self.gradients, (mb, chunk))
            measured = self.task_bytes if self.arbiter.defers_weight(task) else None
            if measured is not None:
                measured.begin()
            self._work(task, self.work.backward, received, send)
            self._released(received)
            if measured is not None:
                measured.end_split_backward()
        else:
            self._work(task, self.work.weight)

    def _dispatch_pair(self, task: Task, partner: Task) -> None:
        """A forward and a backward dispatched together (``ArbiterConfig.pair_forward_backward``):
        recorded and agreed as the backward, then the forward; run as one combined step."""
        enabled = self._enabled_by(task) | self._enabled_by(partner)
        self.ready.difference_update((task, partner))
        self.arbiter.record_pair(task, partner)
        forward, backward = self.arbiter.pairs[-1]
        if self.epochs is not None:
            self.epochs.dispatched(backward)
            self.epochs.dispatched(forward)
        if self.agreement is not None:
            self.agreement.commit(backward)
            self.agreement.commit(forward)
            self._absorb()
            self._post_offer(enabled)
        name = f"{forward}+{backward}"
        start = time.time()
        with self.clock.task(name) as events:
            self._run_pair(forward, backward)
        end = time.time()
        self.report.compute_s += end - start
        if self.record_spans:
            sends = [(key, sent - start) for key, sent in self._sent]
            span = self._span(name, "F+B", start, end, {"flow_out": sends} if sends else None)
            self.clock.on_device(span, events)
            self._sent = []
        self.ready |= enabled
        self.transport.task_launched()
        self._last_progress = time.monotonic()

    def _run_pair(self, forward: Task, backward: Task) -> None:
        downstream = self.topology.downstream(self.stage, forward.chunk)
        forward_send = None if downstream is None else self._sender("activation", forward.microbatch, downstream)
        upstream = self.topology.upstream(self.stage, backward.chunk)
        backward_send = None if upstream is None else self._sender("gradient", backward.microbatch, upstream)
        self.backwards_left -= 1
        activation = self._take(self.activations, (forward.microbatch, forward.chunk))
        gradient = self._take(self.gradients, (backward.microbatch, backward.chunk))

        def run() -> None:
            self.work.pair((forward, activation, forward_send), (backward, gradient, backward_send))
        if self.around_task is None:
            run()
        else:  # each half inside its own around_task (instrumentation sees both tasks)
            self.around_task(forward, lambda: self.around_task(backward, run))
        self._released(activation)
        self._released(gradient)
        self.forward_done.add((forward.microbatch, forward.chunk))

    def _work(self, task: Task, method: Callable, *args) -> None:
        if self.around_task is None:
            method(task, *args)
        else:
            self.around_task(task, lambda: method(task, *args))

    @staticmethod
    def _take(received: dict, key: tuple[int, int]) -> Optional[torch.Tensor]:
        message = received.pop(key, None)
        return None if message is None else message.wait()  # right before its first use

    def _released(self, tensor: Optional[torch.Tensor]) -> None:
        if self.memory is not None and tensor is not None:
            self.memory.release(tensor)  # what autograd saved of it stays counted by the meter

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
        self._expected = counts
        self._links = sorted(counts, key=self.stage_ranks.index)  # the same order on every agreeing rank
        self._arrivals = {src: [] for src in counts}

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


__all__ = ["BREAKDOWN_FIELDS", "AroundTask", "Inbox", "IterationReport", "PipelineIteration", "PipelineStallError",
           "StageWork", "Transport"]
