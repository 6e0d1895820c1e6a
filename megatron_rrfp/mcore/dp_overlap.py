"""Where data-parallel communication may overlap the task loop, and what makes it safe (the rule in one place).

The rounds protocol's deadlock argument (``runtime/rounds.py``) covers the operations of
one pipeline, its TP groups and every group whose ranks dispatch one agreed task sequence.
Data-parallel reductions (``overlap_grad_reduce``) and the distributed optimizer's parameter
all-gathers (``overlap_param_gather``) join ranks of *other* pipelines, at points of each
one's own task sequence:

* without interleaving they sit where every replica of a stage reaches them in the same
  order relative to its rounds: a stage's reductions in its last backward (or its last B
  and last W under the split), its all-gathers in its first forward. Covered without more
  (rounds docstring, by stage);
* with interleaving on a single-queue GPU (CUDA, NCCL) chunk c's reductions and chunk
  c+1's all-gathers fall between rounds of other chunks, and rrfp's replicas of a stage
  order their chunks' tasks differently (readiness differs per pipeline), so NCCL would
  pair different collectives, or a cycle through two pipelines could form
  (``scripts/emulate_transport.py --protocols rounds-dp-unagreed`` shows both).

**The rule** (``whole_stage_agreement``): there, the TP agreement spans every rank of the
stage (TP x DP x CP: megatron's tensor-and-data-parallel group), so all DP replicas of a
stage dispatch one agreed task sequence and issue their DP collectives at the same
positions of it — the argument the rounds docstring makes for expert all-to-alls, which
already join replicas this way. Cost: one agreement exchange per decision over TP x DP
ranks (host-side, gloo) instead of TP, and replicas of a stage move in lock-step (as
Megatron's own static schedule keeps them).

CPU runs (gloo; host-synchronous, no shared device queue) and DP = 1 need nothing.
"""
from __future__ import annotations


def overlapping_flags(models) -> list[str]:
    """The megatron flags that put DP communication inside the task loop."""
    ddp_config = getattr(models[0], "ddp_config", None)
    found = []
    if getattr(ddp_config, "overlap_grad_reduce", False):
        found.append("overlap_grad_reduce (--overlap-grad-reduce)")
    if getattr(ddp_config, "overlap_param_gather", False):
        found.append("overlap_param_gather (--overlap-param-gather)")
    return found


def whole_stage_agreement(models, *, device_type: str, data_parallel_size: int, forward_only: bool = False) -> bool:
    """Must the agreement span every DP replica of the stage (module docstring)?"""
    return (device_type == "cuda" and data_parallel_size > 1 and len(models) > 1 and not forward_only
            and bool(overlapping_flags(models)))


def overlapped_dp_communication_allowed(*, device_type: str, data_parallel_size: int, interleaved: bool,
                                        whole_stage: bool = True) -> bool:
    """May DP reductions / all-gathers run inside the task loop here? Always, given the
    whole-stage agreement where ``whole_stage_agreement`` asks for it."""
    return whole_stage or device_type != "cuda" or data_parallel_size <= 1 or not interleaved


__all__ = ["overlapped_dp_communication_allowed", "overlapping_flags", "whole_stage_agreement"]
