"""Per-rank checkpoints for ``megatron-rrfp train``: ``torch.save`` of everything a rank
needs to continue exactly where it stopped.

Layout (Megatron-LM's tracker file name, so the directory looks familiar)::

    DIR/latest_checkpointed_iteration.txt    "6", written by rank 0 after every rank saved
    DIR/iter_0000006/rank_00001.pt           model, optimizer, LR scheduler, iteration,
                                             consumed samples, RNG states, layout

A checkpoint loads only into the same layout (world size, TP, PP): there is no
resharding. Files are written to a temporary name, fsynced, renamed, and their directory
fsynced; rank 0 moves the tracker only after every rank did so (and after fsyncing the
checkpoint directory itself), so a crash at any point -- even of the whole node -- leaves
the tracker on a complete checkpoint.

Loading reads tensors and plain values only (``torch.load(weights_only=True)``): a file
planted in ``--load`` cannot run code, and a truncated or foreign file is a clear error.
"""
from __future__ import annotations

import errno
import os
import pickle
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
    _write_durably(path, lambda handle: torch.save(state, handle))
    dist.barrier()  # every rank's file is on disk
    if rank == 0:
        _fsync_directory(directory)  # the iteration directory's own entry
        _write_durably(os.path.join(directory, TRACKER), lambda handle: handle.write(f"{iteration}\n".encode()))
    dist.barrier()
    return os.path.dirname(path)


def _write_durably(path: str, write) -> None:
    """``write(handle)`` to ``path``.tmp, fsync it, rename it to ``path``, fsync the
    directory: after this returns the file is complete on disk under its final name."""
    with open(path + ".tmp", "wb") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(path + ".tmp", path)
    _fsync_directory(os.path.dirname(path))


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def latest_iteration(directory: str) -> Optional[int]:
    try:
        with open(os.path.join(directory, TRACKER), "rb") as handle:
            text = handle.read(64).decode("ascii", "replace").strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise ValueError(f"--load {directory!r}: {TRACKER} holds {text!r}, not an iteration number; "
                         "give --load-iteration N to pick a saved iteration")
    return int(text)


def load(directory: str, *, iteration: Optional[int], model, optimizer, scheduler, layout: dict) -> Resumed:
    """Restore this rank's state from ``iteration`` (default: the tracker's)."""
    if iteration is None:
        iteration = latest_iteration(directory)
        if iteration is None:
            raise ValueError(f"--load {directory!r}: no {TRACKER} there (nothing saved yet?)")
    path = os.path.join(iteration_dir(directory, iteration), f"rank_{dist.get_rank():05d}.pt")
    if not os.path.isfile(path):
        raise ValueError(f"--load {directory!r}: {path} is missing (saved with fewer ranks, or another iteration?)")
    state = _read(path, directory)
    check_same_pattern(directory, state["layout"], layout)
    if state["layout"] != layout:
        raise ValueError(f"--load {directory!r}: saved with layout {state['layout']}, this run has {layout}; "
                         "checkpoints load only into the same world size / TP / PP / model sizes")
    _unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    return Resumed(iteration=state["iteration"], consumed_samples=state["consumed_samples"], path=path)


def check_same_pattern(directory: str, saved: dict, layout: dict) -> None:
    """A hybrid model's layers are its --hybrid-layer-pattern: another pattern is another
    model (no format reshards it), refused in one line before anything loads."""
    was, now = saved.get("hybrid_layer_pattern"), layout.get("hybrid_layer_pattern")
    if (was or now) and was != now:
        raise ValueError(f"--load {directory!r}: saved with --hybrid-layer-pattern {was!r}, this run has {now!r}; "
                         "resume with the pattern it was saved with")


_KEYS = ("iteration", "consumed_samples", "layout", "model", "optimizer", "scheduler", "rng")


def _read(path: str, directory: str) -> dict:
    """The saved state: tensors and plain values only (no code runs), or ValueError."""
    try:
        with torch.serialization.safe_globals(_numpy_array_globals()):  # RNG states saved before they were lists
            state = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EIO, errno.ENOENT):
            raise ValueError(f"--load {directory!r}: cannot read {path}: {exc.strerror}") from None
        raise _unreadable(path, directory, exc) from None  # e.g. EINVAL from the zip reader: cut short
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, AttributeError,
            ImportError, IndexError, KeyError) as exc:
        raise _unreadable(path, directory, exc) from None
    missing = [key for key in _KEYS if not isinstance(state, dict) or key not in state]

    if missing:
        raise ValueError(f"--load {directory!r}: {path} is not a megatron-rrfp train checkpoint (missing "
                         f"{', '.join(missing)}); resume from another saved iteration with --load-iteration N")
    return state


def _unreadable(path: str, directory: str, exc: BaseException) -> ValueError:
    return ValueError(f"--load {directory!r}: {path} cannot be loaded ({_reason(exc)}): it is truncated or corrupt, "
                      "or was not written by megatron-rrfp train (loading reads tensors and plain values only, never "
                      "code); resume from another saved iteration with --load-iteration N")


def _reason(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    # torch's weights-only refusal is a paragraph; the line naming what the file wanted to run is the point
    detail = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), None)
    return (detail or (lines[0] if lines else type(exc).__name__))[:300]


def _numpy_array_globals() -> list:
    reconstruct = np.ndarray.__reduce__(np.zeros(1))[0]  # numpy.(_)core.multiarray._reconstruct
    return [reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _unwrap(model):
    return getattr(model, "module", model)  # megatron DDP keeps the stage in .module


def _rng_state() -> dict:
    name, keys, position, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (name, keys.tolist(), int(position), int(has_gauss), float(cached)),
             "torch": torch.get_rng_state()}  # plain values: loadable with weights_only
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        state["megatron_cuda_tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_cuda_tracker"])
