"""How ranks get started: one entry per way, all in this folder.

    function.launch(fn, world_size=N, tp=...)   one Python function on N local gloo ranks, forked from a fork
                                                server that imported torch and megatron-core once, CUDA hidden
                                                (tests, ``bench``, the self-check): values back, or one error
                                                listing every rank
    run_module(N, module, args, cpu=...)        N local ranks of ``python -m module args``, as ``torchrun
                                                --standalone --nproc-per-node N`` would (``train --nproc N``):
                                                forked from this process on CPU (``forked.py``), torch's own
                                                launcher in this process on GPUs (``torchrun.py``)
    torchrun.run_module_subprocess(N, ...)      torch's launcher as a child process (``bench --device cuda``,
                                                which waits on it from a worker thread)
    python -m megatron_rrfp.launch SCRIPT ...   an unmodified Megatron-LM entry script in each rank that
                                                torchrun or srun started (``megatron_lm.py``, ``__main__.py``)

A rank that torchrun or srun started itself finds its place with ``env.detect()`` and joins with
``env.init_process_group``; ``env.py`` also holds the environment every launch here shares:
gloo over loopback (``gloo_on_loopback``) and, for a CPU run on a GPU host, no visible CUDA device
(``hide_cuda``), set before anything counts CUDA devices. Importing this package imports no torch.
What ranks share once they run (one-write lines, the max over ranks) is ``megatron_rrfp/ranks.py``.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from .env import HIDDEN_CUDA

__all__ = ["run_module"]


def run_module(nproc: int, module: str, args: Sequence[str], *, cpu: bool, preload: Iterable[str] = ()) -> int:
    """Run ``python -m module args`` as ranks 0..nproc-1 on this host; 0, or the first failed rank's
    status, shell-style. ``cpu``: gloo ranks forked from this process after importing ``preload`` (what
    every rank imports), with CUDA hidden; else torch's launcher, one rank per GPU. Each rank gets
    ``OMP_NUM_THREADS`` = this host's cores / nproc unless it is set."""
    env = dict(HIDDEN_CUDA) if cpu else {}
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    if cpu:
        from .forked import run_module_forked

        return run_module_forked(nproc, module, args, env=env, preload=preload)
    from . import torchrun

    return torchrun.run_module(nproc, module, args, env=env)
