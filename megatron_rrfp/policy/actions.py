"""The task type every other module speaks: ``Task(kind, microbatch, chunk)``.

A stage runs three kinds of task per (microbatch, model chunk):

* ``F`` forward;
* ``B`` backward — the full backward, or, when the backward is split (BFW hint), only the
  input-gradient half that the upstream stage is waiting for;
* ``W`` the deferred weight-gradient half of a split backward.

The string form is ``"{chunk}{kind}{microbatch}"`` (``"0F3"``, ``"1B0"``, ``"0W7"``),
close to torch.distributed.pipelining's action strings; the leading number is the model
chunk *on this stage* (virtual stage = chunk * PP + stage). ``Task.parse(str(t)) == t``.
"""
from __future__ import annotations

import enum
import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field


class Kind(str, enum.Enum):
    F = "F"
    B = "B"
    W = "W"

    def __str__(self) -> str:  # "F", not "Kind.F"
        return self.value


_TASK_RE = re.compile(r"^\s*(\d+)\s*([FBW])\s*(\d+)\s*$")


_KIND_CODE = {Kind.F: 0, Kind.B: 1, Kind.W: 2}


@dataclass(frozen=True, slots=True)
class Task:
    kind: Kind
    microbatch: int
    chunk: int = 0
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            object.__setattr__(self, "kind", Kind(self.kind))
        if self.microbatch < 0 or self.chunk < 0:
            raise ValueError(f"task {self.kind}{self.microbatch} chunk {self.chunk}: indices must be >= 0")
        # Tasks live in sets and dicts on every dispatch: hash once, from ints only (the
        # same in every process, unlike a str's, so a pickled Task stays valid)
        object.__setattr__(self, "_hash", hash((_KIND_CODE[self.kind], self.microbatch, self.chunk)))

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        return f"{self.chunk}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Task({self})"

    @classmethod
    def parse(cls, text: str) -> Task:
        match = _TASK_RE.match(text)
        if match is None:
            raise ValueError(
                f"cannot parse task {text!r}: expected '<chunk><F|B|W><microbatch>', e.g. '0F3' or '1B0'"
            )
        chunk, kind, microbatch = match.groups()
        return cls(Kind(kind), int(microbatch), int(chunk))


def F(microbatch: int, chunk: int = 0) -> Task:
    return Task(Kind.F, microbatch, chunk)


def B(microbatch: int, chunk: int = 0) -> Task:
    return Task(Kind.B, microbatch, chunk)


def W(microbatch: int, chunk: int = 0) -> Task:
    return Task(Kind.W, microbatch, chunk)


@functools.lru_cache(maxsize=64)
def all_tasks(num_microbatches: int, num_chunks: int = 1, *, split_backward: bool = False,
              forward_only: bool = False) -> tuple[Task, ...]:
    """Every task one stage runs in one iteration (one tuple per layout: every stage's arbiter,
    every iteration and every simulated run of a layout shares it; Tasks are immutable)."""
    kinds = [Kind.F] if forward_only else ([Kind.F, Kind.B, Kind.W] if split_backward else [Kind.F, Kind.B])
    return tuple(Task(k, m, c) for k in kinds for c in range(num_chunks) for m in range(num_microbatches))


def peak_in_flight(order: Iterable[Task]) -> int:
    """Peak of (forwards run) - (backwards run, or W run when the order splits the
    backward: a deferred W still holds its inputs) along one stage's order, in
    (microbatch, chunk) forwards — the memory unit of the buffer limit."""
    order = list(order)
    releasing = Kind.W if any(t.kind is Kind.W for t in order) else Kind.B
    level = peak = 0
    for task in order:
        level += 1 if task.kind is Kind.F else (-1 if task.kind is releasing else 0)
        peak = max(peak, level)
    return peak


def format_order(tasks: Iterable[Task]) -> str:
    return ",".join(str(t) for t in tasks)


def parse_order(text: str) -> list[Task]:
    return [Task.parse(part) for part in text.split(",") if part.strip()]
