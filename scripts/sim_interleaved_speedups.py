"""Interleaved speedups over strict interleaved 1F1B (simulator, one process).

    python scripts/sim_interleaved_speedups.py         # six j3 points, default/zbh1/bfw at 1x
    python scripts/sim_interleaved_speedups.py --policies default,zbh1 --buffer-limit 1.5x --seeds 12
    python scripts/sim_interleaved_speedups.py --grid  # + the no-jitter grid (default vs its strict hint)

j3 points: PP in {4, 8, 16} x chunks in {2, 4}, M = 4 PP, median over seeds of the per-seed ratio
(the same as `megatron-rrfp simulate --reference`). Targets: default >= 1.10, split backward >= 1.25.
"""
from __future__ import annotations

import argparse
import time

from megatron_rrfp.policy.hint_specs import make_hint
from megatron_rrfp.policy.topology import Topology
from megatron_rrfp.sim import REFERENCE_J3, Variability, median, policy, sample_realization, simulate

POINTS = [(4, 2), (8, 2), (4, 4), (16, 2), (8, 4), (16, 4)]


def j3_points(policies: list[str], limit: str, seeds: int) -> None:
    for pp, chunks in POINTS:
        start, topology, m = time.time(), Topology(pp, chunks), 4 * pp
        speedups: dict[str, list[float]] = {name: [] for name in policies}
        for seed in range(seeds):
            realization = sample_realization(Variability(**REFERENCE_J3), topology, m, seed)
            base = simulate(policy("1f1b-strict"), topology, m, realization).makespan
            for name in policies:
                speedups[name].append(base / simulate(policy(name, limit), topology, m, realization).makespan)
        figures = "  ".join(f"{name}={median(values):.3f}" for name, values in speedups.items())
        print(f"PP{pp:<2} C{chunks} M{m:<3} {figures}  ({time.time() - start:.1f}s)", flush=True)


def no_jitter_grid() -> None:
    worst = (float("inf"), None)
    for pp in (2, 4, 8, 16):
        for chunks in (1, 2, 3, 4):
            for m in (pp, 2 * pp, 4 * pp, 8 * pp):
                topology = Topology(pp, chunks)
                realization = sample_realization(Variability(), topology, m, seed=0)
                hint = make_hint("default").for_layout(topology).name
                strict = simulate(policy(f"{hint}-strict"), topology, m, realization).makespan
                speedup = strict / simulate(policy("default", "1x"), topology, m, realization).makespan
                worst = min(worst, (speedup, (pp, chunks, m)), key=lambda x: x[0])
    print(f"no jitter: worst default / strict hint = {worst[0]:.4f} at (PP, C, M) = {worst[1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="default,zbh1,bfw")
    parser.add_argument("--buffer-limit", default="1x")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--grid", action="store_true", help="also sweep the no-jitter grid")
    args = parser.parse_args()
    j3_points([p for p in args.policies.split(",") if p], args.buffer_limit, args.seeds)
    if args.grid:
        no_jitter_grid()


if __name__ == "__main__":
    main()
