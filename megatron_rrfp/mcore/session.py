"""The persistent per-process runtime: process groups, transport and inbox.

Held by the process's ``ScheduleState`` (mcore/state.py). Made once, before any training
step if the integration calls ``start()`` right after model parallelism is initialised
(else by the first schedule call, on the main thread); reused by every later call;
``shutdown()`` stops it, with the rest of the state, before process groups are destroyed.
Every group is created here, on every rank in the same order (``new_group`` is
collective over the world), and the device transport's NCCL communicators are warmed up
here too, pair by pair in one global order — not lazily inside the first step.

Two transports (``RRFPConfig.transport``): ``threads`` (``runtime.transport``: gloo,
host tensors — the CPU path) and ``rounds`` (``runtime.rounds``: NCCL on CUDA, built on
NCCL's blocking semantics; also runs over gloo for checking it on CPU). ``auto`` picks
rounds on CUDA and threads on CPU. The device transport's NCCL groups time out well after
RRFP's own stall timeout, so RRFP's diagnosis prints before NCCL's watchdog aborts.

Rebuilt, not reused, when it no longer fits (every rank sees the same thing, so every
rank rebuilds in the same call, as the collective creation needs):
* the default process group was destroyed and re-created (Megatron-LM's in-process
  restart), or the pipeline / agreement ranks or the transport changed: its groups
  belong to the old world;
* the previous schedule call failed (``ScheduleState.discard``): messages of that iteration may still
  be on the wire or half-received, and only new groups guarantee none reaches the next.
  On CUDA its NCCL pair communicators are aborted; recovering in-process is for CPU/gloo
  runs only — on GPUs a failed iteration means restarting the job (torchrun
  ``--max-restarts``, as the SLURM scripts do, resuming from the last checkpoint).
"""
from __future__ import annotations

import atexit
import datetime
import logging
from typing import Optional

import torch
import torch.distributed as dist

from ..runtime.agreement import create_agreement_groups
from ..runtime.device import GlooHostChannel, HostDevice, NcclDevice, create_channel_groups, create_pair_groups, warm_up
from ..runtime.inbox import Inbox
from ..runtime.rounds import RoundTransport
from ..runtime.transport import StageTransport, create_directed_groups
from .config import collective_timeout_floor_s, defaults
from .state import ScheduleState

log = logging.getLogger(__name__)
TRANSPORTS = ("auto", "threads", "rounds")
CHANNEL_TIMEOUT = datetime.timedelta(days=7)  # a host-channel receive waits for records between steps


def device_timeout(timeout_s: float) -> datetime.timedelta:
    """NCCL's timeout for the pair groups: above every wait RRFP makes, each of which is at
    most ``timeout_s`` (the executor's stall timeout, ``flush``, the ring rule, the TP
    agreement group's timeout), so RRFP's diagnosis always prints before NCCL's watchdog."""
    return datetime.timedelta(seconds=collective_timeout_floor_s(timeout_s))


def resolve_transport(transport: str, device: torch.device) -> str:
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if transport == "auto":
        return "rounds" if device.type == "cuda" else "threads"
    if transport == "threads" and device.type == "cuda":
        raise ValueError("transport='threads' carries host tensors over gloo and cannot run on CUDA; "
                         "use 'rounds' (or 'auto')")
    return transport


class Session:
    def __init__(self, *, pp_ranks: list[int], agree_ranks: list[int], device: torch.device,
                 timeout_s: float, transport: str = "auto") -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        self.kind = resolve_transport(transport, device)
        self.key = _key(pp_ranks, agree_ranks, device, self.kind)
        self.world = dist.group.WORLD  # identity: a re-created default group is another object
        self.pp_ranks, self.device = pp_ranks, device
        rank = dist.get_rank()
        self.inbox = Inbox()
        # All collective over the world, in this order on every rank.
        if self.kind == "threads":
            self.groups = create_directed_groups(pp_ranks, timeout=timeout, ring=True)
            self.agreement_group = create_agreement_groups(agree_ranks, timeout=timeout)
            self.transport = StageTransport(rank=rank, groups=self.groups, device=device,
                                            on_message=self.inbox.put, on_error=self.inbox.fail)
            return
        channel_groups = create_channel_groups(pp_ranks, timeout=CHANNEL_TIMEOUT, ring=True)
        self.groups = create_pair_groups(pp_ranks, backend="nccl" if device.type == "cuda" else "gloo",
                                         timeout=device_timeout(timeout_s), ring=True)
        self.agreement_group = create_agreement_groups(agree_ranks, timeout=timeout)
        warm_up(self.groups, pp_ranks, device)
        payloads = NcclDevice(device, self.groups) if device.type == "cuda" else HostDevice(self.groups)

        def channel(on_record, on_error):
            return GlooHostChannel(rank=rank, groups=channel_groups, on_record=on_record, on_error=on_error,
                                   device=device)

        self.transport = RoundTransport(rank=rank, stage_of={r: i for i, r in enumerate(pp_ranks)},
                                        neighbours=list(self.groups), device=payloads, channel_factory=channel,
                                        on_message=self.inbox.put, on_error=self.inbox.fail, wake=self.inbox.wake,
                                        timeout_s=timeout_s)

    def close(self, timeout: float = 5.0, *, abort: bool = False) -> None:
        if abort and self.kind == "threads":  # a peer's receive for a message that will never come ends too
            self.transport.close(timeout, release_peers=True)
        else:
            self.transport.close(timeout)
        self.inbox.close()
        if abort and self.kind == "rounds" and self.device.type == "cuda":
            for problem in abort_pair_groups(self.groups):
                log.warning("megatron_rrfp: could not abort a NCCL %s", problem)

    def fits(self, key: tuple) -> bool:
        return self.key == key and dist.is_initialized() and dist.group.WORLD is self.world


