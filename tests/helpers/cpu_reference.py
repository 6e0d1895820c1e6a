"""Megatron's own schedules under the CPU shim, repeated: the same ``megatron-rrfp train`` run
(same flags, same seed) built afresh several times in one launch.

Runs on every rank of a ``launch(..., pp=P, vpp=V)`` whose layout matches the flags. Each
repeat builds the model, optimizer and data from the seed and runs ``iterations`` of the
driver's own train step, so a repeat is what one run of the command computes; the first
loss comes before any update, so every repeat must log the same one.
"""
from __future__ import annotations


def train_losses(flags: list, *, repeats: dict, iterations: int = 2) -> dict:
    """{schedule: each repeat's losses (one per iteration)} on the last pipeline stage, {} on
    the other ranks; ``repeats``: {--pipeline-schedule: how many runs}."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_rrfp.cpu import enable_cpu_reference_schedules
    from megatron_rrfp.mcore.session import shutdown
    from megatron_rrfp.train import driver
    from megatron_rrfp.train.config import check_layout, from_args

    assert enable_cpu_reference_schedules()
    losses = {}
    for schedule, count in repeats.items():
        cfg = from_args(driver.build_parser().parse_args(["--cpu", *flags, "--pipeline-schedule", schedule]))
        dp = check_layout(cfg, dist.get_world_size())
        losses[schedule] = []
        for _ in range(count):
            run = driver.build(cfg, torch.device("cpu"), dp)
            losses[schedule].append([driver.train_step(cfg, run).loss for _ in range(iterations)])
    shutdown()
    return losses if parallel_state.is_pipeline_last_stage() else {}
