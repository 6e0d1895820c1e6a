"""What overlapping data-parallel communication is worth, on a simulated iteration.

A post-processing model on the simulator's per-task trace (``simulate(..., record_trace=True)``),
units of f0. Each stage has one DP communication channel beside its compute (NCCL's own
stream); collectives on it run one at a time in launch order. Where megatron launches them
(``mcore/grad_sync.py``):

* **reductions** (``--overlap-grad-reduce``): a chunk's buckets once their gradients are
  complete — the end of the chunk's last backward (unsplit), or of its last W under the
  B/W split, where every bucket also holds B-only parameters (biases, norms) and so
  completes only in the last W; ``b_only_apart`` puts those in a bucket of their own that
  completes at the chunk's last B (``b_only_share`` of a bucket's time, taken from the mixed
  buckets). Without overlap
  every reduction starts after the stage's last task;
* **parameter all-gathers** (``--overlap-param-gather``): launched for the next
  iteration's forwards; only chunk 0's first bucket is exposed (the first forward waits
  for it), the rest hide behind forwards. Without overlap all of them follow the
  optimizer step (on the critical path).

Iteration time = max over stages of (last task end, last reduction end) + the exposed
all-gather time. What it leaves out: reductions do not slow the compute they overlap (no
contention), and DP replicas are identical (no straggling replica).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..policy.actions import Kind


@dataclass(frozen=True, kw_only=True, slots=True)
class DPComm:
    reduce_per_bucket: float = 0.5
    """Reduce-scatter / all-reduce time of one bucket (units of f0)."""
    gather_per_bucket: float = 0.5
    """Parameter all-gather time of one bucket (units of f0)."""
    buckets_per_chunk: int = 2
    b_only_apart: bool = False
    """B-only parameters in a bucket of their own, reduced after the chunk's last B."""
    b_only_share: float = 0.05
    """That bucket's time as a share of ``reduce_per_bucket`` (biases and norms are small)."""


def iteration_time(trace, num_stages: int, num_chunks: int, comm: DPComm, *, overlap_grad_reduce: bool,
                   overlap_param_gather: bool) -> float:
    """The iteration's time with DP communication (module docstring); ``trace``: (stage, task, start, end)."""
    last_end = [0.0] * num_stages
    last_b = [[0.0] * num_chunks for _ in range(num_stages)]
    last_w = [[None] * num_chunks for _ in range(num_stages)]
    for stage, task, _start, end in trace:
        last_end[stage] = max(last_end[stage], end)
        if task.kind is Kind.B:
            last_b[stage][task.chunk] = max(last_b[stage][task.chunk], end)
        elif task.kind is Kind.W:
            last_w[stage][task.chunk] = max(last_w[stage][task.chunk] or 0.0, end)
    finish = 0.0
    for stage in range(num_stages):
        ready = []  # (time its gradients are complete, duration)
        for chunk in range(num_chunks):
            split = last_w[stage][chunk] is not None
            complete = last_w[stage][chunk] if split else last_b[stage][chunk]
            apart = split and comm.b_only_apart  # the B-only share leaves the mixed buckets (same bytes in all)
            mixed = comm.reduce_per_bucket * (1 - comm.b_only_share / comm.buckets_per_chunk if apart else 1)
            ready += [(complete, mixed)] * comm.buckets_per_chunk
            if apart:
                ready.append((last_b[stage][chunk], comm.b_only_share * comm.reduce_per_bucket))
        channel = 0.0
        for at, duration in sorted(ready):
            channel = max(channel, at if overlap_grad_reduce else last_end[stage]) + duration
        finish = max(finish, last_end[stage], channel)
    gathers = num_chunks * comm.buckets_per_chunk * comm.gather_per_bucket
    return finish + (comm.gather_per_bucket if overlap_param_gather else gathers)


__all__ = ["DPComm", "iteration_time"]
