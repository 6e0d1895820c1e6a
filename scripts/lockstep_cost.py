#!/usr/bin/env python
"""What the whole-stage agreement's lock-step costs, simulated, against the other safe choice.

    python scripts/lockstep_cost.py [--pp 2,4,8] [--chunks 2] [--dp 2] [--variability j1,j2,j3]
        [--microbatches-per-stage 2] [--seeds 20] [--reduce 0.5] [--gather 0.5] [--buckets 2]

On CUDA with interleaving, DP > 1 and an overlap flag, rrfp agrees every decision over the
stage's DP replicas (``mcore/dp_overlap.py``), so the replicas of a stage move in lock-step;
Megatron's replicas run their static order independently and meet at the iteration's end.
Per seed each of the ``--dp`` replicas draws its own durations and latencies; independent
replicas take the slowest replica's time, lock-step ones the time of
``sim.variability.lockstep`` (every task at the slowest replica's pace: pessimistic on
latency, with the agreement's exchange free). DP communication (``sim/dp_comm.py``, per
bucket: ``--reduce`` / ``--gather`` f0, ``--buckets`` per chunk; 0 for compute only) is
overlapped for Megatron and for rrfp in lock-step, and at the end of the iteration for rrfp's
independent replicas — the other choice that keeps the deadlock argument. Buffer limit 1x,
medians over seeds, units of f0: simulator output, independent of the machine's load. What it
leaves out: the replicas' coupling at each chunk's reductions, and contention between DP
communication and compute.
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
    parser.add_argument("--reduce", type=float, default=0.5, help="reduction time per bucket (f0; 0: none)")
    parser.add_argument("--gather", type=float, default=0.5, help="parameter all-gather time per bucket (f0)")
    parser.add_argument("--buckets", type=int, default=2, help="buckets per chunk")
    args = parser.parse_args(argv)

    from megatron_rrfp.policy.topology import Topology
    from megatron_rrfp.sim.dp_comm import DPComm, iteration_time
    from megatron_rrfp.sim.simulator import median, policy, simulate
    from megatron_rrfp.sim.variability import VARIABILITY_LEVELS, Variability, lockstep, sample_realization

    try:
        sizes = [int(p) for p in args.pp.split(",")]
    except ValueError:
        parser.error(f"--pp {args.pp!r}: a comma list of integers, e.g. 2,4,8")
    levels = args.variability.split(",")
    if unknown := [level for level in levels if level not in VARIABILITY_LEVELS]:
        parser.error(f"--variability {','.join(unknown)}: choose from {', '.join(VARIABILITY_LEVELS)}")
    if args.reduce < 0 or args.gather < 0:
        parser.error("--reduce and --gather must be >= 0")
    for name in ("chunks", "dp", "microbatches_per_stage", "seeds", "buckets"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(p < 2 for p in sizes):
        parser.error("--pp: every pipeline size must be >= 2")

    comm = DPComm(reduce_per_bucket=args.reduce, gather_per_bucket=args.gather, buckets_per_chunk=args.buckets)
    print(f"{args.dp} replicas per stage, {args.chunks} chunks, M = {args.microbatches_per_stage} x PP, 1x, "
          f"{args.seeds} seeds; DP communication per bucket: reduce {args.reduce} f0, all-gather {args.gather} f0, "
          f"{args.buckets} buckets per chunk; iteration time in f0 (speedup over Megatron)")
    print("| PP | var | Megatron, overlapped | rrfp, independent, DP at the end | rrfp, lock-step, overlapped "
          "| lock-step's cost (compute only) |")
    print("|---|---|---|---|---|---|")
    megatron, rrfp = policy("1f1b-strict"), policy("default")
    for pp in sizes:
        topology, m = Topology(pp, args.chunks), args.microbatches_per_stage * pp

        def timed(config, realization, overlap: bool, topology=topology, m=m) -> tuple[float, float]:
            """(compute only, with DP communication) of one iteration."""
            result = simulate(config, topology, m, realization, record_trace=True)
            return result.makespan, iteration_time(result.trace, topology.num_stages, topology.num_chunks, comm,
                                                   overlap_grad_reduce=overlap, overlap_param_gather=overlap)

        for level in levels:
            variability = Variability(**VARIABILITY_LEVELS[level])
            times: dict[str, list[float]] = {k: [] for k in ("megatron", "free", "free_end", "locked", "locked_dp")}
            for seed in range(args.seeds):
                replicas = [sample_realization(variability, topology, m, seed * 1000 + r) for r in range(args.dp)]
                times["megatron"].append(max(timed(megatron, r, True)[1] for r in replicas))
                free = [timed(rrfp, r, False) for r in replicas]
                times["free"].append(max(t[0] for t in free))
                times["free_end"].append(max(t[1] for t in free))
                locked = timed(rrfp, lockstep(replicas), True)
                times["locked"].append(locked[0])
                times["locked_dp"].append(locked[1])
            t = {k: median(v) for k, v in times.items()}
            base = t["megatron"]
            print(f"| {pp} | {level} | {base:.2f} | {t['free_end']:.2f} ({base / t['free_end']:.3f}x) "
                  f"| {t['locked_dp']:.2f} ({base / t['locked_dp']:.3f}x) | {t['locked'] / t['free'] - 1:+.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
