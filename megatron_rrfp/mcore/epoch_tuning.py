"""The DP epoch rule's variant for this job, chosen by the simulator on what the job measured.

Which of the rule's variants (``policy.epochs.EpochVariant``: the static order, which chunks
reduce after the loop, where the all-gathers go) is fastest depends on the job's compute
jitter and on its DP communication against its pipeline's work, which are unknown at
start-up. So, per (model chunks, layout, M), as ``auto_limit`` does for the buffer limit:

1. measure: the first training call keeps the DP collectives out of the task loop
   (``after-loop``: safe, exact, replicas independent) and times, on this rank, its tasks
   (device time on CUDA: the executor's trace spans), the all-gathers before the loop and the
   reductions after it (one synchronisation each, this call only);
2. choose: the next training call, on every rank at once, averages the task figures over the
   world and takes the slowest rank's DP communication (collectives over the default group),
   and global rank 0 runs ``sim.dp_epochs.choose_variant`` on them (the job's DP size up to
   ``MODELLED_REPLICAS`` replicas, up to ``CHOICE_SEEDS`` seeds within a task budget) and
   broadcasts the choice; rank 0 prints it once;
3. try: where the choice keeps a DP point, the next ``2 * TRIAL_CALLS`` training calls alternate it
   with the fastest simulated variant that keeps none (each call timed, device drained), and the
   job keeps the choice only where its calls were faster on the slowest rank by more than the
   difference's standard error (else the variant without points: its replicas stay independent).
   The simulator does not see the host's cost of the rule's holds, which on a slow host can
   outweigh what the overlap gains. From then on every call of that job runs the kept variant.

The simulator's message latency is not measured: it takes the reference level's whose compute
jitter is nearest the measured one (``sim.variability.VARIABILITY_LEVELS``).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..policy.actions import Task
from ..policy.epochs import EpochVariant, candidate_variants
from ..ranks import print_line

MODELLED_REPLICAS = 4
"""DP replicas the choice simulates, each its own draw (a reduction waits for the slowest):
the job's DP size up to this (more cost more and change the slowest draw little)."""
TRIAL_CALLS = 3
"""Training calls each of the trial's two variants runs (step 3), alternating (at least 2: the
decision reads their spread)."""


@dataclass(slots=True)
class Measured:
    """One rank's figures from its measuring call."""

    forward_s: list = field(default_factory=list)
    backward_s: list = field(default_factory=list)  # B, or B + W of one microbatch under the split
    gather_s: float = 0.0  # the wait for every chunk's all-gathers before the loop (what the step left in flight)
    reduce_s: float = 0.0  # every chunk's reductions after it, until finalize_model_grads returned
    buckets: int = 0  # DDP bucket groups over the chunks

    def figures(self, num_chunks: int) -> list[float]:
        """[f0, backward ratio, compute sigma, buckets per chunk, reduction and all-gather per
        bucket (units of f0)]."""
        if not self.forward_s or not self.backward_s:
            return [0.0] * 6
        forward, backward = statistics.median(self.forward_s), statistics.median(self.backward_s)
        logs = [math.log(d / forward) for d in self.forward_s if d > 0] + \
            [math.log(d / backward) for d in self.backward_s if d > 0]
        sigma = statistics.pstdev(logs) if len(logs) > 1 else 0.0
        f0 = forward * num_chunks  # the simulator's f0: a whole stage's forward, every chunk
        per_chunk = max(1, round(self.buckets / num_chunks))
        per_bucket = per_chunk * num_chunks * f0
        return [f0, backward / forward, sigma, per_chunk, self.reduce_s / per_bucket, self.gather_s / per_bucket]


@dataclass(slots=True)
class Trial:
    """Step 3: the simulator's choice against the fastest variant with no DP point, call by call."""

    rule: EpochVariant
    fallback: EpochVariant
    seconds: list = field(default_factory=list)  # this rank's trial calls: rule, fallback, rule, ...

    def next_variant(self) -> EpochVariant:
        return self.rule if len(self.seconds) % 2 == 0 else self.fallback


def phase(state, job_key: tuple) -> str:
    """"measure" (the job's first training call), "choose" (its second), "try", "decide" (the
    call after the trial) or "chosen"."""
    if job_key in state.epoch_variants:
        return "chosen"
    trial = state.epoch_trials.get(job_key)
    if trial is not None:
        return "decide" if len(trial.seconds) >= 2 * TRIAL_CALLS else "try"
    return "choose" if job_key in state.epoch_measured else "measure"


def variant_for(state, job_key: tuple) -> tuple[EpochVariant, Optional[Trial]]:
    """This call's variant, and the trial that times it (None once the job kept one)."""
    if job_key in state.epoch_variants:
        return state.epoch_variants.get(job_key), None
    trial = state.epoch_trials[job_key]
    return trial.next_variant(), trial


def record(state, job_key: tuple, report, models, *, gather_s: float, reduce_s: float) -> None:
    """Keep the measuring call's figures (its trace spans: one per task)."""
    measured = Measured(gather_s=gather_s, reduce_s=reduce_s,
                        buckets=sum(len(getattr(m, "bucket_groups", ())) for m in models))
    backward: dict = {}  # (microbatch, chunk) -> its B and W together
    for span in report.spans:
        if span.category == "F":
            measured.forward_s.append(span.end - span.start)
        elif span.category in ("B", "W"):
            task = Task.parse(span.name)
            key = (task.microbatch, task.chunk)
            backward[key] = backward.get(key, 0.0) + span.end - span.start
    measured.backward_s = list(backward.values())
    state.epoch_measured[job_key] = measured


