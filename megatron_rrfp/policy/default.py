"""What ``default`` reads, as data: ``DEFAULT_RULES``, rows of (condition -> named hint) read top
to bottom, the first row that holds wins. A row's condition is the model's backward (split into
B and W or not), the chunks per stage, the pipeline depth and the buffer limit as a multiple of
Megatron's own peak. The simulated figures behind each threshold, and the commands that print
them: docs/simulator.md ("The default at every memory limit"); the words: docs/glossary.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

from .topology import Topology

WAITING_1F1B = "1f1b, waiting for late forwards"
"""Megatron's 1F1B order read readiness-first, except that a stage waits for the forward its
order runs next rather than run a ready backward ahead of it (``OrderedHint``'s
``waits_for_forward``)."""
LEAD_ZBH1_THEN_BFW = "zbh1 on stage 0, bfw after it"
"""Stage 0 follows ZB-H1's order, every later stage ranks as ``bfw`` (``LeadStageOrderedHint``)."""


class Memory(NamedTuple):
    """A stage's buffer limit beside Megatron's own peak and the stage's M x C forwards (all
    in (microbatch, chunk) forwards in flight): what ``default`` reads."""

    limit: int
    megatron_peak: int
    all_forwards: int


def _at_least(memory: Optional[Memory], multiple: float) -> bool:
    """The limit is at least ``multiple`` x Megatron's peak; a threshold t holds from the limit
    "tx" resolves to (floor(t x peak), budget.py), so "1.5x" of 19 (= 28) reads as 1.5x. No
    memory given: 1x, where no threshold holds."""
    return memory is not None and memory.limit >= max(1, math.floor(multiple * memory.megatron_peak + 1e-9))


@dataclass(frozen=True, slots=True, kw_only=True)
class DefaultRule:
    """One row of ``DEFAULT_RULES``: where it holds, and the named hint it reads there."""

    hint: str
    split: bool
    """The model can split its backward into B and W (deferred weight gradients)."""
    chunks: tuple[int, float] = (1, math.inf)
    """Model chunks per stage, inclusive range."""
    stages: tuple[int, float] = (1, math.inf)
    """Pipeline stages, inclusive range."""
    from_memory: Optional[float] = None
    """Holds from this multiple of Megatron's peak (``_at_least``)."""
    below_memory: Optional[float] = None
    """Holds below this multiple."""
    at_peak: bool = False
    """Holds where the limit is exactly Megatron's peak (1.25x of a peak of 2-3 rounds down to it)."""
    all_forwards: bool = False
    """Holds where the limit leaves room for all M x C forwards of the stage."""

    def holds(self, topology: Topology, *, split_backward: bool, memory: Optional[Memory]) -> bool:
        return (self.split == split_backward
                and self.chunks[0] <= topology.num_chunks <= self.chunks[1]
                and self.stages[0] <= topology.num_stages <= self.stages[1]
                and (self.from_memory is None or _at_least(memory, self.from_memory))
                and (self.below_memory is None or not _at_least(memory, self.below_memory))
                and (not self.at_peak or (memory is not None and memory.limit == memory.megatron_peak))
                and (not self.all_forwards or (memory is not None and memory.limit >= memory.all_forwards)))

    def cells(self) -> tuple[str, str, str, str, str]:
        """(backward, chunks, stages, memory, hint): the row as the docs print it."""
        def span(lo: int, hi: float) -> str:
            return "any" if (lo, hi) == (1, math.inf) else f"{lo}+" if hi == math.inf else \
                str(lo) if lo == hi else f"≤ {hi:g}" if lo == 1 else f"{lo}-{hi:g}"

        memory = [f"from {self.from_memory:g}x"] if self.from_memory is not None else []
        memory += [f"below {self.below_memory:g}x"] if self.below_memory is not None else []
        memory += ["exactly 1x"] if self.at_peak else []
        memory += ["room for all M x C forwards"] if self.all_forwards else []
        return ("split" if self.split else "unsplit", span(*self.chunks), span(*self.stages),
                ", ".join(memory) or "any", self.hint if " " in self.hint else f"`{self.hint}`")


DEFAULT_RULES: tuple[DefaultRule, ...] = (
    # The backward splits: ZB-H1 read readiness-first near Megatron's memory (at 1x only deferred
    # weight gradients give a stage something to run in a bubble); bfw once the limit leaves room
    # to run ahead (below it ZB-H1's order keeps the interleaved warm-up the memory still binds);
    # where every forward fits (few microbatches) the memory binds nothing, whatever its multiple.
    DefaultRule(hint="bfw", split=True, all_forwards=True),
    DefaultRule(hint="bfw", split=True, chunks=(1, 2), from_memory=1.25),
    DefaultRule(hint="bfw", split=True, chunks=(3, 3), from_memory=1.75),
    DefaultRule(hint="bfw", split=True, chunks=(4, math.inf), stages=(1, 4), from_memory=1.5),
    DefaultRule(hint="bfw", split=True, chunks=(4, math.inf), stages=(5, math.inf), from_memory=1.75),
    # deep with 3+ chunks, between: stage 0 keeps ZB-H1's warm-up while the others run ahead
    DefaultRule(hint=LEAD_ZBH1_THEN_BFW, split=True, chunks=(3, math.inf), stages=(5, math.inf), from_memory=1.5),
    DefaultRule(hint="zbh1", split=True),
    # Unsplit, one chunk: at 1x a backward run ahead of a late forward delays the forward wave
    # by up to a whole backward, so a stage waits for it; from 1.25x bf spends the spare slots.
    DefaultRule(hint=WAITING_1F1B, split=False, chunks=(1, 1), at_peak=True),
    DefaultRule(hint=WAITING_1F1B, split=False, chunks=(1, 1), from_memory=1.0, below_memory=1.25),
    DefaultRule(hint="bf", split=False, chunks=(1, 1)),
    # Unsplit, interleaved: Megatron's own interleaved order until bf leads it; gpipe where
    # every forward fits (ahead of bf with 4 chunks).
    DefaultRule(hint="gpipe", split=False, chunks=(4, math.inf), all_forwards=True),
    DefaultRule(hint="bf", split=False, chunks=(2, 2), from_memory=1.5),
    DefaultRule(hint="bf", split=False, chunks=(3, math.inf), from_memory=2.0),
    DefaultRule(hint="1f1b", split=False, chunks=(2, math.inf)),
)
"""The rows of ``default``, first match wins; every layout matches a row (the last of each
family holds everywhere)."""


def default_choice(topology: Topology, *, split_backward: bool, memory: Optional[Memory]) -> str:
    """The named hint ``default`` reads for this layout and memory: the first row of
    ``DEFAULT_RULES`` that holds."""
    return next(rule.hint for rule in DEFAULT_RULES
                if rule.holds(topology, split_backward=split_backward, memory=memory))


def rules_table() -> str:
    """``DEFAULT_RULES`` as a Markdown table (docs/design-and-policy.md prints it)."""
    lines = ["| backward | chunks | stages | memory | `default` reads |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(rule.cells()) + " |" for rule in DEFAULT_RULES]
    return "\n".join(lines)


__all__ = ["DEFAULT_RULES", "LEAD_ZBH1_THEN_BFW", "WAITING_1F1B", "DefaultRule", "Memory", "default_choice",
           "rules_table"]
