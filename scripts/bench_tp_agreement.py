#!/usr/bin/env python
"""TP agreement overhead: what the per-decision ready-set exchange costs.

    python scripts/bench_tp_agreement.py [--f0-ms 20] [--microbatches 8] [--iterations 5]

Runs a GPT stage at TP=2 x PP=2 (4 gloo processes) with emulated device time (each F
sleeps f0, each B 2*f0, on top of the real compute) and reports, per rank:
  * rounds        agreement collectives per iteration (one per decision, plus re-rounds);
  * round cost    median latency of one exchange measured back-to-back (both ranks ready);
  * overhead      rounds x round cost / iteration time — the cost of agreeing itself;
  * in-collective total time inside the collective, which also counts waiting for the
                  slower TP peer (skew that the peer's compute would cost anyway).
"""
from __future__ import annotations

import argparse
import statistics
import time


def body(f0_s: float, num_microbatches: int, iterations: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_rrfp.bench.hooks import delay_tasks
    from megatron_rrfp.mcore.config import RRFPConfig
    from megatron_rrfp.mcore.cpu import enable_cpu_reference_schedules
    from megatron_rrfp.mcore.schedule import forward_backward_rrfp, last_iteration_report
    from megatron_rrfp.mcore.session import agreement_group
    from megatron_rrfp.train import models

    enable_cpu_reference_schedules()
    config = models.tiny_gpt_config()
    model = models.build_gpt_stage(config, vocab_size=64, seq_length=16, seed=1)
    delay_tasks(lambda t: f0_s * (1 if t.kind.value == "F" else 2))  # emulated device time
    options = RRFPConfig()
    walls, rounds, inside = [], [], []
    for it in range(iterations + 1):
        data = models.synthetic_gpt_batches(seed=it, micro_batch_size=2, seq_length=16, vocab_size=64)
        forward_backward_rrfp(forward_step_func=models.gpt_forward_step, data_iterator=data, model=model,
                              num_microbatches=num_microbatches, rrfp_config=options)
        report = last_iteration_report()
        if it:  # first iteration builds process groups and threads
            walls.append(report.wall_s)
            rounds.append(report.agree_rounds)
            inside.append(report.agree_s)
    # back-to-back exchange latency on the same agreement group
    from megatron_rrfp.runtime.agreement import TPAgreement

    agreement = TPAgreement(agreement_group(), num_microbatches=num_microbatches, num_chunks=1,
                            split_backward=False, forward_only=False)
    dist.barrier(group=agreement_group())
    latencies = []
    for _ in range(200):
        start = time.perf_counter()
        agreement.exchange(set(), 0)
        latencies.append(time.perf_counter() - start)
    round_cost = statistics.median(latencies)
    wall = statistics.median(walls)
    return {"rank": dist.get_rank(), "stage": parallel_state.get_pipeline_model_parallel_rank(),
            "iteration_s": wall, "rounds": statistics.median(rounds), "round_cost_us": round_cost * 1e6,
            "overhead_pct": 100 * statistics.median(rounds) * round_cost / wall,
            "in_collective_pct": 100 * statistics.median(inside) / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--f0-ms", type=float, default=20.0, help="emulated forward time per stage (ms)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=5)
    args = parser.parse_args()
    from megatron_rrfp.dist.launcher import launch

    results = launch(body, world_size=4, tp=2, pp=2, timeout=600,
                     args=(args.f0_ms / 1000, args.microbatches, args.iterations))
    print(f"TP=2 x PP=2, M={args.microbatches}, f0={args.f0_ms} ms, median of {args.iterations} iterations")
    print(f"{'rank':>4} {'stage':>5} {'iter (s)':>9} {'rounds':>7} {'round (us)':>11} {'overhead':>9} {'in-coll.':>9}")
    for r in results:
        print(f"{r['rank']:>4} {r['stage']:>5} {r['iteration_s']:>9.3f} {r['rounds']:>7.0f} {r['round_cost_us']:>11.0f}"
              f" {r['overhead_pct']:>8.2f}% {r['in_collective_pct']:>8.2f}%")


if __name__ == "__main__":
    main()
