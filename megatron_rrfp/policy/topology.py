"""Who feeds whom in a (possibly interleaved) pipeline.

Stage ``s`` holds model chunks ``c = 0..C-1``; chunk ``c`` of stage ``s`` is virtual
stage ``v = c * PP + s`` (Megatron's interleaving). Activations flow ``v -> v + 1``,
gradients ``v -> v - 1``; the last stage's chunk ``c`` feeds stage 0's chunk ``c + 1``.
The simulator and the executor both derive readiness from this one definition.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True, slots=True)
class Topology:
    num_stages: int
    num_chunks: int = 1

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError(f"pipeline size must be >= 1, got {self.num_stages}")
        if self.num_chunks < 1:
            raise ValueError(f"model chunks per stage must be >= 1, got {self.num_chunks}")

    @property
    def num_virtual_stages(self) -> int:
        return self.num_stages * self.num_chunks

    @property
    def interleaved(self) -> bool:
        return self.num_chunks > 1

    def virtual_stage(self, stage: int, chunk: int) -> int:
        return chunk * self.num_stages + stage

    def locate(self, virtual_stage: int) -> tuple[int, int]:
        """(stage, chunk) of a virtual stage."""
        return virtual_stage % self.num_stages, virtual_stage // self.num_stages

    def is_first(self, stage: int, chunk: int) -> bool:
        return self.virtual_stage(stage, chunk) == 0

    def is_last(self, stage: int, chunk: int) -> bool:
        return self.virtual_stage(stage, chunk) == self.num_virtual_stages - 1

    def downstream(self, stage: int, chunk: int) -> Optional[tuple[int, int]]:
        """(stage, chunk) that consumes this chunk's forward output, None for the last."""
        v = self.virtual_stage(stage, chunk)
        return None if v == self.num_virtual_stages - 1 else self.locate(v + 1)

    def upstream(self, stage: int, chunk: int) -> Optional[tuple[int, int]]:
        """(stage, chunk) that consumes this chunk's input gradient, None for the first."""
        v = self.virtual_stage(stage, chunk)
        return None if v == 0 else self.locate(v - 1)