def abort_pair_groups(groups: dict) -> list[str]:
    """Abort the NCCL communicators of the pair groups (after a failed iteration): a round
    whose peer died keeps its kernel spinning, and under CUDA_DEVICE_MAX_CONNECTIONS=1 it
    blocks every later kernel of this GPU until NCCL's watchdog kills the process; an
    aborted communicator ends it. Returns what could not be aborted (logged, not raised:
    the iteration's own error is what the caller must see)."""
    from torch.distributed import distributed_c10d

    failed = []
    for peer, group in groups.items():
        try:
            abort = getattr(distributed_c10d, "_abort_process_group", None)  # also forgets the group
            abort(group) if abort is not None else group.abort()
        except Exception as exc:  # noqa: BLE001 - best effort, see the docstring
            failed.append(f"pair group with rank {peer}: {type(exc).__name__}: {exc}")
    return failed


def _key(pp_ranks, agree_ranks, device, kind) -> tuple:
    return (tuple(pp_ranks), tuple(agree_ranks), str(device), kind)


def session(pp_ranks: list[int], agree_ranks: list[int], device: torch.device, timeout_s: float,
            transport: str = "auto", state: Optional[ScheduleState] = None) -> Session:
    """``state``'s session (the process's by default), made — or made again, when it no
    longer fits these ranks, device and transport — on every rank in the same call."""
    state = state or ScheduleState.get()
    key = _key(pp_ranks, agree_ranks, device, resolve_transport(transport, device))
    if state.session is not None and not state.session.fits(key):
        state.discard()  # process groups re-created or re-laid out: this one's groups are stale
    if state.session is None:
        state.session = Session(pp_ranks=pp_ranks, agree_ranks=agree_ranks, device=device, timeout_s=timeout_s,
                                transport=transport)
        _close_at_exit()
    return state.session


def _close_at_exit() -> None:
    """Close the session when the interpreter exits (Megatron-LM's scripts just return): the rounds
    transport's host channel keeps a gloo receive posted between steps, and a thread still blocked
    in one while the process exits aborts it ("terminate called without an active exception",
    exit -6, after a complete run). Closing sends each peer a BYE record, which ends its receive.
    Registered once however many sessions the process makes (``unregister`` drops an earlier one)."""
    atexit.unregister(shutdown)
    atexit.register(shutdown)


def discard(timeout: float = 0.5) -> None:
    """Close the process's session so the next call builds a new one (``ScheduleState.discard``)."""
    ScheduleState.get().discard(timeout)


def start(*, timeout_s: Optional[float] = None, transport: Optional[str] = None) -> Session:
    """Create every group and warm the transport up now (call on every rank right after
    ``initialize_model_parallel``, before the model takes its memory). Defaults come from
    the process-wide ``RRFPConfig`` (``mcore.config.configure``)."""
    from . import compat

    options = defaults()
    groups = compat.process_groups()
    device = compat.pipeline_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return session(dist.get_process_group_ranks(groups.pp), groups.agreement_ranks, device,
                   timeout_s if timeout_s is not None else options.timeout_s,
                   transport if transport is not None else options.transport)


def agreement_group():
    """This rank's TP-agreement group (None before the first call or without TP)."""
    state = ScheduleState.get()
    return None if state.session is None else state.session.agreement_group


def shutdown() -> None:
    """Stop transport threads (before destroying process groups, or at exit) and forget
    every calibration: the process's ``ScheduleState`` is thrown away whole."""
    ScheduleState.reset()


__all__ = ["Session", "TRANSPORTS", "abort_pair_groups", "agreement_group", "device_timeout", "discard",
           "resolve_transport", "session", "shutdown", "start"]
