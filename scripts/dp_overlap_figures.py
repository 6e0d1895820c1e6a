#!/usr/bin/env python
"""What overlapping DP reductions and parameter all-gathers is worth, simulated (``sim/dp_comm.py``).

    python scripts/dp_overlap_figures.py [--pp 4] [--chunks 2] [--microbatches 8] [--seeds 20]
        [--reduce 0.5] [--gather 0.5] [--buckets 2] [--variability j3]

DP2 x PP4 x 2 chunks by default (DP replicas are identical in this model, so DP only sets the
bucket times): median iteration time over seeds, in units of f0 (a stage's forward), for
Megatron's interleaved 1F1B (``1f1b-strict``) and rrfp's default policy (B/W split), with
reductions and all-gathers at the end vs overlapped, and for the split with B-only parameters
in a bucket of their own. Simulator output: independent of the machine's load.
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--reduce", type=float, default=0.5, help="reduction time per bucket (units of f0)")
    parser.add_argument("--gather", type=float, default=0.5, help="all-gather time per bucket (units of f0)")
    parser.add_argument("--buckets", type=int, default=2, help="buckets per chunk")
    parser.add_argument("--variability", default="j3", help="j0 .. j3 (sim/variability.py)")
    args = parser.parse_args(argv)
    for name in ("pp", "chunks", "microbatches", "seeds", "buckets"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.reduce < 0 or args.gather < 0:
        parser.error("--reduce and --gather must be >= 0")

    from megatron_rrfp.policy.topology import Topology
    from megatron_rrfp.sim.dp_comm import DPComm, iteration_time
    from megatron_rrfp.sim.simulator import median, policy, simulate
    from megatron_rrfp.sim.variability import VARIABILITY_LEVELS, Variability, sample_realization

    if args.variability not in VARIABILITY_LEVELS:
        parser.error(f"--variability: choose from {', '.join(VARIABILITY_LEVELS)}")
    topology = Topology(args.pp, args.chunks)
    variability = Variability(**VARIABILITY_LEVELS[args.variability])
    rows = []
    trailing: dict[int, list[int]] = {}  # rrfp: per stage, W tasks that run after their chunk's last B
    for name, spec in (("Megatron interleaved 1F1B", "1f1b-strict"), ("rrfp default (B/W split)", "default")):
        times: dict[str, list[float]] = {}
        for seed in range(args.seeds):
            realization = sample_realization(variability, topology, args.microbatches, seed)
            result = simulate(policy(spec), topology, args.microbatches, realization, record_trace=True)
            if spec == "default":
                for stage, count in enumerate(_trailing_ws(result.trace, args.pp, args.chunks)):
                    trailing.setdefault(stage, []).append(count)
            cases = {"compute only": None,
                     "at the end": (DPComm(reduce_per_bucket=args.reduce, gather_per_bucket=args.gather,
                                           buckets_per_chunk=args.buckets), False),
                     "overlapped": (DPComm(reduce_per_bucket=args.reduce, gather_per_bucket=args.gather,
                                           buckets_per_chunk=args.buckets), True),
                     "overlapped, B-only apart": (DPComm(reduce_per_bucket=args.reduce,
                                                         gather_per_bucket=args.gather,
                                                         buckets_per_chunk=args.buckets, b_only_apart=True), True)}
            for case, how in cases.items():
                value = result.makespan if how is None else iteration_time(
                    result.trace, args.pp, args.chunks, how[0], overlap_grad_reduce=how[1],
                    overlap_param_gather=how[1])
                times.setdefault(case, []).append(value)
        rows.append((name, {case: median(values) for case, values in times.items()}))
    cases = list(rows[0][1])
    print(f"PP={args.pp} x {args.chunks} chunks, M={args.microbatches}, {args.variability}, {args.seeds} seeds; "
          f"per bucket: reduce {args.reduce} f0, all-gather {args.gather} f0, {args.buckets} buckets per chunk")
    print("| schedule | " + " | ".join(cases) + " |")
    print("|---|" + "---|" * len(cases))
    for name, values in rows:
        print(f"| {name} | " + " | ".join(f"{values[c]:.2f}" for c in cases) + " |")
    print("rrfp: W tasks after their chunk's last B, per stage (max over chunks, median over seeds): "
          + ", ".join(f"stage {stage} {median(counts):g}" for stage, counts in sorted(trailing.items()))
          + " -- with 1, a bucket holding any W-computed weight completes only in the chunk's last W, "
            "whatever order those Ws run in")
    return 0


def _trailing_ws(trace, num_stages: int, num_chunks: int) -> list[int]:
    """Per stage, the most W tasks of one chunk that start after that chunk's last B ends."""
    from megatron_rrfp.policy.actions import Kind

    last_b = {}
    for stage, task, _start, end in trace:
        if task.kind is Kind.B:
            last_b[stage, task.chunk] = max(last_b.get((stage, task.chunk), 0.0), end)
    counts = [[0] * num_chunks for _ in range(num_stages)]
    for stage, task, start, _end in trace:
        if task.kind is Kind.W and start >= last_b[stage, task.chunk] - 1e-9:
            counts[stage][task.chunk] += 1
    return [max(row) for row in counts]


if __name__ == "__main__":
    sys.exit(main())
