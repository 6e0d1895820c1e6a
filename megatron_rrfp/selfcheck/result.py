"""What every self-check step returns, and the one-rank model-parallel set-up the
single-GPU steps share (a module of its own so the step modules import no runner)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Result:
    step: str
    status: str  # PASS | FAIL | SKIP
    detail: str


def ensure_model_parallel() -> None:
    """megatron-core DDP needs parallel_state: a 1-rank group when the self-check runs alone."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29531", world_size=1, rank=0)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
