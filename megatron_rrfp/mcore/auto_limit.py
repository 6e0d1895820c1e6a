"""``--rrfp-buffer-limit auto``: the largest limit that fits the memory free on each stage.

An integer or a multiple (``1x``) needs no measurement: the arbiter resolves it for its
layout (policy/budget.py). ``auto`` runs in two steps per (model, layout, hint, M), kept in
the process's ``ScheduleState`` (mcore/state.py):

1. calibration: the first training call runs at ``1x`` — Megatron's own memory, which the
   user's configuration is sized for — and measures this stage's peak activation bytes
   and peak forwards in flight (runtime/memory.py): bytes per forward = peak / in-flight;
2. the next training call reads the stage's budget — what its device has free now, the
   optimizer state allocated by the first step included (CUDA: free device memory plus
   what torch's caching allocator holds unused; CPU: available RAM shared by the ranks of
   this host), capped by ``RRFPConfig.activation_budget_bytes`` when given — and takes the
   largest limit that fits ``AUTO_MARGIN`` of it, at least 1x, at most M x C
   (``budget.fit_to_budget``). The ranks of a tensor-parallel group (which must run
   identical orders) agree on their minimum; every stage learns the others' limits and
   global rank 0 prints them once.

Every rank of a pipeline calls the schedule the same number of times, so the collectives
of step 2 happen in the same call everywhere. Forward-only calls (evaluation) and strict
runs (a fixed order: the limit does not apply) neither calibrate nor resolve.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
import torch.distributed as dist

from ..policy.arbiter import ArbiterConfig
from ..policy.budget import AUTO_MARGIN, fit_to_budget, is_auto, megatron_peak_in_flight, starting_limit
from ..policy.topology import Topology
from ..ranks import print_line
from .config import RRFPConfig
from .state import ScheduleState


@dataclass(slots=True)
class _Auto:
    bytes_per_forward: Optional[float] = None  # measured at 1x (calibration)
    limits: Optional[list[int]] = None  # per stage, once resolved
    budget_bytes: float = 0.0  # this stage's


@dataclass(slots=True)
class CallLimit:
    """The policy one schedule call runs with; ``record`` the call's measurement after it."""

    arbiter: ArbiterConfig
    calibrating: bool = False
    state: Optional[_Auto] = field(default=None, repr=False)

    def record(self, peak_activation_bytes: int, peak_in_flight: int) -> None:
        if self.calibrating and self.state is not None and peak_in_flight > 0:
            self.state.bytes_per_forward = peak_activation_bytes / peak_in_flight


def call_limit(options: RRFPConfig, state: ScheduleState, *, models: list, topology: Topology,
               num_microbatches: int, stage: int, forward_only: bool, device: torch.device, pp_group,
               agreement_group) -> CallLimit:
    """This call's ``ArbiterConfig``: ``options.arbiter`` itself unless its limit is ``auto``,
    which becomes ``1x`` (calibration, or where the limit does not apply) or the measured int.
    The calibration is kept in ``state`` under what it depends on (module docstring)."""
    policy = options.arbiter
    if not is_auto(policy.buffer_limit):
        return CallLimit(policy)
    at_one_x = replace(policy, buffer_limit=starting_limit(policy.buffer_limit))
    if forward_only or policy.strict:
        return CallLimit(at_one_x)
    key = (tuple(map(id, models)), policy.parsed_hint, options.activation_budget_bytes, topology, num_microbatches)
    auto = state.auto_limits.setdefault(key, _Auto())
    if auto.bytes_per_forward is None:
        return CallLimit(at_one_x, calibrating=True, state=auto)
    if auto.limits is None:
        _resolve(auto, options, topology=topology, num_microbatches=num_microbatches, stage=stage,
                 device=device, pp_group=pp_group, agreement_group=agreement_group, process=state)
    return CallLimit(replace(policy, buffer_limit=auto.limits[stage]))


def _resolve(state: _Auto, options: RRFPConfig, *, topology: Topology, num_microbatches: int, stage: int,
             device: torch.device, pp_group, agreement_group, process: ScheduleState) -> None:
    budget = free_memory_bytes(device, process)
    if options.activation_budget_bytes is not None:
        budget = min(budget, options.activation_budget_bytes)
    state.budget_bytes = budget
    one_x = megatron_peak_in_flight(topology, num_microbatches)
    limit = fit_to_budget(one_x, num_microbatches * topology.num_chunks,
                          bytes_per_forward=state.bytes_per_forward, budget_bytes=budget)
    mine = torch.tensor([limit], dtype=torch.int64)
    if agreement_group is not None:  # gloo: TP ranks must run identical arbiters
        dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=agreement_group)
    everyone = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(topology.num_stages)]
    dist.all_gather(everyone, mine.to(device), group=pp_group)
    state.limits = [int(t.item()) for t in everyone]
    if dist.get_rank() == 0:
        print_line(f"megatron-rrfp: buffer limit auto ({options.arbiter.parsed_hint.name}, PP={topology.num_stages}"
                   + (f", chunks={topology.num_chunks}" if topology.interleaved else "") + f", M={num_microbatches}): "
                   f"per stage {state.limits} (1x = {one_x} forwards in flight); stage {stage} measured "
                   f"{state.bytes_per_forward / 2**20:.2f} MiB per forward at 1x, budget {budget / 2**20:.0f} MiB "
                   f"x {AUTO_MARGIN:g}")


def free_memory_bytes(device: torch.device, state: Optional[ScheduleState] = None) -> float:
    """What this rank may fill: CUDA — free device memory plus what torch's caching
    allocator reserved but does not use; CPU — available RAM / ranks on this host (a
    collective over the world the first time, its answer kept in ``state``)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    state = state or ScheduleState.get()
    if state.ranks_on_host is None:  # every rank asks in the same call
        hosts: list = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, socket.gethostname())
        state.ranks_on_host = max(1, hosts.count(socket.gethostname()))
    return _available_ram() / state.ranks_on_host


def _available_ram() -> float:
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


__all__ = ["CallLimit", "call_limit", "free_memory_bytes"]
