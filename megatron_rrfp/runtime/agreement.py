"""Tensor-parallel agreement: every rank of a TP (x CP) group runs the same task next.

The paper proposes a microbatch, all-gathers the proposals and retries on disagreement —
progress then depends on retry luck. Here each decision is ONE small all-gather of the
ranks' ready sets (a byte per task) plus a digest of the arbiter state; every rank
intersects the sets and feeds the *commonly ready* set to the same deterministic arbiter,
so all ranks derive the same task without a second round. The digest verifies that the
ranks really are in lock-step; a mismatch raises with every rank's view.

When nothing common is dispatchable, a rank that lacks a task some peer already has waits
for its own next arrival (it will come: the peers' producers ran the same tasks); a rank
that has everything anyone has re-enters at once and blocks in the collective until the
laggards catch up — no busy retry loop.

The agreement runs on dedicated gloo groups even on GPU clusters: it is host-side control
data, and a NCCL collective would force a device synchronisation per decision.
"""
from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..policy.actions import Task, all_tasks

_DIGEST_WORDS = 2  # dispatched count, rolling hash of the dispatched sequence


class AgreementError(RuntimeError):
    """TP ranks diverged (a bug or a mismatched configuration): never silently continue."""


def create_agreement_groups(my_group_ranks: Sequence[int], *,
                            timeout: datetime.timedelta) -> Optional[dist.ProcessGroup]:
    """Collective over the world: one gloo group per distinct TP(xCP) group. Returns ours,
    or None when our group has a single rank (nothing to agree on)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [int(r) for r in my_group_ranks])
    mine = None
    for ranks in sorted({tuple(sorted(g)) for g in gathered}):
        if len(ranks) < 2:
            continue
        group = dist.new_group(list(ranks), timeout=timeout, backend="gloo")
        if dist.get_rank() in ranks:
            mine = group
    return mine


@dataclass(slots=True)
class AgreementStats:
    decisions: int = 0
    rounds: int = 0
    seconds: float = 0.0  # inside the collective, incl. waiting for slower peers


class TPAgreement:
    """Decide the next task jointly with the other ranks of ``group``."""

    def __init__(self, group: dist.ProcessGroup, *, num_microbatches: int, num_chunks: int,
                 split_backward: bool, forward_only: bool) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.tasks = all_tasks(num_microbatches, num_chunks, split_backward=split_backward,
                               forward_only=forward_only)
        self.index = {task: i for i, task in enumerate(self.tasks)}
        self.stats = AgreementStats()
        self._digest = 0

    def exchange(self, ready: set[Task], dispatched: int) -> tuple[set[Task], set[Task]]:
        """One collective: returns (commonly ready, ready on some rank)."""
        n = len(self.tasks)
        mine = torch.zeros(n + _DIGEST_WORDS * 8, dtype=torch.uint8)
        for task in ready:
            mine[self.index[task]] = 1
        digest = torch.tensor([dispatched, self._digest], dtype=torch.int64)
        mine[n:] = digest.view(torch.uint8)
        flat = torch.empty(self.size * mine.numel(), dtype=torch.uint8)
        start = time.perf_counter()
        dist.all_gather_into_tensor(flat, mine, group=self.group)
        out = flat.view(self.size, mine.numel())
        self.stats.seconds += time.perf_counter() - start
        self.stats.rounds += 1
        digests = out[:, n:].contiguous().view(torch.int64).view(self.size, _DIGEST_WORDS)
        if not bool((digests == digests[0]).all()):
            views = "\n".join(
                f"  group rank {r}: dispatched={int(digests[r, 0])} digest={int(digests[r, 1])} "
                f"ready={[str(self.tasks[i]) for i in out[r, :n].nonzero().flatten().tolist()]}"
                for r in range(self.size))
            raise AgreementError(f"tensor-parallel ranks are out of lock-step:\n{views}")
        flags = out[:, :n]
        common = flags.min(dim=0).values.nonzero().flatten().tolist()
        union = flags.max(dim=0).values.nonzero().flatten().tolist()
        return {self.tasks[i] for i in common}, {self.tasks[i] for i in union}

    def decide(self, ready_snapshot: Callable[[], set[Task]], choose: Callable[[set[Task]], Optional[Task]],
               dispatched: Callable[[], int], wait_for_change: Callable[[set[Task]], None]) -> Task:
        """Loop until the group agrees on a task; returns it on every rank."""
        while True:
            local = ready_snapshot()
            common, union = self.exchange(local, dispatched())
            task = choose(common)
            if task is not None:
                self.stats.decisions += 1
                self._digest = (self._digest * 1_000_003 + self.index[task] + 1) % (1 << 61)
                return task
            if local != union or common == union:
                wait_for_change(local)  # something is on its way to us (or to everyone)
            # else: we hold everything anyone holds; block in the next collective instead


__all__ = ["AgreementError", "TPAgreement", "create_agreement_groups"]
