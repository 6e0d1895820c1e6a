"""Per-rank checkpoints for ``megatron-rrfp train``: ``torch.save`` of everything a rank
needs to continue exactly where it stopped.

Layout (Megatron-LM's tracker file name, so the directory looks familiar)::

    DIR/latest_checkpointed_iteration.txt    "6", written by rank 0 after every rank saved
    DIR/iter_0000006/rank_00001.pt           model, optimizer, LR scheduler, iteration,
                                             consumed samples, RNG states, layout

A checkpoint loads only into the same layout (world size, TP, PP): there is no
resharding. Files are written to a temporary name and renamed, so a crash mid-save
leaves the previous checkpoint intact.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

TRACKER = "latest_checkpointed_iteration.txt"


@dataclass(frozen=True, kw_only=True, slots=True)
class Resumed:
    iteration: int
    consumed_samples: int
    path: str


def iteration_dir(directory: str, iteration: int) -> str:
    return os.path.join(directory, f"iter_{iteration:07d}")


def save(directory: str, *, iteration: int, consumed_samples: int, model, optimizer, scheduler,
         layout: dict) -> str:
    """Collective: every rank writes its file, then rank 0 moves the tracker."""
    rank = dist.get_rank()
    path = os.path.join(iteration_dir(directory, iteration), f"rank_{rank:05d}.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    state = {
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "layout": layout,
        "model": _unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": _rng_state(),
    }
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)
    dist.barrier()
    if rank == 0:
        with open(os.path.join(directory, TRACKER + ".tmp"), "w") as handle:
            handle.write(f"{iteration}\n")
        os.replace(os.path.join(directory, TRACKER + ".tmp"), os.path.join(directory, TRACKER))
    dist.barrier()
    return os.path.dirname(path)


def latest_iteration(directory: str) -> Optional[int]:
    try:
        with open(os.path.join(directory, TRACKER)) as handle:
            return int(handle.read().strip())
    except FileNotFoundError:
        return None


def load(directory: str, *, iteration: Optional[int], model, optimizer, scheduler, layout: dict) -> Resumed:
    """Restore this rank's state from ``iteration`` (default: the tracker's)."""
    if iteration is None:
        iteration = latest_iteration(directory)
        if iteration is None:
            raise ValueError(f"--load {directory!r}: no {TRACKER} there (nothing saved yet?)")
    path = os.path.join(iteration_dir(directory, iteration), f"rank_{dist.get_rank():05d}.pt")
    if not os.path.isfile(path):
        raise ValueError(f"--load {directory!r}: {path} is missing (saved with fewer ranks, or another iteration?)")
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state["layout"] != layout:
        raise ValueError(f"--load {directory!r}: saved with layout {state['layout']}, this run has {layout}; "
                         "checkpoints load only into the same world size / TP / PP / model sizes")
    _unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    return Resumed(iteration=state["iteration"], consumed_samples=state["consumed_samples"], path=path)


def _unwrap(model):
    return getattr(model, "module", model)  # megatron DDP keeps the stage in .module


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        state["megatron_cuda_tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_cuda_tracker"])
