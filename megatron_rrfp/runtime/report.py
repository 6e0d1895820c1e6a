"""What one rank did in one iteration, as measured by the executor."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..policy.actions import Task, format_order
from ..trace.chrome import Span

BREAKDOWN_FIELDS = ("compute_s", "wait_s", "backpressure_s", "agree_s", "flush_s")
"""Seconds per iteration in each state of the compute thread (``IterationReport``'s fields)."""


@dataclass(slots=True)
class IterationReport:
    """What one rank did in one iteration (measured)."""

    rank: int
    stage: int
    order: list[Task]
    started_at: float = 0.0  # this rank's host clock (time.time()) at the start; spans count from here
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
