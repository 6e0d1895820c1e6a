"""``1x`` in bytes: each stage's byte weights, measured, and the budgets the arbiter keeps.

The default buffer limit ``1x`` bounds forwards in flight by Megatron's fullest stage; under
the B/W split that alone can exceed Megatron's bytes (a later stage's units are larger; a
split B's stash grows while its saved tensors live: docs/memory.md). So for ``1x`` the
arbiter also keeps a byte level within a budget (policy/membytes.py), per (model, layout,
hint, M), kept in the process's ``ScheduleState`` (mcore/state.py):

1. the first training call runs with ``membytes.first_call_budgets`` — units, each stage at
   most its own Megatron count, a B split only with a unit of headroom — so it holds no more
   than Megatron's schedule does, and its executor measures what the tasks weigh
   (``runtime.memory.TaskBytes``: bytes a forward holds and its peak, a split B's peak; the
   store's largest per-key stash);
2. the next training call agrees on them — the maximum over the tensor-parallel (agreement)
   group, so every rank of it runs the same arbiter; then every stage's over the pipeline —
   and runs every later call with ``membytes.calibrated_budgets``: Megatron 1F1B's peak bytes
   (its count times its bytes per forward, max over stages) on every stage.

Every rank of a pipeline calls the schedule the same number of times, so the collectives of
step 2 happen in the same call everywhere. Forward-only and strict calls are left alone
(evaluation holds nothing for backward; a strict order's memory is its own).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..policy.arbiter import ArbiterConfig
from ..policy.membytes import ByteBudget, StageBytes, calibrated_budgets, first_call_budgets, megatron_peak_bytes
from ..policy.topology import Topology
from ..ranks import print_line
from .state import ScheduleState


@dataclass(slots=True)
class _State:
    measured: Optional[StageBytes] = None  # this stage's, from the first call
    budgets: Optional[tuple[ByteBudget, ...]] = None  # every stage's, once agreed


@dataclass(slots=True)
class CallBytes:
    """The policy one schedule call runs with; ``record`` the call's measurement after it."""

    arbiter: ArbiterConfig
    state: Optional[_State] = dataclasses.field(default=None, repr=False)

    @property
    def calibrating(self) -> bool:
        """This call measures what its tasks weigh (the first call, step 1 of the module docstring)."""
        return self.state is not None and self.state.measured is None

    def record(self, report, wgrad_store) -> None:
        if not self.calibrating or report.task_bytes is None:
            return
        tasks = report.task_bytes
        forward = float(tasks["forward"])
        forward_peak = float(max(tasks["forward_peak"], tasks["forward"]))
        split = wgrad_store is not None and tasks["split_backwards"]
        pending = float(wgrad_store.peak_key_bytes) if split else None
        if pending is None:  # no B of this call split: assume a stash as large as what a forward holds
            pending, split_peak = forward, forward_peak + forward
        else:  # the CUDA allocator has no per-task peak: a split B adds at most its stash
            split_peak = float(tasks["split_peak"]) if tasks["split_peak"] is not None else pending
        self.state.measured = StageBytes(forward, forward_peak, pending, split_peak)


def applies(arbiter: ArbiterConfig, *, forward_only: bool) -> bool:
    """The byte budget is ``1x``'s (the default); other limits keep their own meaning."""
    spec = arbiter.buffer_limit
    return (not forward_only and not arbiter.strict and isinstance(spec, str)
            and spec.strip().lower() == "1x")


def call_bytes(arbiter: ArbiterConfig, state: ScheduleState, *, models: list, topology: Topology,
               num_microbatches: int, stage: int, forward_only: bool, device: torch.device, pp_group,
               agreement_group) -> CallBytes:
    """This call's ``ArbiterConfig`` with its ``memory_bytes`` (module docstring); the
    calibration is kept in ``state`` under what it depends on."""
    if not applies(arbiter, forward_only=forward_only):
        return CallBytes(arbiter)
    key = (tuple(map(id, models)), arbiter, topology, num_microbatches)
    calibration = state.byte_budgets.setdefault(key, _State())
    if calibration.measured is None:
        return CallBytes(dataclasses.replace(arbiter, memory_bytes=first_call_budgets(topology, num_microbatches)),
                         calibration)
    if calibration.budgets is None:
        calibration.budgets = _agree(calibration.measured, topology=topology, num_microbatches=num_microbatches,
                                     stage=stage, device=device, pp_group=pp_group, agreement_group=agreement_group)
    return CallBytes(dataclasses.replace(arbiter, memory_bytes=calibration.budgets))


def _agree(mine: StageBytes, *, topology: Topology, num_microbatches: int, stage: int, device: torch.device,
           pp_group, agreement_group) -> tuple[ByteBudget, ...]:
    values = torch.tensor([mine.forward, mine.forward_peak, mine.pending, mine.split_peak], dtype=torch.float64)
    if agreement_group is not None:  # gloo: the ranks that must run identical arbiters take the largest
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=agreement_group)
    everyone = [torch.zeros(4, dtype=torch.float64, device=device) for _ in range(topology.num_stages)]
    dist.all_gather(everyone, values.to(device), group=pp_group)
    stages = [StageBytes(*(float(v) for v in t.tolist())) for t in everyone]
    budgets = calibrated_budgets(stages, topology, num_microbatches)
    if dist.get_rank() == 0:
        print_line(f"megatron-rrfp: buffer limit 1x in bytes (PP={topology.num_stages}, M={num_microbatches}): "
                   f"Megatron 1F1B's peak {megatron_peak_bytes(stages, topology, num_microbatches) / 2**20:.3f} MiB "
                   f"(max over stages) on every stage; per stage MiB per forward / per pending W / split-B peak: "
                   + ", ".join(f"{s.forward / 2**20:.3f}/{s.pending / 2**20:.3f}/{s.split_peak / 2**20:.3f}"
                               for s in stages))
    return budgets


__all__ = ["CallBytes", "applies", "call_bytes"]
