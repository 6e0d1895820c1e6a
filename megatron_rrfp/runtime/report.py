"""What one rank did in one iteration, as measured by the executor."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..policy.actions import Task, format_order
from ..trace.chrome import Span

BREAKDOWN_FIELDS = ("compute_s", "wait_s", "backpressure_s", "agree_s", "flush_s")
"""Seconds per iteration in each state of the compute thread (``IterationReport``'s fields)."""


class PipelineStallError(RuntimeError):
    """No progress within the timeout, or a peer failed: carries this rank's state."""


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
    agree_s: float = 0.0  # blocked on TP agreement (its exchanges run beside the tasks)
    agree_rounds: int = 0
    agree_collective_s: float = 0.0  # inside the agreement all-gathers (helper thread), incl. peer skew
    agree_peer_wait_s: float = 0.0  # part of agree_s spent until the slowest TP peer had posted
    flush_s: float = 0.0  # waiting for the last sends to be taken by the peers
    peak_in_flight: int = 0  # (microbatch, chunk) forwards whose backward (W when split) had not run
    peak_deferred_wgrad_bytes: int = 0  # BFW: activations/grads held for deferred W tasks
    peak_activation_bytes: int = 0  # over the schedule call, relative to its start (runtime/memory.py)
    activation_measure: str = ""  # how: "cuda-allocator", "cuda-allocator-bound" (an upper bound) or "saved-tensors"
    buffer_limit: int = 0  # the arbiter's resolved limit on this stage (0: the limit did not apply)
    byte_budget: float = 0.0  # the arbiter's byte budget on this stage (0: none; policy/membytes.py)
    byte_weights: tuple = ()  # (forward, forward_peak, pending, split_peak, admit, split) it ran with, or ()
    unsplit_backwards: int = 0  # B the byte budget ran unsplit (W a no-op)
    task_bytes: Optional[dict] = None  # runtime.memory.TaskBytes.figures(): what this call's tasks weighed
    spans: list[Span] = field(default_factory=list)
    pairs: list[tuple[Task, Task]] = field(default_factory=list)  # (F, B) run as one combined step (also in order)

    @property
    def order_string(self) -> str:
        return format_order(self.order)
