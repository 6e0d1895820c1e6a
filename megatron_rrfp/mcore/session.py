"""The persistent per-process runtime: process groups, transport and inbox.

Created by the first schedule call (its group creation is collective over the world, and
every rank reaches that call) and reused by every later one; ``shutdown()`` stops it
before process groups are destroyed.
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
        self.pp_ranks, self.device = pp_ranks, device
        # Both are collective over the world: every rank reaches here in its first call.
        self.groups = create_directed_groups(pp_ranks, timeout=timeout, ring=True)
        self.agreement_group = create_agreement_groups(agree_ranks, timeout=timeout)
        self.inbox = Inbox()
        self.transport = StageTransport(rank=dist.get_rank(), groups=self.groups, device=device,
                                        on_message=self.inbox.put, on_error=self.inbox.fail)

    def close(self) -> None:
        self.transport.close()


_session: Optional[Session] = None


def _key(pp_ranks, agree_ranks, device) -> tuple:
    return (tuple(pp_ranks), tuple(agree_ranks), str(device))


def session(pp_ranks: list[int], agree_ranks: list[int], device: torch.device, timeout_s: float) -> Session:
    global _session
    if _session is None:
        _session = Session(pp_ranks=pp_ranks, agree_ranks=agree_ranks, device=device, timeout_s=timeout_s)
    elif _session.key != _key(pp_ranks, agree_ranks, device):
        raise RuntimeError(f"megatron_rrfp: process groups changed between iterations ({_session.key} -> "
                           f"{_key(pp_ranks, agree_ranks, device)}); call megatron_rrfp.shutdown() before "
                           "re-initialising model parallelism")
    return _session


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
