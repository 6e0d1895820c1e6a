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

    python scripts/lockstep_cost.py --grid [--pp 2,4,6,8] [--chunks 2,3,4] [--variability j0,j1,j2,j3]
        [--comm 0.25,0.5,1,2] [--bucket-counts 1,2,4,8] [--seeds 10] [--csv PATH]

``--grid``: the DP epoch rule (``sim/dp_epochs.py``, docs/design/dp-epochs.md) against the
three others over the grid, every schedule on the same draws, every DP replica its own draw,
a bucket's reduction starting once the slower replica launched it
(``sim/dp_comm.replicas_iteration_time``): Megatron's interleaved 1F1B overlapped, rrfp
after-loop (all-gathers before the loop, reductions after it), rrfp lock-step overlapped,
and rrfp under the rule overlapped, its static timeline Megatron's order with each W after its
B ("megatron") or the policy's own nominal order ("policy"). ``--comm`` sets a bucket's
reduction and its all-gather alike. Prints, per PP x chunks x variability, the worst and the
median cell over DP communication and buckets: the rule's speedup over Megatron, over
after-loop and over lock-step; and the cells where the rule is below Megatron.
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", help="comma list of pipeline sizes (default 2,4,8; --grid: 2,4,6,8)")
    parser.add_argument("--chunks", help="model chunks per stage (default 2; --grid: a comma list, default 2,3,4)")
    parser.add_argument("--dp", type=int, default=2, help="replicas of each stage")
    parser.add_argument("--variability", help="comma list of j0 .. j3 (sim/variability.py; default j1,j2,j3; "
                        "--grid: j0,j1,j2,j3)")
    parser.add_argument("--microbatches-per-stage", type=int, default=2, help="M = this x PP (the bench's DP runs: 2)")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--reduce", type=float, default=0.5, help="reduction time per bucket (f0; 0: none)")
    parser.add_argument("--gather", type=float, default=0.5, help="parameter all-gather time per bucket (f0)")
    parser.add_argument("--buckets", type=int, default=2, help="buckets per chunk")
    parser.add_argument("--grid", action="store_true", help="the DP epoch rule over the grid (module docstring)")
    parser.add_argument("--comm", default="0.25,0.5,1,2", help="--grid: reduction = all-gather time per bucket (f0)")
    parser.add_argument("--bucket-counts", default="1,2,4,8", help="--grid: buckets per chunk")
    parser.add_argument("--csv", metavar="PATH", help="--grid: every cell's medians as CSV")
    parser.add_argument("--choice-seeds", type=int, default=0, help="--grid: seeds the rule's variant is chosen on "
                        "(other draws than the evaluated ones; 0: as a job chooses, sim.dp_epochs.choice_seeds)")
    args = parser.parse_args(argv)
    if args.grid:
        return grid(parser, args)
    args.pp, args.variability = args.pp or "2,4,8", args.variability or "j1,j2,j3"
    args.chunks = _ints(parser, "chunks", args.chunks or "2", 1)[0]

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


