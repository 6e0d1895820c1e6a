#!/usr/bin/env python
"""Stress benchmark of TP agreement: hundreds of random delay patterns at TP=2 x PP=2.

    python scripts/stress_tp_agreement.py [--patterns 500] [--seed 0] [--late-rank 0]

Four gloo ranks run a column/row-parallel MLP stage (megatron-core layers) through the
readiness-first schedule, M=6 microbatches per pattern. Every pattern draws random
per-task delays on every rank (exponential, mean 0.5, 2 or 5 ms), and in every other
pattern one TP rank (``--late-rank``) sees every message it receives 20 ms late, so the
two TP ranks of that stage disagree about what is ready and must agree anyway. Each
pattern's gradients are compared with a no-delay run of the same model and data
(rtol 1e-5): a *mismatch* is a pattern whose gradients differ, a *hang* one that made no
progress for --pattern-timeout seconds (the runtime then rebuilds itself and the next
pattern runs). The pattern bodies are tests/helpers/failures.py's ``stress`` (the unit
test runs 200 of them); this script runs more, with a progress bar, and exits 1 unless
every pattern matched.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]  # the package and tests/helpers; spawned ranks inherit it


def main() -> int:
    from tqdm import tqdm

    from helpers.failures import stress
    from megatron_rrfp.launch.function import launch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patterns", type=int, default=500, help="random delay patterns (default 500)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--late-rank", type=int, default=0, help="the TP rank whose messages arrive late (0..3)")
    parser.add_argument("--pattern-timeout", type=float, default=30.0, help="seconds without progress = a hang")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before the whole run is killed")
    args = parser.parse_args()
    if args.patterns < 1 or not 0 <= args.late_rank < 4:
        parser.error("--patterns must be >= 1 and --late-rank in 0..3")

    progress = tempfile.NamedTemporaryFile(prefix="rrfp-stress-", suffix=".progress", delete=False).name
    box: dict = {}

    def work() -> None:
        try:
            box["results"] = launch(stress, world_size=4, tp=2, pp=2, timeout=args.timeout, args=(args.patterns,),
                                    kwargs={"late_rank": args.late_rank, "seed": args.seed, "progress_path": progress,
                                            "timeout_s": args.pattern_timeout})
        except BaseException as exc:  # noqa: BLE001 - reported below
            box["error"] = exc

    start = time.monotonic()
    thread = threading.Thread(target=work, daemon=True)
    try:
        thread.start()
        with tqdm(total=args.patterns, desc="delay patterns (TP2 x PP2)", unit="pattern") as bar:
            while thread.is_alive():
                thread.join(0.5)
                with open(progress, encoding="utf-8") as handle:
                    lines = handle.read().split()
                done = int(lines[-2]) if len(lines) >= 2 else 0
                if done > bar.n:
                    bar.update(done - bar.n)
    finally:
        os.remove(progress)
    wall = time.monotonic() - start
    if "error" in box:
        print(f"stress run failed (a hang the pattern timeout could not end, or a crash):\n{box['error']}",
              file=sys.stderr)
        return 1
    results = box["results"]
    mismatches = max(r["mismatches"] for r in results)
    hangs = max(r["hangs"] for r in results)
    rounds = sum(r["agree_rounds"] for r in results) / (len(results) * args.patterns)
    print(f"{args.patterns} patterns at TP=2 x PP=2 (M=6, rank {args.late_rank} late in every other pattern, "
          f"seed {args.seed}): {mismatches} mismatches, {hangs} hangs, "
          f"{max(r['distinct_orders'] for r in results)} distinct execution orders, "
          f"{rounds:.1f} agreement rounds per rank and pattern; wall time {wall:.0f} s")
    for r in results:
        if r["first_hang"]:
            print(f"rank {r['rank']}, first hang: {r['first_hang']}", file=sys.stderr)
    return 0 if mismatches == 0 and hangs == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
