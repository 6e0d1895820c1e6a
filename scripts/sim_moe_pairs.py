"""Simulated worth of pairing a ready forward with a ready backward (``--overlap-moe-expert-parallel-comm``
under rrfp) on MoE pipelines: rrfp paired vs rrfp unpaired vs Megatron's combined 1F1B (interleaved, its own
warm-up) vs Megatron's 1F1B / interleaved, each with its peak activation memory. "rrfp paired" is the
default policy under the flag: pairs, and the backward split into B and W where the model allows (a pair
keeps the split where its forward is admitted without the backward's release); "rrfp unpaired" the
default without the flag; "no split" either one with whole backwards (Transformer Engine's layers built
with ``--delay-wgrad-compute``).

    python scripts/sim_moe_pairs.py                      # the table in docs/moe.md
    python scripts/sim_moe_pairs.py --a2a-shares 0,0.1,0.2,0.3 --ep 2 --pp 4 --chunks 2

Variability j3 (the paper's reference), 16 experts, top-2, Zipf skew 1.0, concentration 20, expert
share 0.5, M = 4 x PP. Time unit f0 (one stage's forward compute). All-to-all time per task = ``a2a`` x
load factor, chosen so that it is the given share of a forward + backward at balanced load
(``--a2a-shares``); a pair takes
max(compute F + B, all-to-all F + B), B without its W where the pair keeps the split
(``Realization.pair_duration``). Memory: peak (microbatch, chunk)
forwards in flight on the fullest stage (one forward's activations = 1), max over seeds.
"""
from __future__ import annotations

import argparse

import numpy as np

from megatron_rrfp.policy.arbiter import ArbiterConfig
from megatron_rrfp.policy.budget import megatron_peak_in_flight
from megatron_rrfp.policy.topology import Topology
from megatron_rrfp.sim import BASELINE, REFERENCE_J3, Variability, policy, sample_realization, simulate
from megatron_rrfp.sim.combined import simulate_combined


def a2a_for_share(share: float, backward_ratio: float = 2.0) -> float:
    """a with 2a / ((1 + ratio) + 2a) = share: the all-to-alls of F and B over the F + B step."""
    return share * (1 + backward_ratio) / (2 * (1 - share)) if share < 1 else float("inf")


def row(pp: int, chunks: int, ep: int, share: float, seeds: int) -> dict:
    topology, m = Topology(pp, chunks), 4 * pp
    variability = Variability(**REFERENCE_J3, num_experts=16, expert_parallel=ep, moe_skew=1.0,
                              moe_concentration=20.0, moe_share=0.5, a2a_time=a2a_for_share(share))
    extra = megatron_peak_in_flight(topology, m) + 1  # one forward more than Megatron (and its combined 1F1B)
    configs = {
        "megatron": policy(BASELINE),
        "rrfp unpaired": ArbiterConfig(hint="default", buffer_limit="1x"),
        "rrfp unpaired, no split": ArbiterConfig(hint="default", buffer_limit="1x", split_backward_ok=False),
        "rrfp paired": ArbiterConfig(hint="default", buffer_limit="1x", pair_forward_backward=True),
        "rrfp paired, no split": ArbiterConfig(hint="default", buffer_limit="1x", pair_forward_backward=True,
                                               split_backward_ok=False),
        "rrfp paired, 1 forward more": ArbiterConfig(hint="default", buffer_limit=extra, pair_forward_backward=True),
    }
    spans = {name: [] for name in configs}
    peaks = {name: 0 for name in configs}
    if chunks > 1:
        spans["megatron combined"], peaks["megatron combined"] = [], 0
    for seed in range(seeds):
        realization = sample_realization(variability, topology, m, seed)
        for name, config in configs.items():
            result = simulate(config, topology, m, realization, name=name)
            spans[name].append(result.makespan)
            peaks[name] = max(peaks[name], max(result.peak_in_flight))
        if chunks > 1:
            combined = simulate_combined(topology, m, realization)
            spans["megatron combined"].append(combined.makespan)
            peaks["megatron combined"] = max(peaks["megatron combined"], max(combined.peak_in_flight))
    base = np.median(spans["megatron"])
    return {name: (base / np.median(values), peaks[name]) for name, values in spans.items()} | {"_base": base}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", default="2,4,8,16")
    parser.add_argument("--chunks", default="1,2")
    parser.add_argument("--ep", default="2,4,8")
    parser.add_argument("--a2a-shares", default="0.3")
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    names = ["rrfp paired", "megatron combined", "rrfp unpaired", "rrfp paired, no split", "rrfp unpaired, no split",
             "rrfp paired, 1 forward more"]
    print("| EP | PP | chunks | a2a share | Megatron 1F1B / interleaved makespan (peak) | " + " | ".join(names) + " |")
    print("|" + "---|" * (5 + len(names)))
    for ep in map(int, args.ep.split(",")):
        for pp in map(int, args.pp.split(",")):
            for chunks in map(int, args.chunks.split(",")):
                for share in map(float, args.a2a_shares.split(",")):
                    r = row(pp, chunks, ep, share, args.seeds)
                    cells = [f"{r[n][0]:.2f}x ({r[n][1]})" if n in r else "-" for n in names]
                    print(f"| {ep} | {pp} | {chunks} | {share:.0%} | {r['_base']:.1f} ({r['megatron'][1]}) | "
                          + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
