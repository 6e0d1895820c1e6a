#!/usr/bin/env python
"""TP agreement cost: what the compute thread loses to agreeing, and what the exchange costs.

    python scripts/bench_tp_agreement.py [--f0-ms 20] [--microbatches 8] [--iterations 5] [--pp 2] [--json PATH]

Runs a GPT stage at TP=2 x PP=2 (4 gloo processes; ``--pp 3`` adds a middle stage, whose
bubbles are followed by an exchange) with emulated device time (each F
sleeps f0, each B 2*f0, on top of the real compute) and reports, per rank (medians over
the iterations after the first, as fractions of the iteration):
  * rounds          agreement exchanges per iteration (one per decision, plus re-rounds);
  * round (us)      median latency of one exchange measured back-to-back (both ranks ready);
  * blocked         the critical-path cost: time the compute thread waited for an agreed
                    result (the exchanges themselves run on a helper thread, beside the task);
  * of which skew   the part of `blocked` spent until the slowest TP peer had even posted
                    its offer (the peer was behind: its TP collectives would cost that anyway);
  * in collective   time the helper thread spent inside the all-gathers, incl. peer skew.

``--json PATH`` writes ``ranks[].agreement_blocked_fraction``, ``ranks[].in_collective_fraction``
(and the other columns) for tooling.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def body(f0_s: float, num_microbatches: int, iterations: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_rrfp.bench.around_schedules import sleep_before_tasks
    from megatron_rrfp.cpu import enable_cpu_reference_schedules
    from megatron_rrfp.mcore.config import RRFPConfig
    from megatron_rrfp.mcore.schedule import forward_backward_rrfp, last_iteration_report
    from megatron_rrfp.mcore.session import agreement_group
    from megatron_rrfp.train import models

    enable_cpu_reference_schedules()
    config = models.tiny_gpt_config()
    model = models.build_gpt_stage(config, vocab_size=64, seq_length=16, seed=1)
    # emulated device time
    options = RRFPConfig(around_task=sleep_before_tasks(lambda t: f0_s * (1 if t.kind.value == "F" else 2)))
    rows = []
    for it in range(iterations + 1):
        data = models.synthetic_gpt_batches(seed=it, micro_batch_size=2, seq_length=16, vocab_size=64)
        forward_backward_rrfp(forward_step_func=models.gpt_forward_step, data_iterator=data, model=model,
                              num_microbatches=num_microbatches, rrfp_config=options)
        report = last_iteration_report()
        if it:  # the first iteration builds process groups and threads
            rows.append((report.wall_s, report.agree_rounds, report.agree_s, report.agree_peer_wait_s,
                         report.agree_collective_s))
    # back-to-back exchange latency on the same agreement group
    from megatron_rrfp.runtime.agreement import TPAgreement

    agreement = TPAgreement(agreement_group(), num_microbatches=num_microbatches, num_chunks=1,
                            split_backward=False, forward_only=False)
    dist.barrier(group=agreement_group())
    latencies = []
    for _ in range(200):
        start = time.perf_counter()
        agreement.exchange(set())
        latencies.append(time.perf_counter() - start)
    agreement.close()

    def median_fraction(column: int) -> float:
        return statistics.median(row[column] / row[0] for row in rows)

    return {"rank": dist.get_rank(), "stage": parallel_state.get_pipeline_model_parallel_rank(),
            "iteration_s": statistics.median(row[0] for row in rows),
            "rounds": statistics.median(row[1] for row in rows),
            "round_cost_us": statistics.median(latencies) * 1e6,
            "agreement_blocked_fraction": median_fraction(2),
            "peer_skew_fraction": median_fraction(3),
            "in_collective_fraction": median_fraction(4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--f0-ms", type=float, default=20.0, help="emulated forward time per stage (ms)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (TP is 2; 2 * PP processes)")
    parser.add_argument("--json", metavar="PATH", help="write the per-rank figures as JSON")
    args = parser.parse_args()
    if args.pp < 2:
        parser.error(f"--pp must be >= 2, got {args.pp}")
    for name in ("f0_ms", "microbatches", "iterations"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    from megatron_rrfp.launch.function import launch

    results = launch(body, world_size=2 * args.pp, tp=2, pp=args.pp, timeout=900,
                     args=(args.f0_ms / 1000, args.microbatches, args.iterations))
    print(f"TP=2 x PP={args.pp}, M={args.microbatches}, f0={args.f0_ms} ms, median of {args.iterations} iterations")
    print(f"{'rank':>4} {'stage':>5} {'iter (s)':>9} {'rounds':>7} {'round (us)':>11} {'blocked':>8} "
          f"{'of which skew':>14} {'in collective':>14}")
    for r in results:
        print(f"{r['rank']:>4} {r['stage']:>5} {r['iteration_s']:>9.3f} {r['rounds']:>7.0f} {r['round_cost_us']:>11.0f}"
              f" {100 * r['agreement_blocked_fraction']:>7.2f}% {100 * r['peer_skew_fraction']:>13.2f}%"
              f" {100 * r['in_collective_fraction']:>13.2f}%")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"layout": {"tp": 2, "pp": args.pp}, "microbatches": args.microbatches, "f0_ms": args.f0_ms,
                       "iterations": args.iterations, "ranks": results}, handle, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
