"""``1x`` in bytes: the arbiter's memory rule with per-stage byte weights.

Forwards in flight bound memory in *units*; under the B/W split a unit's bytes differ by
stage (the last stage's include loss and logits) and by state (a forward held for its B, a
deferred W's stash after it), and a split B grows the stash of output gradients while its own
saved tensors are still alive. So each stage carries measured weights (``StageBytes``) and a
budget (``ByteBudget``), and the arbiter keeps its modelled level

    level = sum over held forwards of ``forward`` + sum over pending W of ``pending``

within the budget: a forward runs only while level + ``forward_peak`` <= ``admit`` (the
oldest unfinished microbatch excepted: it must always be able to finish, so the rule cannot
deadlock), and a B is *split* (its W deferred) only while level + ``split_peak`` <= ``split``;
otherwise it runs unsplit (its W is then a no-op), which holds no stash — Megatron's own
backward. B and W never raise the level above the budget, so the banker's argument of
arbiter.py holds with bytes in place of units.

Budgets (pure Python; the runtime measures, ``mcore/byte_limit.py``):

* ``first_call_budgets``: the first training call, before anything is measured, in units
  (every weight 1): a forward runs while the stage holds fewer than *its own* Megatron 1F1B
  count (min(PP - s, M)), and a B splits only with one unit of headroom below Megatron's
  fullest stage — so no stage holds more units than Megatron's schedule holds there, and a
  split B's transient fits in a unit;
* ``calibrated_budgets``: from each stage's measured weights, every stage's budget is
  Megatron 1F1B's peak bytes, max over stages (``megatron_peak_bytes``: its own count times
  its bytes per forward, the exact figure Megatron's schedule holds on the CPU meter).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .actions import peak_in_flight
from .hints import megatron_1f1b_order
from .topology import Topology


@dataclass(frozen=True, slots=True)
class StageBytes:
    """One stage's measured bytes (or units): what the arbiter's level model counts."""

    forward: float
    """Bytes one (microbatch, chunk) forward holds until its backward (saved tensors)."""
    forward_peak: float
    """Peak of a forward above the level before it (>= ``forward``)."""
    pending: float
    """Bytes a split B leaves for its deferred W (inputs and output gradients)."""
    split_peak: float
    """Peak of a split B above the level before it (its stash grows while its saved tensors live)."""

    def __post_init__(self) -> None:
        for name in ("forward", "forward_peak", "pending", "split_peak"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"StageBytes.{name} must be >= 0, got {getattr(self, name)!r}")


UNIT = StageBytes(1.0, 1.0, 1.0, 1.0)


@dataclass(frozen=True, slots=True)
class ByteBudget:
    """A stage's weights and budgets, in the weights' unit."""

    stage: StageBytes
    admit: float
    """A forward runs while level + forward_peak <= admit (the oldest microbatch excepted)."""
    split: float
    """A B defers its W while level + split_peak <= split; else it runs unsplit."""


def megatron_counts(topology: Topology, num_microbatches: int) -> list[int]:
    """Per stage, the forwards Megatron's own schedule holds at its peak there."""
    return [peak_in_flight(megatron_1f1b_order(s, topology, num_microbatches)) for s in range(topology.num_stages)]


def first_call_budgets(topology: Topology, num_microbatches: int) -> tuple[ByteBudget, ...]:
    """Before any measurement (module docstring): units, each stage's own Megatron count."""
    counts = megatron_counts(topology, num_microbatches)
    fullest = max(counts)
    return tuple(ByteBudget(UNIT, admit=float(count), split=float(fullest)) for count in counts)


def megatron_peak_bytes(stages: Sequence[StageBytes], topology: Topology, num_microbatches: int) -> float:
    """Megatron 1F1B's peak activation bytes, max over stages: its count there x bytes per forward."""
    return max(count * s.forward for count, s in zip(megatron_counts(topology, num_microbatches), stages))


def calibrated_budgets(stages: Sequence[StageBytes], topology: Topology, num_microbatches: int, *,
                       multiple: float = 1.0) -> tuple[ByteBudget, ...]:
    """Every stage within ``multiple`` x Megatron 1F1B's peak bytes (max over stages)."""
    if len(stages) != topology.num_stages:
        raise ValueError(f"{len(stages)} stages' bytes for a pipeline of {topology.num_stages}")
    budget = multiple * megatron_peak_bytes(stages, topology, num_microbatches)
    return tuple(ByteBudget(s, admit=budget, split=budget) for s in stages)


__all__ = ["UNIT", "ByteBudget", "StageBytes", "calibrated_budgets", "first_call_budgets", "megatron_counts",
           "megatron_peak_bytes"]
