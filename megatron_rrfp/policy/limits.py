"""Buffer limits in memory terms: an integer, a multiple of Megatron's own memory, or auto.

A stage's activation memory is counted in *(microbatch, chunk) forwards in flight*:
forwards run minus backwards run (minus W when the backward is split: a deferred W still
holds its inputs). Megatron users size micro-batch, recompute and TP so that Megatron's own
schedule fits; that schedule's peak on its fullest stage is the natural unit, ``1x``::

    BufferLimit.parse("1.5x").resolve(Topology(8), 32)     # -> 12, the arbiter's limit
    megatron_peak_in_flight(Topology(8), 32)               # -> 8 = min(PP, M)
    megatron_peak_in_flight(Topology(4, 2), 16)            # -> 11 = interleaved warm-up + 1

Forms (``BufferLimit.parse`` takes an int, its string, or one of these; the flags
``--rrfp-buffer-limit`` / ``--buffer-limit`` and the ``buffer_limit=`` keyword all go here):

* ``16`` — the arbiter's integer as given (the paper's limit; interleaved stages may run
  ``C - 1`` past it to finish the microbatch in focus, see arbiter.py);
* ``1x`` / ``1.5x`` / ``2x`` — at most floor(k x ``megatron_peak_in_flight``) in flight on
  every stage, chunks included: the arbiter's integer is that minus ``C - 1``;
* ``auto`` — the most that fits the memory measured at run time: ``resolve`` then needs
  the activation bytes one (microbatch, chunk) forward holds and the stage's memory budget;
  it keeps ``AUTO_MARGIN`` of the budget free, never goes below ``1x`` (the calibration
  iteration just ran there) and stops at the stage's M x C forwards. Only a runtime that
  measures can resolve it (``mcore/auto_limit.py``); the simulator cannot.

Pure Python, no torch (the simulator's trade-off curves use it too).
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Union

from .actions import Kind, Task
from .hints import megatron_1f1b_order
from .topology import Topology

DEFAULT_RUNTIME_LIMIT = "auto"
"""What the executor uses unless told otherwise (``--rrfp-buffer-limit``, bench, train):
start at Megatron's memory, grow only into measured free memory."""
AUTO_MARGIN = 0.8
"""``auto`` plans at most this share of the measured budget (allocator fragmentation,
per-microbatch size spread, transient buffers)."""

_MULTIPLE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)x$")
_FORMS = "an integer >= 1 (e.g. 16), a multiple of Megatron's own in-flight memory (1x, 1.5x, 2x) or auto"

LimitSpec = Union[int, str, "BufferLimit"]


