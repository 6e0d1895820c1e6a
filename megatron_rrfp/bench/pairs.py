"""`bench --overlap-moe-expert-parallel-comm`: megatron-core's combined forward-backward step for
every schedule of one run. ``megatron-1f1b`` is then Megatron's combined-1F1B interleaved schedule
(megatron-core needs virtual stages for it at PP > 1), RRFP's readiness-first schedules pair a
ready forward with a ready backward (``mcore/stage_work.py``, as ``train`` runs them); a combined
step's emulated device time is the simulator's pair model (``emulation.py``), and the simulator's
column predicts the same: ``sim/combined.py`` for Megatron's, the paired policy for RRFP's.

torch-free but for the one check of ``--delay-wgrad-compute``, which reads megatron-core.
"""
from __future__ import annotations

import dataclasses

__all__ = ["check_paired", "paired_arbiter", "simulate_schedule"]

_SPLIT = ("rrfp-bfw", "rrfp-zbh1", "rrfp-zbh1-strict")
"""Schedules that place W tasks by their own order, which is not built for pairs."""


def check_paired(config) -> None:
    """--overlap-moe-expert-parallel-comm / --delay-wgrad-compute need what megatron-core and the
    bench's models need; one line naming the option, before any rank starts."""
    overlap = config.overlap_moe_expert_parallel_comm
    if config.delay_wgrad_compute and not overlap:
        raise ValueError("--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm (megatron-core's rule)")
    if not overlap:
        return
    if config.model != "gpt" or config.workload.expert_parallel < 2 or not config.workload.num_experts:
        raise ValueError("--overlap-moe-expert-parallel-comm needs --model gpt, --num-experts and "
                         "--expert-model-parallel-size > 1 (the bench's MoE uses the alltoall dispatcher)")
    if config.num_chunks < 2:
        raise ValueError(f"--overlap-moe-expert-parallel-comm with --pipeline-model-parallel-size "
                         f"{config.pipeline_size} needs --virtual-pipeline-model-parallel-size > 1: megatron-core's "
                         "combined 1F1B (the megatron-1f1b baseline) exists only for its interleaved schedule")
    split = [s for s in config.schedules if s in _SPLIT]
    if split:
        raise ValueError(f"--overlap-moe-expert-parallel-comm: --schedules {','.join(split)} place W tasks by their "
                         "own order, which is not built for pairs; use megatron-1f1b, rrfp-strict, rrfp-default (it "
                         "pairs, and splits the backward where it can), rrfp-bf")
    if config.optimal or config.dp_reduce_ms or config.dp_gather_ms:
        raise ValueError("--overlap-moe-expert-parallel-comm: --optimal, --dp-reduce-ms and --dp-gather-ms do not "
                         "model combined steps yet; drop them")
    if config.delay_wgrad_compute:
        from megatron.core.tensor_parallel.layers import RowParallelLinear

        if not hasattr(RowParallelLinear, "backward_dw"):
            raise ValueError("--delay-wgrad-compute calls backward_dw() on every linear, which this megatron-core "
                             "release defines only for Transformer Engine's (the bench builds the local spec): drop "
                             "--delay-wgrad-compute or use megatron-core >= 0.19")


def paired_arbiter(config, arbiter):
    """The arbiter RRFP's runtime runs under the flag (``mcore.stage_work.with_combined_steps``):
    pairs allowed, the backward split where the model allows; unchanged without it."""
    if not config.overlap_moe_expert_parallel_comm:
        return arbiter
    return dataclasses.replace(arbiter, pair_forward_backward=True)


def simulate_schedule(config, schedule: str, arbiter, topology, realization) -> float:
    """The simulated iteration of one bench schedule on one draw: Megatron's combined 1F1B for
    ``megatron-1f1b`` under the flag, else the simulator on ``arbiter``."""
    if config.overlap_moe_expert_parallel_comm and schedule == "megatron-1f1b":
        from ..sim.combined import simulate_combined

        return simulate_combined(topology, config.num_microbatches, realization).makespan
    from ..sim.simulator import simulate

    return simulate(paired_arbiter(config, arbiter), topology, config.num_microbatches, realization).makespan
