"""``train --nproc N``: start N local ranks of ``python -m megatron_rrfp.train`` with the
same flags, as ``torchrun --standalone --nproc-per-node N`` would (``launch.run_module``: on CPU
forked from this process after one import of ``RANK_IMPORTS``, on GPUs through torch's own
launcher, since a fork must not inherit a CUDA driver)."""
from __future__ import annotations

from ..launch import run_module
from .config import TrainConfig, check_layout, to_argv

RANK_MODULE = "megatron_rrfp.train"
# What every rank imports: imported once before `--cpu --nproc` forks its ranks.
RANK_IMPORTS = ("torch", "torch.distributed", "megatron.core", "megatron.core.parallel_state",
                "megatron.core.models.gpt", "megatron.core.distributed", "megatron.core.optimizer",
                "megatron.core.pipeline_parallel.schedules", "megatron_rrfp.train.driver",
                "megatron_rrfp.train.builders", "megatron_rrfp.train.checkpoint", "megatron_rrfp.train.metrics",
                "megatron_rrfp.mcore.schedule", "megatron_rrfp.cpu", "megatron_rrfp.megatron_lm.training_loop",
                "megatron_rrfp.goodput.recorder", "megatron_rrfp.runtime.memory")


def start_local_ranks(config: TrainConfig) -> int:
    """Run ``config.nproc`` ranks; 0, or the first failed rank's status, shell-style."""
    check_layout(config, config.nproc)  # fail before starting anything
    return run_module(config.nproc, RANK_MODULE, to_argv(config), cpu=config.cpu, preload=RANK_IMPORTS)
