#!/usr/bin/env python
"""What the whole-stage agreement's lock-step costs, simulated (issue 29).

    python scripts/lockstep_cost.py [--pp 2,4,8] [--chunks 2] [--dp 2] [--variability j1,j2,j3]
        [--microbatches-per-stage 2] [--seeds 20]

On CUDA with interleaving, DP > 1 and an overlap flag, rrfp agrees every decision over the
stage's DP replicas (``mcore/dp_overlap.py``), so the replicas of a stage move in lock-step;
Megatron's replicas run their static order independently and meet at the iteration's end.
Per seed each of the ``--dp`` replicas draws its own durations and latencies; independent
replicas take the slowest replica's makespan, lock-step ones the makespan of
``sim.variability.lockstep`` (every task at the slowest replica's pace: pessimistic on
latency, with the agreement's exchange free). Buffer limit 1x, medians over seeds, units of f0: simulator
output, independent of the machine's load. What it leaves out: DP communication time (see
``scripts/dp_overlap_figures.py``), and the replicas' coupling at each chunk's reductions.
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", default="2,4,8", help="comma list of pipeline sizes")
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2, help="replicas of each stage")
    parser.add_argument("--variability", default="j1,j2,j3", help="comma list of j0 .. j3 (sim/variability.py)")
    parser.add_argument("--microbatches-per-stage", type=int, default=2, help="M = this x PP (the bench's DP runs: 2)")
    parser.add_argument("--seeds", type=int, default=20)
    args = parser.parse_args(argv)

    from megatron_rrfp.policy.topology import Topology
    from megatron_rrfp.sim.simulator import median, policy, simulate
    from megatron_rrfp.sim.variability import VARIABILITY_LEVELS, Variability, lockstep, sample_realization

    try:
        sizes = [int(p) for p in args.pp.split(",")]
    except ValueError:
        parser.error(f"--pp {args.pp!r}: a comma list of integers, e.g. 2,4,8")
    levels = args.variability.split(",")
    if unknown := [level for level in levels if level not in VARIABILITY_LEVELS]:
        parser.error(f"--variability {','.join(unknown)}: choose from {', '.join(VARIABILITY_LEVELS)}")
    for name in ("chunks", "dp", "microbatches_per_stage", "seeds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(p < 2 for p in sizes):
        parser.error("--pp: every pipeline size must be >= 2")

    print(f"{args.dp} replicas per stage, {args.chunks} chunks, M = {args.microbatches_per_stage} x PP, 1x, "
          f"{args.seeds} seeds; iteration time in f0 (speedup over Megatron's independent replicas)")
    print("| PP | var | Megatron, independent | rrfp, independent | rrfp, lock-step | lock-step's cost |")
    print("|---|---|---|---|---|---|")
    megatron, rrfp = policy("1f1b-strict"), policy("default")
    for pp in sizes:
        topology, m = Topology(pp, args.chunks), args.microbatches_per_stage * pp
        for level in levels:
            variability = Variability(**VARIABILITY_LEVELS[level])
            times: dict[str, list[float]] = {"megatron": [], "rrfp": [], "lockstep": []}
            for seed in range(args.seeds):
                replicas = [sample_realization(variability, topology, m, seed * 1000 + r) for r in range(args.dp)]
                times["megatron"].append(max(simulate(megatron, topology, m, r).makespan for r in replicas))
                times["rrfp"].append(max(simulate(rrfp, topology, m, r).makespan for r in replicas))
                times["lockstep"].append(simulate(rrfp, topology, m, lockstep(replicas)).makespan)
            base, free, locked = (median(times[k]) for k in ("megatron", "rrfp", "lockstep"))
            print(f"| {pp} | {level} | {base:.2f} | {free:.2f} ({base / free:.3f}x) | {locked:.2f} "
                  f"({base / locked:.3f}x) | {locked / free - 1:+.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
