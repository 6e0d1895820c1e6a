"""Whether data-parallel communication may overlap the task loop (the rule in one place).

The rounds protocol's deadlock argument (``runtime/rounds.py``) covers the operations of
one pipeline and its TP groups. Data-parallel reductions and parameter all-gathers join
ranks of *other* pipelines, at points of each one's own task sequence:

* without interleaving, a stage's gradient reduction starts in its last backward, after
  every round it still needs from downstream and before any round upstream needs from it;
  parameter all-gathers are issued by the optimizer step before the call. Both are covered
  (rounds docstring: by stage, last first);
* with interleaving on a single-queue GPU (CUDA, NCCL) they are not: chunk c's reduction
  (``overlap_grad_reduce``) and chunk c+1's all-gather (``overlap_param_gather``) sit in the
  middle of rounds of other chunks, so a cycle through two pipelines is not excluded.
  There they must run outside the task loop (``dp_overlap_blockers`` names the flags).

CPU runs (gloo; host-synchronous, no shared device queue) and DP = 1 are unaffected.
"""
from __future__ import annotations


def overlapped_dp_communication_allowed(*, device_type: str, data_parallel_size: int, interleaved: bool) -> bool:
    """May DP reductions / all-gathers run inside the task loop here?"""
    return device_type != "cuda" or data_parallel_size <= 1 or not interleaved


def dp_overlap_blockers(models, *, device_type: str, data_parallel_size: int, split_backward: bool) -> list[str]:
    """The options that would overlap DP communication with the task loop where it is not
    allowed (empty when fine). Under the split backward gradient reductions then run after
    the last W (``grad_sync.SplitReadiness`` with ``overlap_allowed=False``); parameter
    all-gathers would still overlap."""
    if overlapped_dp_communication_allowed(device_type=device_type, data_parallel_size=data_parallel_size,
                                           interleaved=len(models) > 1):
        return []
    ddp_config = getattr(models[0], "ddp_config", None)
    found = []
    if getattr(ddp_config, "overlap_grad_reduce", False) and not split_backward:
        found.append("overlap_grad_reduce (--overlap-grad-reduce)")
    if getattr(ddp_config, "overlap_param_gather", False):
        found.append("overlap_param_gather (--overlap-param-gather)")
    return found


__all__ = ["dp_overlap_blockers", "overlapped_dp_communication_allowed"]
