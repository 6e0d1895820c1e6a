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
all-gather time. With several replicas (``replicas_iteration_time``: one trace each) a
bucket's reduction starts once the slower replica launched it, and a stage ends with its
slower replica. What it leaves out: reductions do not slow the compute they overlap (no
contention).

``DPChannel`` is the channel itself; the bench's emulated DP communication
(``bench/comm_emulation.py``) queues its collectives on the same class, so the simulator
and the bench time buckets one way.
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


class DPChannel:
    """One rank's DP channel: collectives run one at a time in launch order, beside compute."""

    __slots__ = ("free_at",)

    def __init__(self, free_at: float = 0.0) -> None:
        self.free_at = free_at

    def queue(self, at: float, duration: float) -> float:
        """Put ``duration`` on the channel no earlier than ``at``; returns when it is done."""
        self.free_at = max(self.free_at, at) + duration
        return self.free_at


def bucket_durations(total: float, sizes) -> list[float]:
    """A chunk's communication time ``total`` split over its buckets by their sizes (elements)."""
    whole = sum(sizes)
    return [total * size / whole if whole else total / max(1, len(sizes)) for size in sizes]


def iteration_time(trace, num_stages: int, num_chunks: int, comm: DPComm, *, overlap_grad_reduce: bool,
                   overlap_param_gather: bool, deferred: frozenset = frozenset()) -> float:
    """The iteration's time with DP communication (module docstring); ``trace``: (stage, task, start, end);
    the chunks in ``deferred`` reduce after the last task."""
    return replicas_iteration_time([trace], num_stages, num_chunks, comm, overlap_grad_reduce=overlap_grad_reduce,
                                   overlap_param_gather=overlap_param_gather, deferred=deferred)


def replicas_iteration_time(traces, num_stages: int, num_chunks: int, comm: DPComm, *, overlap_grad_reduce: bool,
                            overlap_param_gather: bool, deferred: frozenset = frozenset()) -> float:
    """``iteration_time`` of DP replicas, one trace each: a bucket's reduction starts once every
    replica launched it, and a stage ends with its slower replica."""
    last_end = [0.0] * num_stages
    last_b = [[0.0] * num_chunks for _ in range(num_stages)]
    last_w = [[None] * num_chunks for _ in range(num_stages)]
    for trace in traces:
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
            if chunk in deferred:  # reduced after the loop
                complete = last_end[stage]
            ready += [(complete, mixed)] * comm.buckets_per_chunk
            if apart:
                ready.append((last_b[stage][chunk], comm.b_only_share * comm.reduce_per_bucket))
        channel = DPChannel()
        for at, duration in sorted(ready):
            channel.queue(at if overlap_grad_reduce else last_end[stage], duration)
        finish = max(finish, last_end[stage], channel.free_at)
    gathers = num_chunks * comm.buckets_per_chunk * comm.gather_per_bucket
    return finish + (comm.gather_per_bucket if overlap_param_gather else gathers)


__all__ = ["DPChannel", "DPComm", "bucket_durations", "iteration_time", "replicas_iteration_time"]