def choose(state, job_key: tuple, arbiter_config, topology, num_microbatches: int, device,
           data_parallel_size: int) -> None:
    """Every rank at once (module docstring, step 2): the job's variant kept in ``state``, or its
    trial against the fastest variant without DP points where the choice keeps one."""
    from ..sim.dp_comm import DPComm
    from ..sim.dp_epochs import choose_variant, dp_points
    from ..sim.variability import VARIABILITY_LEVELS, Variability

    mine = state.epoch_measured[job_key].figures(topology.num_chunks)
    mean = torch.tensor(mine[:3] + [1.0], dtype=torch.float64, device=device)
    slowest = torch.tensor(mine[3:], dtype=torch.float64, device=device)  # buckets per chunk, comm per bucket
    dist.all_reduce(mean)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    index = torch.zeros(2, dtype=torch.int64, device=device)  # the choice, and the trial's fallback
    variants = candidate_variants(topology.num_chunks)
    if dist.get_rank() == 0:
        count = mean[3].item()
        _, ratio, sigma = (v / count for v in mean[:3].tolist())
        buckets, reduce, gather = slowest.tolist()
        level = min(VARIABILITY_LEVELS.values(), key=lambda lv: abs(lv["sigma_compute"] - sigma))
        variability = Variability(backward_ratio=max(ratio, 0.1), sigma_compute=sigma, c50=level["c50"],
                                  sigma_msg=level["sigma_msg"])
        comm = DPComm(reduce_per_bucket=reduce, gather_per_bucket=gather, buckets_per_chunk=max(1, round(buckets)))
        began = time.perf_counter()
        chosen, times = choose_variant(arbiter_config, topology, num_microbatches, variability, comm,
                                       dp=min(data_parallel_size, MODELLED_REPLICAS))
        fallback = min((v for v in variants if dp_points(v, topology.num_chunks) == 0), key=times.__getitem__)
        index[0], index[1] = variants.index(chosen), variants.index(fallback)
        trying = "" if chosen == fallback else \
            f"; timed against {fallback} over the next {2 * TRIAL_CALLS} training calls"
        print_line(f"megatron-rrfp: the DP epoch rule runs with {chosen} (simulated on this job's measured "
                   f"compute jitter {sigma:.2f}, B/F {ratio:.2f}, DP reduction {reduce:.2f} f0 and all-gather wait "
                   f"{gather:.2f} f0 per bucket; {time.perf_counter() - began:.1f} s){trying}")
    dist.broadcast(index, src=0)
    chosen, fallback = (variants[i] for i in index.tolist())
    if chosen == fallback:
        state.epoch_variants[job_key] = chosen
    else:
        state.epoch_trials[job_key] = Trial(chosen, fallback)


def rule_measured_faster(rule: list, fallback: list) -> tuple[bool, float, float, float]:
    """(whether the calls in ``rule`` were faster than those in ``fallback`` by more than the
    standard error of the difference of their means, both means, that error), in seconds."""
    rule_s, fallback_s = statistics.fmean(rule), statistics.fmean(fallback)
    error_s = math.sqrt(statistics.variance(rule) / len(rule) + statistics.variance(fallback) / len(fallback))
    return fallback_s - rule_s > error_s, rule_s, fallback_s, error_s


def decide(state, job_key: tuple, device) -> EpochVariant:
    """Every rank at once, after the trial (module docstring, step 3): the variant kept, in
    ``state`` (with the trial's figures in ``state.epoch_trial_figures``)."""
    trial = state.epoch_trials.pop(job_key)
    seconds = torch.tensor(trial.seconds, dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the same figures on every rank: the same decision
    rule, fallback = seconds[0::2].tolist(), seconds[1::2].tolist()
    faster, rule_s, fallback_s, error_s = rule_measured_faster(rule, fallback)
    kept = trial.rule if faster else trial.fallback
    state.epoch_variants[job_key] = kept
    state.epoch_trial_figures[job_key] = {"kept": str(kept), "rule": str(trial.rule), "rule_s": rule_s,
                                          "fallback": str(trial.fallback), "fallback_s": fallback_s,
                                          "error_s": error_s, "calls_each": len(rule)}
    if dist.get_rank() == 0:
        print_line(f"megatron-rrfp: the DP epoch rule keeps {kept}: {rule_s:.3f} s per training call with "
                   f"{trial.rule}, {fallback_s:.3f} s with {trial.fallback} (slowest rank, mean of "
                   f"{len(rule)} calls each, standard error of the difference {error_s:.3f} s)")
    return kept


def clock(device) -> float:
    """The wall clock with the device drained (the measuring and trial calls only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def timed(device, func) -> float:
    """``func()``'s wall time with the device drained before and after."""
    began = clock(device)
    func()
    return clock(device) - began


__all__ = ["MODELLED_REPLICAS", "TRIAL_CALLS", "Measured", "Trial", "choose", "clock", "decide", "phase", "record",
           "rule_measured_faster", "timed", "variant_for"]
