"""What a resumed Megatron-LM run resumed from, and what restarted it, for the goodput ledger.

Checkpoint kind (``checkpoint_kind``): Megatron-LM's ``_load_base_checkpoint``
(``megatron/training/checkpointing.py``) loads the non-persistent checkpoint when its iteration is
at least the persistent one's (``--non-persistent-ckpt-type local``: NVRx's local checkpoint manager
under ``--non-persistent-local-ckpt-dir``; ``global``: ``--non-persistent-global-ckpt-dir``), else the
persistent one under ``--load``. Read back from the persistent tracker file, so no Megatron function
is wrapped for it.

Restart mechanism (``restart_mechanism``), the innermost layer that brought this call of ``pretrain``:
``in-process`` (NVRx's wrapper called it again in the same process: its call wrapper's restart
iteration is > 0), ``in-job`` (torchrun's / ft_launcher's agent restarted the workers:
``TORCHELASTIC_RESTART_COUNT`` > 0), ``requeue`` (SLURM requeued the job: ``SLURM_RESTART_COUNT`` > 0),
else ``relaunch`` (a new job started from the checkpoint).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Optional

CHECKPOINT_KINDS = ("persistent", "local", "global-non-persistent")
MECHANISMS = ("in-process", "in-job", "requeue", "relaunch")
_TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's persistent tracker file


def checkpoint_kind(margs: Any, iteration: int) -> str:
    """Which kind of checkpoint Megatron-LM loaded at ``iteration`` (see the module docstring)."""
    kind = getattr(margs, "non_persistent_ckpt_type", None)
    if kind not in ("local", "global"):
        return "persistent"
    persistent = persistent_iteration(getattr(margs, "load", None))
    if persistent is not None and persistent > iteration:
        return "persistent"  # cannot happen with Megatron's rule; kept conservative
    if persistent == iteration and not _non_persistent_exists(margs, kind):
        return "persistent"
    return "local" if kind == "local" else "global-non-persistent"


def persistent_iteration(load_dir: Optional[str]) -> Optional[int]:
    """The iteration in ``load_dir``'s tracker file (None: no persistent checkpoint, or 'release')."""
    if not load_dir:
        return None
    try:
        with open(os.path.join(load_dir, _TRACKER)) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _non_persistent_exists(margs: Any, kind: str) -> bool:
    directory = getattr(margs, "non_persistent_local_ckpt_dir" if kind == "local" else
                        "non_persistent_global_ckpt_dir", None)
    return bool(directory) and os.path.isdir(directory) and any(os.scandir(directory))


def restart_mechanism(call_wrapper: Any = None, environ: Mapping[str, str] = os.environ) -> str:
    """The innermost restart layer behind this ``pretrain`` call (module docstring)."""
    if call_wrapper is not None and int(getattr(call_wrapper, "iteration", 0) or 0) > 0:
        return "in-process"
    for variable, mechanism in (("TORCHELASTIC_RESTART_COUNT", "in-job"), ("SLURM_RESTART_COUNT", "requeue")):
        if int(environ.get(variable, "0") or 0) > 0:
            return mechanism
    return "relaunch"


__all__ = ["CHECKPOINT_KINDS", "MECHANISMS", "checkpoint_kind", "persistent_iteration", "restart_mechanism"]
