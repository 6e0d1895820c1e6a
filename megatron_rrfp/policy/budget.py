"""Buffer limits in memory terms: ``"1x"`` = the activations Megatron's own schedule holds.

The arbiter counts memory in *(microbatch, chunk) forwards in flight* on a stage: forwards
run minus backwards run (minus W run when the backward is split, since a deferred W still
holds its inputs). A limit can be given as

* an int (``8``): that many in flight, as the paper's ``--buffer-limit``;
* a multiple (``"1x"``, ``"1.5x"``, ``"2x"``) of ``megatron_peak_in_flight`` — the most
  (microbatch, chunk) forwards Megatron-core's schedule for this layout keeps in flight on
  any stage: min(PP, M) for 1F1B, the interleaved warm-up bound + 1 with chunks. A
  Megatron-LM configuration is sized for exactly that, so ``"1x"`` runs in its memory;
* ``"auto"``: the most that fits in the memory measured at run time. Only the runtime can
  know that, so it passes ``auto=`` (a callable returning the limit in the same unit);
  without one, ``"auto"`` is an error naming the alternatives.

Every form is floored (a budget is never exceeded by rounding) and capped at the stage's
forward count M * C, beyond which a limit changes nothing. Pure Python, no torch.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from functools import lru_cache
from typing import Optional, Union

from .actions import peak_in_flight
from .hints import HintError, megatron_1f1b_order
from .topology import Topology

LimitSpec = Union[int, str]
_MULTIPLE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*x\s*$", re.IGNORECASE)


class BufferLimitError(ValueError):
    """A buffer limit that cannot be resolved (malformed, < 1, or "auto" without a measure)."""


@lru_cache(maxsize=256)
def megatron_peak_in_flight(topology: Topology, num_microbatches: int) -> int:
    """Most (microbatch, chunk) forwards Megatron's schedule keeps in flight on any stage:
    min(PP, M) without chunks; with C chunks (microbatch group = PP) the stage-0 warm-up
    2(PP-1) + (C-1)PP, + 1, capped at M*C — measured on the order itself, so it is exact."""
    try:
        return max(peak_in_flight(megatron_1f1b_order(s, topology, num_microbatches))
                   for s in range(topology.num_stages))
    except HintError as exc:
        raise BufferLimitError(f"a limit relative to Megatron's memory ('1x') needs a layout Megatron's schedule "
                               f"runs, and it refuses this one; give an integer limit instead ({exc})") from None


def check_limit_spec(spec: LimitSpec) -> None:
    """Syntax only (no layout needed): int >= 1, "<int>", "<float>x" > 0, or "auto"."""
    if isinstance(spec, bool) or not isinstance(spec, (int, str)):
        raise BufferLimitError(f"buffer limit {spec!r}: expected an integer >= 1, a multiple such as '1x' "
                               "or '1.5x' of Megatron's in-flight activations, or 'auto'")
    if isinstance(spec, int):
        if spec < 1:
            raise BufferLimitError(f"buffer limit must be >= 1, got {spec}; '1x' is Megatron's own memory")
        return
    text = spec.strip().lower()
    if text == "auto" or (text.isdigit() and int(text) >= 1):
        return
    match = _MULTIPLE.match(text)
    if match is None or float(match.group(1)) <= 0:
        raise BufferLimitError(f"buffer limit {spec!r}: expected an integer >= 1, a positive multiple such as "
                               "'1x' or '1.5x' of Megatron's in-flight activations, or 'auto'")


def parse_limit(text: str) -> LimitSpec:
    """A command-line value as a limit spec: "8" -> 8, "1.5x" / "auto" kept as text.
    Usable as an argparse ``type=`` (a bad value raises ``BufferLimitError``, a ValueError)."""
    spec: LimitSpec = int(text) if str(text).strip().isdigit() else str(text).strip()
    check_limit_spec(spec)
    return spec


def resolve_buffer_limit(spec: LimitSpec, topology: Topology, num_microbatches: int, *,
                         auto: Optional[Callable[[Topology, int, int], int]] = None) -> int:
    """The limit, in (microbatch, chunk) forwards in flight per stage, for this layout.

    ``"kx"`` -> floor(k * megatron_peak_in_flight), at least 1. ``"auto"`` ->
    ``auto(topology, num_microbatches, one_x)`` (the runtime's memory-measured limit; one_x
    is offered as the natural unit). The result is capped at M * C.
    """
    check_limit_spec(spec)
    cap = num_microbatches * topology.num_chunks
    text = spec.strip().lower() if isinstance(spec, str) else None
    if text is None:
        limit = spec
    elif text.isdigit():
        limit = int(text)
    elif text == "auto":
        if auto is None:
            raise BufferLimitError(
                "buffer limit 'auto' is measured from free memory at run time; this caller has no measure "
                "(simulate, tests): give an integer or a multiple such as '1x' of Megatron's in-flight activations")
        limit = int(auto(topology, num_microbatches, megatron_peak_in_flight(topology, num_microbatches)))
        if limit < 1:
            raise BufferLimitError(f"buffer limit 'auto' measured {limit}; need >= 1")
    else:
        multiple = float(_MULTIPLE.match(text).group(1))
        # floor with a hair of tolerance so "1.5x" of 8 is 12 despite binary fractions
        limit = max(1, math.floor(multiple * megatron_peak_in_flight(topology, num_microbatches) + 1e-9))
    return min(limit, cap)


AUTO_MARGIN = 0.8
"""``"auto"`` plans at most this share of a stage's measured memory budget (allocator
fragmentation, per-microbatch size spread, transient buffers)."""


def fit_to_budget(one_x: int, cap: int, *, bytes_per_forward: float, budget_bytes: float,
                  margin: float = AUTO_MARGIN) -> int:
    """``"auto"``'s limit: the most forwards in flight with ``limit x bytes_per_forward <=
    margin x budget_bytes``, never below ``one_x`` (Megatron's own memory, which the
    runtime's calibration iteration just ran in) nor above ``cap`` (M x C)."""
    if bytes_per_forward <= 0:
        return cap  # nothing is held per forward: memory does not bind
    fits = math.floor(margin * max(0.0, budget_bytes) / bytes_per_forward)
    return min(cap, max(one_x, fits))


def is_auto(spec: LimitSpec) -> bool:
    return isinstance(spec, str) and spec.strip().lower() == "auto"


def starting_limit(spec: LimitSpec) -> LimitSpec:
    """The limit a run starts with: ``auto`` calibrates at ``1x`` (the memory the config is
    sized for) and only grows from there, so a layout check of ``auto`` runs at ``1x``."""
    return "1x" if is_auto(spec) else spec


def describe_limit(spec: LimitSpec, topology: Topology, num_microbatches: int) -> str:
    """'12 (1.5x Megatron's 8)' — for reports."""
    limit = resolve_buffer_limit(spec, topology, num_microbatches)
    one_x = megatron_peak_in_flight(topology, num_microbatches)
    return f"{limit} ({limit / one_x:.3g}x Megatron's {one_x})"


__all__ = ["AUTO_MARGIN", "BufferLimitError", "LimitSpec", "check_limit_spec", "describe_limit", "fit_to_budget",
           "is_auto", "megatron_peak_in_flight", "parse_limit", "resolve_buffer_limit", "starting_limit"]
