#!/usr/bin/env python
"""Both transport protocols on single-queue stand-in GPUs, over many random configurations.

    python scripts/emulate_transport.py [--jobs 100] [--seed 0] [--protocols rounds,early-receive] [--json PATH]
    python scripts/emulate_transport.py --protocols rounds-without-ring-rule,rounds-unagreed,rounds-dp-unagreed
    python scripts/emulate_transport.py --dp-stress --jobs 40 --protocols rounds,rounds-dp-unagreed
    python scripts/emulate_transport.py --dp-epochs [--dp-stress] --protocols rounds,rounds-without-epoch-order

Each configuration is a whole job — PP x TP=2 (PP 2-8, 1-4 model chunks), or in half of them a
production job on two pipelines: DP=2 with megatron DDP's bucketed reductions
(``--overlap-grad-reduce``) and the distributed optimizer's parameter all-gathers
(``--overlap-param-gather``) issued where megatron issues them, some with MoE EP=2 (all-to-alls
in F and B, the dispatcher's host sync in F), each pipeline stage at its own pace — with hints
bf / bfw / 1f1b, buffer limits 2 / 4 / 32, random device times, host jitter and host-channel
latency, run by the real executor, agreement and transport on
``tests/helpers/queue_device.py`` — one in-order queue per rank for compute, TP / DP / EP
collectives and p2p, the worst case of ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (see that module).
``rounds`` is the shipped device transport (with the whole-stage agreement where interleaved DP
overlap needs it, ``mcore/dp_overlap.py``); ``early-receive`` replays the CUDA path this
project had before it; ``rounds-without-ring-rule``, ``rounds-unagreed`` and ``rounds-dp-unagreed``
each drop one rule (see ``tests/helpers/emulated_pipeline.py``). Prints one line per
configuration of ``rounds`` that did not complete, then a summary per protocol:
completed / device deadlocks / other failures.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]  # the package and tests/helpers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=100, help="random configurations per protocol")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--protocols", default="rounds,early-receive")
    parser.add_argument("--json", metavar="PATH", help="write every outcome as JSON")
    parser.add_argument("--quiet-s", type=float, default=2.0,
                        help="seconds without device progress before a deadlock is declared; on a loaded machine "
                             "a starved host thread looks like one: raise it (e.g. 8 at load > 10)")
    parser.add_argument("--dp-stress", action="store_true",
                        help="only interleaved DP=2 jobs with pipelines at very different paces "
                             "(tests/helpers/emulated_pipeline.dp_stress_jobs): where rounds-dp-unagreed can deadlock")
    parser.add_argument("--dp-after-loop", action="store_true",
                        help="with --dp-stress: the DP communication out of the task loop instead of the "
                             "whole-stage agreement (--rrfp-dp-overlap after-loop)")
    parser.add_argument("--dp-epochs", action="store_true",
                        help="every interleaved DP=2 job under the DP epoch rule (--rrfp-dp-overlap epochs) "
                             "instead of the whole-stage agreement / after-loop; rounds-without-epoch-order "
                             "is the rule without its epoch order")
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.dp_after_loop and args.dp_epochs:
        parser.error("--dp-after-loop and --dp-epochs are two different places for the DP communication: give one")
    if args.dp_after_loop and not args.dp_stress:
        parser.error("--dp-after-loop applies to --dp-stress jobs (the random jobs draw it for half their "
                     "interleaved DP=2 jobs); add --dp-stress")
    if not args.quiet_s > 0:
        parser.error(f"--quiet-s must be > 0, got {args.quiet_s}")
    from helpers.emulated_pipeline import PROTOCOLS, dp_stress_jobs, random_jobs, run_emulated

    protocols = args.protocols.split(",")
    for protocol in protocols:
        if protocol not in PROTOCOLS:
            parser.error(f"--protocols: unknown protocol {protocol!r}; choose from {', '.join(PROTOCOLS)}")

    summary, rows = {}, []
    for protocol in protocols:
        counts = {"completed": 0, "deadlock": 0, "failed": 0}
        start = time.monotonic()
        if args.dp_stress:
            jobs = dp_stress_jobs(args.jobs, seed=args.seed, protocol=protocol, quiet_s=args.quiet_s,
                                  dp_after_loop=args.dp_after_loop, dp_epochs=args.dp_epochs)
        else:
            jobs = random_jobs(args.jobs, seed=args.seed, protocol=protocol, quiet_s=args.quiet_s,
                               dp_epochs=args.dp_epochs)
        for i, job in enumerate(jobs):
            outcome = run_emulated(job)
            status = "completed" if outcome.completed else ("deadlock" if outcome.deadlock else "failed")
            counts[status] += 1
            rows.append({"protocol": protocol, "job": job.describe(), "status": status, "error": outcome.error,
                         "wall_s": round(outcome.wall_s, 3)})
            if status != "completed" and protocol == "rounds" or status == "failed":
                print(f"  {status}: {job.describe()}: {outcome.error[:400]}", flush=True)
            print(f"\r{protocol}: {i + 1}/{args.jobs}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        summary[protocol] = dict(counts, seconds=round(time.monotonic() - start, 1))
    for protocol, counts in summary.items():
        print(f"{protocol:>14}: {counts['completed']:>4} completed, {counts['deadlock']:>4} device deadlocks, "
              f"{counts['failed']:>4} other failures of {args.jobs} ({counts['seconds']} s)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"summary": summary, "jobs": rows}, handle, indent=1)
    rounds = summary.get("rounds")
    return 0 if rounds is None or rounds["completed"] == args.jobs else 1


if __name__ == "__main__":
    sys.exit(main())
