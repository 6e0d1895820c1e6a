"""Ready-set arbitration: (ready set, stage state) -> next task, or wait.

Pure Python, no torch: the simulator and the distributed executor both drive this class,
so what the simulator predicts is what the executor does. Given the same sequence of
ready sets, every instance makes the same choices — tensor-parallel ranks rely on that.

Memory bound (the paper's backpressure). ``in_flight`` = forwards run minus backwards
run (minus *weight* tasks when the backward is split, since a deferred W still holds
its activations). Once ``in_flight >= buffer_limit`` no new microbatch may start:
only backward-direction tasks (B, W) and the next forward of the *focus* microbatch —
the lowest started-but-unfinished one, completed in the order F0..F(C-1), B(C-1)..B0 —
are allowed. Non-interleaved this is "drain backward only"; interleaved it is "finish
one microbatch at a time". Hence in_flight <= limit (<= limit + C - 1 interleaved).

Strict mode runs the hint's order exactly (the fixed-order baseline inside the same
runtime); its memory is the order's own, so the buffer limit does not apply.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Optional

from .actions import Kind, Task, all_tasks, format_order
from .hints import Hint, OrderedHint, make_hint, validate_order
from .topology import Topology

DEFAULT_HINT = "bf"
DEFAULT_BUFFER_LIMIT = 32
"""Microbatches in flight per stage before backpressure (the paper's default)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ArbiterConfig:
    """How one stage arbitrates. The hint is parsed here, once: a bad name or file fails
    when the config is built, and every arbiter built from it shares the parsed hint."""

    hint: str | Hint = DEFAULT_HINT
    """bf | bfw | 1f1b | gpipe | path of a JSON / CSV hint file | a Hint object; a Hint after init."""
    buffer_limit: int = DEFAULT_BUFFER_LIMIT
    """Max microbatches in flight (forwards whose backward has not run). >= 1."""
    strict: bool = False
    """True: wait for the next listed task (fixed order). False: readiness-first."""

    def __post_init__(self) -> None:
        if isinstance(self.buffer_limit, bool) or not isinstance(self.buffer_limit, int) or self.buffer_limit < 1:
            raise ValueError(
                f"buffer_limit (--rrfp-buffer-limit) must be an integer >= 1, got {self.buffer_limit!r}; "
                f"{DEFAULT_BUFFER_LIMIT} is the default"
            )
        object.__setattr__(self, "hint", make_hint(self.hint))

    @property
    def parsed_hint(self) -> Hint:
        return self.hint  # type: ignore[return-value]  # always a Hint after __post_init__


class Arbiter:
    """Per-stage policy state. Call ``choose(ready)`` then ``record(task)`` on dispatch.

    ``order`` is this stage's full task order, needed by ordered hints and strict mode;
    ``plan.Plan`` builds and validates it (for a strict rule hint it is materialised by a
    dry run). Ordered hints compute it themselves when it is not given.
    """

    def __init__(self, config: ArbiterConfig, *, stage: int, topology: Topology,
                 num_microbatches: int, forward_only: bool = False,
                 order: Optional[list[Task]] = None) -> None:
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        if not 0 <= stage < topology.num_stages:
            raise ValueError(f"stage {stage} outside pipeline of {topology.num_stages} stages")
        self.config = config
        self.hint = config.parsed_hint
        self.stage = stage
        self.topology = topology
        self.num_microbatches = num_microbatches
        self.forward_only = forward_only
        self.split_backward = self.hint.split_backward and not forward_only
        self.tasks = all_tasks(num_microbatches, topology.num_chunks,
                               split_backward=self.split_backward, forward_only=forward_only)
        self.prefer = Kind.B  # BF rounds start with the backward slot
        self.in_flight = 0
        self.peak_in_flight = 0
        self.dispatched: list[Task] = []
        self.dispatched_set: set[Task] = set()
        self._order: Optional[list[Task]] = None
        self._order_pos = 0
        if config.strict or isinstance(self.hint, OrderedHint):
            self._order = self._checked_order(order)

    # -- policy ----------------------------------------------------------------------

    def choose(self, ready: Iterable[Task]) -> Optional[Task]:
        """The task to dispatch now, or None to wait for the next readiness event."""
        ready = set(ready)
        if self.config.strict:
            nxt = self.next_in_order()
            return nxt if nxt is not None and nxt in ready else None
        if not ready:
            return None
        return self.hint.pick(self._allowed(ready), self)

    def record(self, task: Task) -> None:
        """The driver dispatched ``task``: update counters and hint position."""
        if task in self.dispatched_set:
            raise RuntimeError(f"stage {self.stage}: task {task} dispatched twice; dispatched so far: "
                               f"{format_order(self.dispatched)}")
        self.dispatched_set.add(task)
        self.dispatched.append(task)
        if task.kind is Kind.F:
            self.prefer = Kind.B
            if not self.forward_only:
                self.in_flight += 1
        elif task.kind is Kind.B:
            self.prefer = Kind.F
            if not self.split_backward:
                self.in_flight -= 1
        else:  # W releases the activations a split backward kept
            self.in_flight -= 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        if self._order is not None:
            while self._order_pos < len(self._order) and self._order[self._order_pos] in self.dispatched_set:
                self._order_pos += 1

    @property
    def done(self) -> bool:
        return len(self.dispatched) == len(self.tasks)

    @property
    def at_limit(self) -> bool:
        return not self.forward_only and self.in_flight >= self.config.buffer_limit

    def next_in_order(self) -> Optional[Task]:
        return self._order[self._order_pos] if self._order and self._order_pos < len(self._order) else None

    def remaining_order(self) -> Iterator[Task]:
        assert self._order is not None
        for task in self._order[self._order_pos:]:
            if task not in self.dispatched_set:
                yield task

    def describe(self) -> dict:
        """State for diagnostics (hang dumps, TP disagreement reports)."""
        return {
            "stage": self.stage,
            "hint": self.hint.name,
            "strict": self.config.strict,
            "dispatched": len(self.dispatched),
            "total": len(self.tasks),
            "in_flight": self.in_flight,
            "buffer_limit": self.config.buffer_limit,
            "prefer": self.prefer.value,
            "next_in_order": str(self.next_in_order()) if self._order else None,
            "last_dispatched": format_order(self.dispatched[-6:]),
        }

    # -- internals -------------------------------------------------------------------

    def _checked_order(self, order: Optional[list[Task]]) -> list[Task]:
        if order is None:
            orders = self.hint.orders(self.topology, self.num_microbatches)
            if orders is None:
                raise ValueError(f"strict {self.hint.name!r} needs its materialised order: build arbiters "
                                 "through megatron_rrfp.policy.plan.Plan")
            order = orders[self.stage]
        if self.forward_only:
            order = [t for t in order if t.kind is Kind.F]
        validate_order(order, self.tasks, stage=self.stage, hint_name=self.hint.name)
        return list(order)

    def _allowed(self, ready: set[Task]) -> set[Task]:
        if not self.at_limit:
            return ready
        allowed = {t for t in ready if t.kind is not Kind.F}
        focus_next = self._focus_next_forward()
        if focus_next is not None and focus_next in ready:
            allowed.add(focus_next)
        return allowed

    def _focus_next_forward(self) -> Optional[Task]:
        """Next forward of the lowest started, unfinished microbatch (interleaved only)."""
        chunks = self.topology.num_chunks
        if chunks == 1:
            return None
        for mb in range(self.num_microbatches):
            if Task(Kind.F, mb, 0) not in self.dispatched_set:
                continue
            for chunk in range(1, chunks):
                task = Task(Kind.F, mb, chunk)
                if task not in self.dispatched_set:
                    return task
            last_kind = Kind.W if self.split_backward else Kind.B
            if any(Task(last_kind, mb, c) not in self.dispatched_set for c in range(chunks)):
                return None  # focus is in its backward phase: B/W are allowed anyway
        return None


__all__ = ["DEFAULT_BUFFER_LIMIT", "DEFAULT_HINT", "Arbiter", "ArbiterConfig"]
