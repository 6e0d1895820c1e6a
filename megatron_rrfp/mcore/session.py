"""The persistent per-process runtime: process groups, transport and inbox.

Created by the first schedule call (its group creation is collective over the world, and
every rank reaches that call) and reused by every later one; ``shutdown()`` stops it
before process groups are destroyed.

Rebuilt, not reused, when it no longer fits (every rank sees the same thing, so every
rank rebuilds in the same call, as the collective creation needs):
* the default process group was destroyed and re-created (Megatron-LM's in-process
  restart), or the pipeline / agreement ranks changed: its groups belong to the old world;
* the previous schedule call failed (``discard()``): messages of that iteration may still
  be on the wire or half-received, and only new groups guarantee none reaches the next.
"""
from __future__ import annotations

import datetime
from typing import Optional

import torch
import torch.distributed as dist

from ..runtime.agreement import create_agreement_groups
from ..runtime.executor import Inbox
from ..runtime.transport import StageTransport, create_directed_groups
from . import auto_limit


class Session:
    def __init__(self, *, pp_ranks: list[int], agree_ranks: list[int], device: torch.device,
                 timeout_s: float) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        self.key = _key(pp_ranks, agree_ranks, device)
        self.world = dist.group.WORLD  # identity: a re-created default group is another object
        self.pp_ranks, self.device = pp_ranks, device
        # Both are collective over the world: every rank reaches here in its first call.
        self.groups = create_directed_groups(pp_ranks, timeout=timeout, ring=True)
        self.agreement_group = create_agreement_groups(agree_ranks, timeout=timeout)
        self.inbox = Inbox()
        self.transport = StageTransport(rank=dist.get_rank(), groups=self.groups, device=device,
                                        on_message=self.inbox.put, on_error=self.inbox.fail)

    def close(self, timeout: float = 5.0) -> None:
        self.transport.close(timeout)
        self.inbox.close()

    def fits(self, key: tuple) -> bool:
        return self.key == key and dist.is_initialized() and dist.group.WORLD is self.world


_session: Optional[Session] = None


def _key(pp_ranks, agree_ranks, device) -> tuple:
    return (tuple(pp_ranks), tuple(agree_ranks), str(device))


def session(pp_ranks: list[int], agree_ranks: list[int], device: torch.device, timeout_s: float) -> Session:
    global _session
    if _session is not None and not _session.fits(_key(pp_ranks, agree_ranks, device)):
        discard()  # process groups re-created or re-laid out: this one's groups are stale
    if _session is None:
        _session = Session(pp_ranks=pp_ranks, agree_ranks=agree_ranks, device=device, timeout_s=timeout_s)
    return _session


def discard(timeout: float = 0.5) -> None:
    """Drop the runtime after a failed iteration or stale groups: its inbox and receive
    expectations go with it, its threads are told to stop (one blocked in a receive ends
    when its group times out or is destroyed), and the next call builds a new one."""
    global _session
    old, _session = _session, None
    if old is not None:
        old.close(timeout)


def agreement_group():
    """This rank's TP-agreement group (None before the first call or without TP)."""
    return None if _session is None else _session.agreement_group


def shutdown() -> None:
    """Stop transport threads (before destroying process groups, or at exit)."""
    global _session
    if _session is not None:
        _session.close()
    _session = None
    auto_limit.reset()  # calibrations belong to the job that measured them


__all__ = ["Session", "agreement_group", "session", "shutdown"]
