"""``train --nproc N``: start N local ranks of ``python -m megatron_rrfp.train`` with the
same flags, as ``torchrun --standalone --nproc-per-node N`` would: on CPU forked from this
process after one import of what every rank imports (``dist/forked.py``), on GPUs through
torch's own launcher (``dist/torchrun.py``: a fork must not inherit a CUDA driver)."""
from __future__ import annotations

import os

from ..dist.env import HIDDEN_CUDA
from .config import TrainConfig, check_layout, to_argv

RANK_MODULE = "megatron_rrfp.train"
# What every rank imports: imported once before `--cpu --nproc` forks its ranks.
RANK_IMPORTS = ("torch", "torch.distributed", "megatron.core", "megatron.core.parallel_state",
                "megatron.core.models.gpt", "megatron.core.distributed", "megatron.core.optimizer",
                "megatron.core.pipeline_parallel.schedules", "megatron_rrfp.train.driver",
                "megatron_rrfp.train.builders", "megatron_rrfp.train.checkpoint", "megatron_rrfp.train.metrics",
                "megatron_rrfp.mcore.schedule", "megatron_rrfp.cpu", "megatron_rrfp.megatron_lm.hooks",
                "megatron_rrfp.goodput.recorder", "megatron_rrfp.runtime.memory")


def start_local_ranks(config: TrainConfig) -> int:
    """Run ``config.nproc`` ranks; 0, or the first failed rank's status, shell-style."""
    check_layout(config, config.nproc)  # fail before starting anything
    env = dict(HIDDEN_CUDA) if config.cpu else {}
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // config.nproc))
    if config.cpu:
        from ..dist.forked import run_module_forked

        return run_module_forked(config.nproc, RANK_MODULE, to_argv(config), env=env, preload=RANK_IMPORTS)
    from ..dist.torchrun import run_module

    return run_module(config.nproc, RANK_MODULE, to_argv(config), env=env)
