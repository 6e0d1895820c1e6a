"""Is ``default`` the best shipped policy at every memory limit? (simulator, one process)

    python scripts/sim_default_grid.py                      # the full grid (hours on one core)
    python scripts/sim_default_grid.py --pp 4,8 --chunks 1,2 --limits 1x,2x --workloads j3 --seeds 3

Per cell (PP x chunks x buffer limit x workload x split / no split, M = 4 PP): every named
hint's and default's speedup over strict Megatron (1F1B / interleaved), the best named hint,
default / best (target <= 1.01) and default / strict (target <= 1). The last lines name the
worst cells. ``auto`` on a device with room for 4x is the 4x column.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]  # the package and tests/helpers
from helpers.default_grid import WORKLOADS, evaluate  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=_ints, default=[2, 4, 8, 16, 32])
    parser.add_argument("--chunks", type=_ints, default=[1, 2, 3, 4])
    parser.add_argument("--limits", default="1x,1.5x,2x,4x")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--split", default="split,nosplit", help="split, nosplit or both (what the model allows)")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    warnings.simplefilter("ignore", RuntimeWarning)  # the one-line bf/bfw announcement, once per cell
    cells = []
    for split in [s for s in args.split.split(",") if s]:
        for name in [w for w in args.workloads.split(",") if w]:
            for pp in args.pp:
                for chunks in args.chunks:
                    if name.startswith("moe-ep") and pp * chunks < 2:
                        continue
                    for limit in [x for x in args.limits.split(",") if x]:
                        start = time.time()
                        cell = evaluate(pp, chunks, limit, name, seeds=args.seeds, split_backward_ok=split == "split")
                        cells.append(cell)
                        print(f"{cell.describe()}  ({time.time() - start:.1f}s)", flush=True)
    if not cells:
        return
    worst = max(cells, key=lambda c: c.default_over_best)
    slowest = max(cells, key=lambda c: c.default_over_strict)
    over = sum(c.default_over_best > 1.01 for c in cells)
    print(f"\n{len(cells)} cells; default within 1.01x of the best named hint in {len(cells) - over}")
    print(f"worst default / best named: {worst.default_over_best:.3f}  {worst.describe()}")
    print(f"worst default / strict Megatron: {slowest.default_over_strict:.3f}  {slowest.describe()}")


if __name__ == "__main__":
    main()
