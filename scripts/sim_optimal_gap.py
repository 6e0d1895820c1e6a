"""How far from the best possible order? The default, strict Megatron and the lower bound over the
clairvoyant optimum (``megatron_rrfp/sim/optimal.py``, OR-Tools CP-SAT: pip install megatron-rrfp[optimal]).

    python scripts/sim_optimal_gap.py                       # PP 2-4 x chunks 1-4 x 1x/2x/4x x j0/j3/multimodal/MoE
    python scripts/sim_optimal_gap.py --pp 2 --chunks 1,2 --limits 1x --workloads j3 --seeds 3 --time-limit 5

Per cell (M = k PP, ``--microbatches-per-stage`` k; the split backward, as the default uses it): per seed the
optimum at the cell's buffer limit (warm-started by every compared policy's order), then medians over seeds of
default / optimum, strict Megatron (1F1B or interleaved, unsplit, its own memory) / optimum, the bound
(``sim/bounds.py`` at the same memory and split) / optimum, and the best named hint / optimum; how many seeds
the solver proved within ``--time-limit`` (unproven: the best order found, so the ratios are lower bounds on
the true gap) and the solver's longest time. The last lines summarise. ``--in-order``: the optimum that keeps
microbatches in order per stage, chunk and kind, as the policies do (what is left without clairvoyant reordering).
Figures and commands: docs/simulator.md ("How far from the optimum").
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]  # the package and tests/helpers
from helpers.default_grid import WORKLOADS, workload  # noqa: E402
from megatron_rrfp.policy.budget import resolve_buffer_limit  # noqa: E402
from megatron_rrfp.policy.topology import Topology  # noqa: E402
from megatron_rrfp.sim.bounds import policy_lower_bound  # noqa: E402
from megatron_rrfp.sim.optimal import optimal_schedule  # noqa: E402
from megatron_rrfp.sim.simulator import policy, simulate  # noqa: E402
from megatron_rrfp.sim.variability import sample_realization  # noqa: E402

GAP_WORKLOADS = {"j0": "j0", "j3": "j3", "multimodal": "multimodal", "moe": "moe-ep4"}
NAMED = ("bfw", "zbh1", "bf", "1f1b")


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def cell(pp: int, chunks: int, spec: str, name: str, *, seeds: int, per_stage: int, time_limit: float,
         workers: int, in_order: bool = False) -> dict:
    topology, m = Topology(pp, chunks), per_stage * pp
    limit = resolve_buffer_limit(spec, topology, m)
    variability = workload(GAP_WORKLOADS[name], pp)
    ratios: dict[str, list[float]] = {"default": [], "strict": [], "lb": [], "best": [], "default_max": []}
    proven, seconds, best_names = 0, [], []
    for seed in range(seeds):
        realization = sample_realization(variability, topology, m, seed)
        runs = {n: simulate(policy(n, limit), topology, m, realization, name=n)
                for n in ("default", *NAMED, "1f1b-strict", "zbh1-strict")}
        bound = policy_lower_bound(policy("default", limit), topology, realization)
        optimum = optimal_schedule(realization, topology, buffer_limit=limit, split_backward=True,
                                   time_limit_s=time_limit, workers=workers, lower_bound=bound,
                                   warm_start=[r.orders for r in runs.values()], in_order=in_order)
        opt = optimum.makespan
        named = min(NAMED, key=lambda n: runs[n].makespan)
        best_names.append(named)
        ratios["default"].append(runs["default"].makespan / opt)
        # the most the gap can be: over the solver's proven bound (the bound on times rounded up to 1/scale)
        ratios["default_max"].append(runs["default"].makespan / max(bound, min(opt, optimum.solver_bound)))
        ratios["strict"].append(runs["1f1b-strict"].makespan / opt)
        ratios["lb"].append(bound / opt)
        ratios["best"].append(runs[named].makespan / opt)
        proven += optimum.proven
        seconds.append(optimum.seconds)
    return dict(pp=pp, chunks=chunks, limit=spec, limit_int=limit, workload=name, m=m, seeds=seeds,
                proven=proven, seconds=max(seconds), best_name=max(set(best_names), key=best_names.count),
                **{k: statistics.median(v) for k, v in ratios.items()})


def row(c: dict) -> str:
    """Unproven seeds: the default's ratio over the best order found, and (≤) over the solver's bound."""
    default = f"{c['default']:.3f}" + ("" if c["proven"] == c["seeds"] else f" (≤ {c['default_max']:.3f})")
    return (f"| {c['pp']} | {c['chunks']} | {c['limit']} ({c['limit_int']}) | {c['workload']} | {default} | "
            f"{c['strict']:.3f} | {c['lb']:.3f} | {c['best']:.3f} (`{c['best_name']}`) | "
            f"{c['proven']}/{c['seeds']} | {c['seconds']:.1f} |")


def summary(cells: list[dict]) -> list[str]:
    lines = []
    for chunks, target in ((1, 1.05), (2, 1.05), (3, 1.10), (4, 1.10)):
        group = [c for c in cells if c["chunks"] == chunks]
        if not group:
            continue
        worst = max(group, key=lambda c: c["default"])
        over = [c for c in group if c["default"] > target]
        geo = math.exp(statistics.mean(math.log(c["default"]) for c in group))
        lb = [c["lb"] for c in group]
        lines.append(f"chunks {chunks}: default / optimum geometric mean {geo:.3f}, worst {worst['default']:.3f} "
                     f"(PP{worst['pp']} {worst['limit']} {worst['workload']}), {len(over)} of {len(group)} cells above "
                     f"{target:.2f}; LB / optimum {min(lb):.3f}-{max(lb):.3f}; proven "
                     f"{sum(c['proven'] for c in group)} of {sum(c['seeds'] for c in group)} seeds")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=_ints, default=[2, 3, 4])
    parser.add_argument("--chunks", type=_ints, default=[1, 2, 3, 4])
    parser.add_argument("--limits", default="1x,2x,4x")
    parser.add_argument("--workloads", default=",".join(GAP_WORKLOADS), help=f"of {', '.join(GAP_WORKLOADS)} "
                        f"(moe = {GAP_WORKLOADS['moe']}; the settings: tests/helpers/default_grid.py)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--microbatches-per-stage", type=int, default=2, help="M = this x PP (default 2)")
    parser.add_argument("--time-limit", type=float, default=5.0, help="solver seconds per seed (default 5)")
    parser.add_argument("--workers", type=int, default=8, help="CP-SAT workers (default 8)")
    parser.add_argument("--in-order", action="store_true", help="the optimum that keeps microbatches in order per "
                        "stage, chunk and kind, as the policies do (no clairvoyant reordering)")
    args = parser.parse_args()
    assert all(w in GAP_WORKLOADS for w in args.workloads.split(",")), f"--workloads: of {list(GAP_WORKLOADS)}"
    assert set(GAP_WORKLOADS.values()) <= set(WORKLOADS)
    warnings.simplefilter("ignore", RuntimeWarning)  # the one-line bf/bfw announcement, once per cell
    began = time.perf_counter()
    print("| PP | chunks | limit | workload | default / opt | strict Megatron / opt | LB / opt | best named / opt "
          "| proven | solver s (max) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    cells = []
    for name in [w for w in args.workloads.split(",") if w]:
        for pp in args.pp:
            for chunks in args.chunks:
                for spec in [s for s in args.limits.split(",") if s]:
                    cells.append(cell(pp, chunks, spec, name, seeds=args.seeds, per_stage=args.microbatches_per_stage,
                                      time_limit=args.time_limit, workers=args.workers, in_order=args.in_order))
                    print(row(cells[-1]), flush=True)
    print(*summary(cells), sep="\n")
    print(f"{len(cells)} cells, seeds 0-{args.seeds - 1}, {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
