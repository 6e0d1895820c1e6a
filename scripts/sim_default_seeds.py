"""How much of the default grid's verdict is the seeds, and would measuring the candidates beat the rule?
(simulator, one process, about 12 minutes with the defaults)

    python scripts/sim_default_seeds.py                    # the buckets where the winner swaps, PP 4 and 8
    python scripts/sim_default_seeds.py --pp 4 --seeds 5 --trials 3

For every cell, every allowed named hint and ``default`` run on two disjoint seed sets (0..N-1
and 1000..1000+N-1). Printed: the cells where ``default`` is more than 1% behind the best named
hint on each set, on both, and on the pooled seeds; then a *measured choice* — each allowed hint
run on the first ``--trials`` seeds of the second set, the one with the smallest median kept —
judged on the first set, against the rule.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import warnings

from megatron_rrfp.policy.arbiter import ArbiterConfig
from megatron_rrfp.policy.hints import HintError
from megatron_rrfp.policy.plan import Plan
from megatron_rrfp.policy.topology import Topology
from megatron_rrfp.sim.simulator import simulate
from megatron_rrfp.sim.variability import sample_realization

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]  # the package and tests/helpers
from helpers.default_grid import NAMED_HINTS, SPLIT_ONLY, WORKLOADS, workload  # noqa: E402

SECOND_SET = 1000
TOLERANCE = 1.01


def swapping_buckets(pp_sizes: list[int]):
    """(PP, chunks, limit, split) where the best named hint depends on the workload (docs/simulator.md)."""
    for pp in pp_sizes:
        for chunks in (3, 4):
            yield pp, chunks, "1.5x", True
        yield pp, 1, "1x", False
        for chunks in (2, 3, 4):
            for limit in ("1.5x", "2x", "4x"):
                yield pp, chunks, limit, False


def default_over_best(runs: dict[str, list[float]]) -> float:
    medians = {name: statistics.median(values) for name, values in runs.items()}
    return medians["default"] / min(v for name, v in medians.items() if name != "default")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", default="4,8")
    parser.add_argument("--seeds", type=int, default=9, help="seeds per set")
    parser.add_argument("--trials", type=int, default=3, help="trial iterations per candidate (<= --seeds)")
    args = parser.parse_args()
    warnings.simplefilter("ignore", RuntimeWarning)  # the one-line bf/bfw announcement
    counts = dict(cells=0, first=0, second=0, both=0, pooled=0, rule=0, measured=0)
    behind = []
    for pp, chunks, limit, split in swapping_buckets([int(p) for p in args.pp.split(",")]):
        topology, m = Topology(pp, chunks), 4 * pp
        for name in WORKLOADS:
            variability = workload(name, pp)
            configs = {}
            for hint in ("default", *NAMED_HINTS):
                if split or hint not in SPLIT_ONLY:
                    config = ArbiterConfig(hint=hint, buffer_limit=limit, split_backward_ok=split)
                    try:
                        Plan.build(config, topology, m)
                    except HintError:  # gpipe below room for all its forwards
                        continue
                    configs[hint] = config
            sets = []
            for first in (0, SECOND_SET):
                runs = {hint: [] for hint in configs}
                for seed in range(first, first + args.seeds):
                    realization = sample_realization(variability, topology, m, seed)
                    for hint, config in configs.items():
                        runs[hint].append(simulate(config, topology, m, realization).makespan)
                sets.append(runs)
            first, second = (default_over_best(runs) for runs in sets)
            pooled = default_over_best({hint: sets[0][hint] + sets[1][hint] for hint in configs})
            trial = {hint: statistics.median(values[:args.trials]) for hint, values in sets[1].items()}
            picked = min(trial, key=trial.get)
            judged = {hint: statistics.median(values) for hint, values in sets[0].items()}
            best = min(v for hint, v in judged.items() if hint != "default")
            counts["cells"] += 1
            counts["first"] += first > TOLERANCE
            counts["second"] += second > TOLERANCE
            counts["both"] += first > TOLERANCE and second > TOLERANCE
            counts["pooled"] += pooled > TOLERANCE
            counts["rule"] += judged["default"] / best <= TOLERANCE
            counts["measured"] += judged[picked] / best <= TOLERANCE
            cell = f"PP{pp:<2} C{chunks} {limit:>4} {name:<10} {'split' if split else 'nosplit':<7}"
            if pooled > TOLERANCE:
                behind.append((pooled, first, second, cell))
            print(f"{cell} default/best "
                  f"{first:.3f} (seeds 0+) {second:.3f} ({SECOND_SET}+) {pooled:.3f} (pooled); "
                  f"measured choice: {picked}", flush=True)
    c = counts
    print(f"\n{c['cells']} cells; default more than 1% behind the best named hint: {c['first']} on seeds 0+, "
          f"{c['second']} on seeds {SECOND_SET}+, {c['both']} on both, {c['pooled']} pooled")
    print(f"within 1.01x on seeds 0+: the rule {c['rule']}, a measured choice over {args.trials} trial "
          f"iterations per hint {c['measured']}")
    for pooled, first, second, cell in sorted(behind, reverse=True)[:10]:
        print(f"  {pooled:.3f} pooled ({first:.3f} / {second:.3f})  {cell}")


if __name__ == "__main__":
    main()
