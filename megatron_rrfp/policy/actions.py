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
import re
from collections.abc import Iterable
from dataclasses import dataclass


class Kind(str, enum.Enum):
    F = "F"
    B = "B"
    W = "W"

    def __str__(self) -> str:  # "F", not "Kind.F"
        return self.value


_TASK_RE = re.compile(r"^\s*(\d+)\s*([FBW])\s*(\d+)\s*$")


@dataclass(frozen=True, slots=True)
class Task:
    kind: Kind
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            object.__setattr__(self, "kind", Kind(self.kind))
        if self.microbatch < 0 or self.chunk < 0:
            raise ValueError(f"task {self.kind}{self.microbatch} chunk {self.chunk}: indices must be >= 0")

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


def all_tasks(num_microbatches: int, num_chunks: int = 1, *, split_backward: bool = False,
              forward_only: bool = False) -> list[Task]:
    """Every task one stage runs in one iteration."""
    kinds = [Kind.F] if forward_only else ([Kind.F, Kind.B, Kind.W] if split_backward else [Kind.F, Kind.B])
    return [Task(k, m, c) for k in kinds for c in range(num_chunks) for m in range(num_microbatches)]


def format_order(tasks: Iterable[Task]) -> str:
    return ",".join(str(t) for t in tasks)


def parse_order(text: str) -> list[Task]:
    return [Task.parse(part) for part in text.split(",") if part.strip()]