@dataclass(frozen=True, slots=True)
class BufferLimit:
    """A buffer limit as stated by the user. Exactly one of ``count``, ``multiple``, ``auto``."""

    count: Optional[int] = None
    multiple: Optional[float] = None
    auto: bool = False

    def __post_init__(self) -> None:
        given = (self.count is not None) + (self.multiple is not None) + bool(self.auto)
        if given != 1:
            raise ValueError(f"a buffer limit is {_FORMS}; got {self!r}")
        if self.count is not None and (isinstance(self.count, bool) or not isinstance(self.count, int)
                                       or self.count < 1):
            raise ValueError(f"buffer limit must be {_FORMS}; got {self.count!r}")
        if self.multiple is not None and not (math.isfinite(self.multiple) and self.multiple > 0):
            raise ValueError(f"buffer limit multiple must be > 0 (e.g. 1x); got {self.multiple!r}x")

    @classmethod
    def parse(cls, value: LimitSpec, *, option: str = "buffer_limit (--rrfp-buffer-limit)") -> BufferLimit:
        """``16`` / ``"16"`` / ``"1.5x"`` / ``"auto"`` / a BufferLimit. ValueError naming ``option``."""
        if isinstance(value, BufferLimit):
            return value
        try:
            if isinstance(value, int) and not isinstance(value, bool):
                return cls(count=value)
            if isinstance(value, str):
                text = value.strip().lower()
                if text == "auto":
                    return cls(auto=True)
                if text.isdigit():
                    return cls(count=int(text))
                match = _MULTIPLE.match(text.replace(" ", ""))
                if match:
                    return cls(multiple=float(match.group(1)))
        except ValueError:
            pass  # one message for every malformed value, below
        raise ValueError(f"{option} must be {_FORMS}; got {value!r}")

    def __str__(self) -> str:
        if self.auto:
            return "auto"
        if self.count is not None:
            return str(self.count)
        return f"{self.multiple:g}x"

    @property
    def measured(self) -> bool:
        """True for ``auto``: resolving needs a measurement (bytes per forward, budget)."""
        return self.auto

    def target(self, topology: Topology, num_microbatches: int, *, group_size: Optional[int] = None) -> int:
        """Forwards in flight this limit allows on a stage (``count``: the arbiter's own bound)."""
        if self.auto:
            raise ValueError("buffer limit auto is measured at run time; resolve() it with bytes_per_forward= "
                             "and budget_bytes=, or give an integer or a multiple such as 1x")
        if self.count is not None:
            return self.count + topology.num_chunks - 1
        one_x = megatron_peak_in_flight(topology, num_microbatches, group_size=group_size)
        return min(max(topology.num_chunks, math.floor(self.multiple * one_x + 1e-9)),
                   num_microbatches * topology.num_chunks)

    def resolve(self, topology: Topology, num_microbatches: int, *, group_size: Optional[int] = None,
                bytes_per_forward: Optional[float] = None, budget_bytes: Optional[float] = None) -> int:
        """The arbiter's integer ``buffer_limit`` for this layout (see the module docstring).

        ``group_size``: Megatron's ``microbatch_group_size_per_vp_stage`` (default PP).
        ``auto`` only: ``bytes_per_forward`` held per (microbatch, chunk) forward in flight
        and ``budget_bytes`` the stage may fill."""
        if self.count is not None:
            return self.count
        if self.auto:
            if bytes_per_forward is None or budget_bytes is None:
                self.target(topology, num_microbatches)  # raises the explanation
            target = auto_target(topology, num_microbatches, bytes_per_forward=bytes_per_forward,
                                 budget_bytes=budget_bytes, group_size=group_size)
        else:
            target = self.target(topology, num_microbatches, group_size=group_size)
        return arbiter_limit(target, topology.num_chunks)


def arbiter_limit(target_in_flight: int, num_chunks: int) -> int:
    """The arbiter's ``buffer_limit`` that keeps a stage at most ``target_in_flight``
    forwards in flight: at the limit an interleaved stage still runs the focus
    microbatch's remaining chunks, so in_flight <= limit + C - 1 (arbiter.py)."""
    return max(1, target_in_flight - (num_chunks - 1))


def auto_target(topology: Topology, num_microbatches: int, *, bytes_per_forward: float, budget_bytes: float,
                group_size: Optional[int] = None, margin: float = AUTO_MARGIN) -> int:
    """Most forwards in flight with ``target x bytes_per_forward <= margin x budget_bytes``,
    at least Megatron's own (1x), at most M x C."""
    one_x = megatron_peak_in_flight(topology, num_microbatches, group_size=group_size)
    cap = num_microbatches * topology.num_chunks
    if bytes_per_forward <= 0:
        return cap  # nothing is held per forward: memory does not bind
    fits = math.floor(margin * max(0.0, budget_bytes) / bytes_per_forward)
    return min(cap, max(one_x, fits))


def order_peak_in_flight(order: Iterable[Task]) -> int:
    """Peak of forwards run minus backwards run (W when the order splits the backward)
    along one stage's order, in (microbatch, chunk) forwards."""
    order = list(order)
    releasing = Kind.W if any(t.kind is Kind.W for t in order) else Kind.B
    level = peak = 0
    for task in order:
        level += 1 if task.kind is Kind.F else (-1 if task.kind is releasing else 0)
        peak = max(peak, level)
    return peak


@lru_cache(maxsize=256)
def megatron_peak_in_flight(topology: Topology, num_microbatches: int, *, group_size: Optional[int] = None) -> int:
    """``1x``: the most (microbatch, chunk) forwards Megatron-core's own schedule keeps in
    flight on any stage of this layout — min(PP, M) for 1F1B, the interleaved warm-up
    bound + 1 — read off Megatron's per-stage order itself (``hints.megatron_1f1b_order``)."""
    return max(order_peak_in_flight(megatron_1f1b_order(stage, topology, num_microbatches, group_size))
               for stage in range(topology.num_stages))


__all__ = ["AUTO_MARGIN", "DEFAULT_RUNTIME_LIMIT", "BufferLimit", "LimitSpec", "arbiter_limit", "auto_target",
           "megatron_peak_in_flight", "order_peak_in_flight"]