def _ints(parser, name: str, text: str, low: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        parser.error(f"--{name} {text!r}: a comma list of integers")
    if any(v < low for v in values):
        parser.error(f"--{name}: every value must be >= {low}")
    return values


def grid(parser, args) -> int:
    """``--grid`` (module docstring)."""
    import csv
    import statistics

    from megatron_rrfp.policy.epochs import DEFAULT_VARIANT
    from megatron_rrfp.policy.topology import Topology
    from megatron_rrfp.sim.dp_comm import DPComm, replicas_iteration_time
    from megatron_rrfp.sim.dp_epochs import best_variant, choice_seeds, variant_times, variant_traces
    from megatron_rrfp.sim.simulator import median, policy, simulate
    from megatron_rrfp.sim.variability import VARIABILITY_LEVELS, Variability, lockstep, sample_realization

    sizes = _ints(parser, "pp", args.pp or "2,4,6,8", 2)
    chunk_counts = _ints(parser, "chunks", args.chunks or "2,3,4", 2)
    levels = (args.variability or "j0,j1,j2,j3").split(",")
    if unknown := [level for level in levels if level not in VARIABILITY_LEVELS]:
        parser.error(f"--variability {','.join(unknown)}: choose from {', '.join(VARIABILITY_LEVELS)}")
    try:
        comms = [float(v) for v in args.comm.split(",")]
    except ValueError:
        parser.error(f"--comm {args.comm!r}: a comma list of numbers (f0)")
    if any(c <= 0 for c in comms):
        parser.error("--comm: every value must be > 0")
    buckets = _ints(parser, "bucket-counts", args.bucket_counts, 1)
    megatron, rrfp = policy("1f1b-strict"), policy("default")
    rows, below = [], []
    print(f"DP {args.dp}, M = {args.microbatches_per_stage} x PP, 1x, {args.seeds} seeds, DP communication per bucket "
          f"(reduction = all-gather) {args.comm} f0, buckets per chunk {args.bucket_counts}; the epoch rule with "
          f"the variant its simulator chooses ({args.choice_seeds or 'as a job does:'} other seeds) over each; "
          "worst / median per row")
    print("| PP | chunks | var | vs Megatron | vs after-loop | vs lock-step "
          "| fixed variant vs Megatron; vs after-loop |")
    print("|---|---|---|---|---|---|---|")
    for pp in sizes:
        for chunks in chunk_counts:
            topology, m = Topology(pp, chunks), args.microbatches_per_stage * pp
            for level in levels:
                variability = Variability(**VARIABILITY_LEVELS[level])

                evaluation = [[sample_realization(variability, topology, m, seed * 1000 + r) for r in range(args.dp)]
                              for seed in range(args.seeds)]
                choice = variant_traces(rrfp, topology, m, [
                    [sample_realization(variability, topology, m, 7919 * (seed + 1) + r) for r in range(args.dp)]
                    for seed in range(args.choice_seeds or choice_seeds(topology, m, args.dp))])
                rule = variant_traces(rrfp, topology, m, evaluation)
                traces = {"megatron": [[simulate(megatron, topology, m, r, record_trace=True).trace for r in replicas]
                                       for replicas in evaluation],
                          "after-loop": [[simulate(rrfp, topology, m, r, record_trace=True).trace for r in replicas]
                                         for replicas in evaluation],
                          "lockstep": [[simulate(rrfp, topology, m, lockstep(replicas), record_trace=True).trace]
                                       for replicas in evaluation]}
                cells = []
                for comm_f0 in comms:
                    for count in buckets:
                        comm = DPComm(reduce_per_bucket=comm_f0, gather_per_bucket=comm_f0, buckets_per_chunk=count)
                        t = {name: median([replicas_iteration_time(
                            seed_traces, pp, chunks, comm, overlap_grad_reduce=name != "after-loop",
                            overlap_param_gather=name != "after-loop") for seed_traces in per_seed])
                            for name, per_seed in traces.items()}
                        chosen = best_variant(variant_times(choice, topology, comm), chunks)
                        times = variant_times(rule, topology, comm)
                        t["epochs-fixed"], t["epochs"] = times[DEFAULT_VARIANT], times[chosen]
                        cells.append((comm_f0, count, t))
                        rows.append(dict(pp=pp, chunks=chunks, var=level, comm=comm_f0, buckets=count,
                                         **{k: round(v, 4) for k, v in t.items()}, chosen=str(chosen)))
                        if t["epochs"] > t["megatron"] * (1 + 1e-9):
                            below.append((pp, chunks, level, comm_f0, count, t["megatron"] / t["epochs"]))

                def ratios(other: str, rule="epochs", cells=cells):
                    values = [c[2][other] / c[2][rule] for c in cells]
                    return min(values), statistics.median(values)

                vs = [ratios(o) for o in ("megatron", "after-loop", "lockstep")]
                vs += [ratios(o, "epochs-fixed") for o in ("megatron", "after-loop")]
                print(f"| {pp} | {chunks} | {level} | " + " | ".join(f"{a:.3f}x / {b:.3f}x" for a, b in vs[:3])
                      + " | " + "; ".join(f"{a:.3f}x / {b:.3f}x" for a, b in vs[3:]) + " |", flush=True)
    print(f"cells below Megatron (rule / Megatron < 1.000): {len(below)} of {len(rows)}")
    for pp, chunks, level, comm_f0, count, ratio in below:
        print(f"  PP {pp} x {chunks} chunks {level}, {comm_f0} f0 x {count} buckets: {ratio:.3f}x")
    for other in ("after-loop", "lockstep"):
        behind = [r for r in rows if r[other] < r["epochs"] * 0.99]
        print(f"cells with the rule more than 1% behind {other}: {len(behind)} of {len(rows)}"
              + (f" (worst {min(r[other] / r['epochs'] for r in behind):.3f}x)" if behind else ""))
    if args.csv:
        with open(args.csv, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
