"""Agreement: every rank of a stage that shares collectives with others runs the same task next.

The group: tensor x context parallel ranks, joined with expert-tensor x expert parallel
ranks under MoE (the token all-to-alls of one MoE layer span data-parallel replicas, i.e.
ranks of different pipelines; ``create_agreement_groups`` joins overlapping groups). Why
the exact task and not a cheaper rule across replicas: an all-to-all matches on layer order
only, so replicas need only agree on (kind, chunk) — not on the microbatch. But TP ranks
must run the same microbatch (same data, same shapes), the arbiter's state (in-flight
count, buffer limit, hint position) would then differ per replica and with it every later
choice, and a (kind, chunk) intersection still needs one exchange per decision: the cost
is the same, only some bubbles shorter, and the digest check would weaken. So the whole
group agrees on the task, exactly as TP ranks do; runtime/rounds.py gives the
deadlock-freedom argument for it on NCCL.

The paper proposes a microbatch, all-gathers the proposals and retries on disagreement —
progress then depends on retry luck. Here each decision is ONE small all-gather of the
ranks' ready sets (a byte per task), a digest of the arbiter state and the transport's
progress counters; every rank intersects the sets and feeds the *commonly ready* set to
the same deterministic arbiter, so all ranks derive the same task without a second round.
The digest verifies that the ranks really are in lock-step; a mismatch raises with every
rank's view.

Off the critical path: the all-gather runs on a helper thread. When the executor
dispatches a task it posts the exchange for the *next* decision at once, with the ready
set as it will be once this task is done (what the task itself enables is known before it
runs), so the collective runs while the task computes and the compute thread finds the
agreed set waiting when the task ends. It blocks only when the exchange is not back yet
(a TP peer is behind) or when the agreed set holds nothing dispatchable — then a fresh
exchange follows. Every rank runs the same sequence of exchanges because whether another
one follows is decided from the agreed (identical) result only.

When nothing common is dispatchable, a rank that lacks something a peer already has waits
for its own next arrival (it will come: the peers' producers ran the same tasks); a rank
that has everything anyone has re-enters at once and blocks in the collective until the
laggards catch up — no busy retry loop.

The agreement runs on dedicated gloo groups even on GPU clusters: it is host-side control
data, and a NCCL collective would force a device synchronisation per decision.
"""
from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Protocol

import torch
import torch.distributed as dist

from ..policy.actions import Task, all_tasks
from ..ranks import all_gather_single

_HEAD_WORDS = 3  # dispatched count, rolling hash of the dispatched sequence, post time (ns)


WAIT_SLICE_S = 0.5
"""The longest a wait on the compute thread stays inside one blocking call: an asynchronous exception
(NVRx's in-process restart raises one in the main thread) is delivered only between Python bytecodes."""


def wait_in_slices(cv: threading.Condition, predicate, timeout: Optional[float]) -> bool:
    """``cv.wait_for(predicate, timeout)`` (``cv`` held) in waits of at most ``WAIT_SLICE_S`` each."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not predicate():
        left = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, deadline - time.monotonic())
        if left <= 0:
            return False
        cv.wait(left)
    return True


class AgreementError(RuntimeError):
    """TP ranks diverged (a bug or a mismatched configuration): never silently continue."""


class Collective(Protocol):
    """The ranks that must agree (``index``: this rank's position in the group)."""

    size: int
    index: int

    def all_gather(self, mine: torch.Tensor) -> torch.Tensor:
        """``mine`` (1-D, same length everywhere) -> [size, len] of every rank's."""

    def broadcast(self, value: torch.Tensor) -> torch.Tensor:
        """Group rank 0's ``value`` on every rank; rank 0 returns at once, the others wait."""


class GlooCollective:
    """``Collective`` over a torch.distributed (gloo) group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.index = dist.get_rank(group)
        self._root = dist.get_global_rank(group, 0)
        self._sent: list = []  # (work, tensor) of broadcasts rank 0 started

    def all_gather(self, mine: torch.Tensor) -> torch.Tensor:
        flat = torch.empty(self.size * mine.numel(), dtype=mine.dtype)
        all_gather_single(flat, mine, group=self.group)
        return flat.view(self.size, mine.numel())

    def broadcast(self, value: torch.Tensor) -> torch.Tensor:
        if self.index == 0:
            self._sent = [(w, t) for w, t in self._sent if not w.is_completed()]
            self._sent.append((dist.broadcast(value, src=self._root, group=self.group, async_op=True), value))
            return value
        dist.broadcast(value, src=self._root, group=self.group)
        return value


def create_agreement_groups(my_group_ranks: Sequence[int], *,
                            timeout: datetime.timedelta) -> Optional[dist.ProcessGroup]:
    """Collective over the world: one gloo group per set of ranks that must agree. Ranks
    whose offered sets overlap belong to one group (a TP group and an expert-parallel group
    sharing a rank must dispatch one sequence: each collective orders both). Returns ours,
    or None when our group has a single rank (nothing to agree on)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [int(r) for r in my_group_ranks])
    mine = None
    for ranks in joined_groups(gathered):
        if len(ranks) < 2:
            continue
        group = dist.new_group(list(ranks), timeout=timeout, backend="gloo")
        if dist.get_rank() in ranks:
            mine = group
    return mine


def joined_groups(groups: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """The connected components of overlapping rank sets, each sorted, in a fixed order."""
    parent: dict[int, int] = {}

    def root(r: int) -> int:
        while parent.setdefault(r, r) != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for ranks in groups:
        for r in ranks:
            parent[root(r)] = root(ranks[0])
    components: dict[int, list[int]] = {}
    for r in parent:
        components.setdefault(root(r), []).append(r)
    return sorted(tuple(sorted(c)) for c in components.values())


@dataclass(slots=True)
class AgreementStats:
    decisions: int = 0
    rounds: int = 0  # exchanges
    blocking_rounds: int = 0  # of which run when the result was needed at once (not beside a task)
    followed: int = 0  # decisions taken without an exchange by following the one link still delivering
    announced: int = 0  # decisions group rank 0 announced after a bubble (counted where they were heard)
    blocked_s: float = 0.0  # the compute thread waiting for an agreed result (critical path)
    peer_wait_s: float = 0.0  # part of blocked_s before the last TP peer had posted (its skew)
    collective_s: float = 0.0  # inside the all-gather on the helper thread, incl. waiting for peers


@dataclass(frozen=True, slots=True)
class Agreed:
    """One exchange's outcome, identical on every rank of the group (except ``mine``)."""

    common: frozenset  # tasks ready on every rank
    union: frozenset  # tasks ready on some rank
    mine: frozenset  # what this rank offered
    state: tuple[int, ...]  # per transport counter: its minimum over the ranks
    state_max: tuple[int, ...]
    my_state: tuple[int, ...]
    last_post_s: float  # wall time (time.time()) at which the last rank posted its offer

    @property
    def lagging(self) -> bool:
        """This rank lacks something a peer has: its own next arrival is what to wait for."""
        return self.mine != self.union or self.my_state != self.state_max

    @property
    def unanimous(self) -> bool:
        return self.common == self.union and self.state == self.state_max


class TPAgreement:
    """Decide the next task jointly with the other ranks of ``group`` (one per iteration).

    ``post()`` starts an exchange on the helper thread and returns at once; ``collect()``
    returns its ``Agreed`` result (blocking only if it is not back yet); ``exchange()`` runs
    one on the calling thread; ``commit(task)`` records the task every rank derived from
    it. At most one exchange is outstanding; all of them form one sequence on the group.
    """

    def __init__(self, group, *, num_microbatches: int, num_chunks: int, split_backward: bool,
                 forward_only: bool, device: Optional[torch.device] = None) -> None:
        self.collective: Collective = group if hasattr(group, "all_gather") else GlooCollective(group)
        self.size = self.collective.size
        self.tasks = all_tasks(num_microbatches, num_chunks, split_backward=split_backward,
                               forward_only=forward_only)
        self.index = {task: i for i, task in enumerate(self.tasks)}
        self.stats = AgreementStats()
        self._digest = 0
        self._dispatched = 0
        self._cv = threading.Condition()
        self._request: Optional[tuple[torch.Tensor, frozenset, tuple]] = None
        self._result: Optional[object] = None  # Agreed, or the exception the exchange raised
        self._outstanding = False
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._device = device  # CUDA: the helper thread binds to it (no stray context on GPU 0)

    # -- the compute thread's API ------------------------------------------------------

    @property
    def outstanding(self) -> bool:
        return self._outstanding

    def post(self, ready: set[Task], state: Sequence[int] = ()) -> None:
        """Start the next exchange with this rank's ready set and progress counters
        (``state``: the same number of counters on every rank; the result holds their
        minimum and maximum over the ranks)."""
        if self._outstanding:
            raise RuntimeError("TPAgreement.post: the previous exchange was not collected")
        request = self._offer(ready, state)
        self._outstanding = True
        with self._cv:
            self._request, self._result = request, None
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, daemon=True, name="rrfp-tp-agreement")
                self._thread.start()
            self._cv.notify_all()

    def collect(self, timeout: Optional[float] = None) -> Agreed:
        """The posted exchange's result; raises AgreementError if the ranks diverged, or
        TimeoutError after ``timeout`` seconds (the exchange stays outstanding)."""
        start, wall = time.perf_counter(), time.time()
        with self._cv:
            done = wait_in_slices(self._cv, lambda: self._result is not None, timeout)
            result = self._result
        blocked = time.perf_counter() - start
        self.stats.blocked_s += blocked
        if not done:
            raise TimeoutError(f"no agreement within {timeout}s")
        self._outstanding = False
        self._result = None
        if isinstance(result, BaseException):
            raise result
        self.stats.peer_wait_s += min(blocked, max(0.0, result.last_post_s - wall))  # type: ignore[union-attr]
        return result  # type: ignore[return-value]

    def exchange(self, ready: set[Task], state: Sequence[int] = ()) -> Agreed:
        """One blocking exchange, run on the calling thread: when the result is needed at
        once, the hand-offs to and from the helper thread would only add latency."""
        if self._outstanding:
            raise RuntimeError("TPAgreement.exchange: the previous exchange was not collected")
        start, wall = time.perf_counter(), time.time()
        self.stats.blocking_rounds += 1
        result = self._agree(*self._offer(ready, state))
        blocked = time.perf_counter() - start
        self.stats.blocked_s += blocked
        self.stats.peer_wait_s += min(blocked, max(0.0, result.last_post_s - wall))
        return result

    def _offer(self, ready: set[Task], state: Sequence[int]) -> tuple[torch.Tensor, frozenset, tuple]:
        state = tuple(int(s) for s in state)  # same length on every rank (derived from the layout)
        n = len(self.tasks)
        mine = torch.zeros(n + (_HEAD_WORDS + len(state)) * 8, dtype=torch.uint8)
        for task in ready:
            mine[self.index[task]] = 1
        words = torch.tensor([self._dispatched, self._digest, time.time_ns(), *state], dtype=torch.int64)
        mine[n:] = words.view(torch.uint8)
        return mine, frozenset(ready), state

    @property
    def leads(self) -> bool:
        """Group rank 0: decides after a bubble without hearing from the others (``announce``)."""
        return self.collective.index == 0

    def announce(self, task: Task, partner: Optional[Task] = None) -> None:
        """Group rank 0: tell the others the next task and the one it runs with, if any (returns at once)."""
        self.collective.broadcast(self._decision(self.index[task], -1 if partner is None else self.index[partner]))

    def listen(self) -> tuple[Task, Optional[Task]]:
        """The others: the task group rank 0 announced and its partner (None: alone); blocks until it did."""
        start, wall = time.perf_counter(), time.time()
        got = self.collective.broadcast(self._decision(-1, -1)).tolist()
        blocked = time.perf_counter() - start
        self.stats.blocked_s += blocked
        self.stats.peer_wait_s += min(blocked, max(0.0, got[4] / 1e9 - wall))
        self.stats.announced += 1
        if got[2:4] != [self._dispatched, self._digest]:
            raise AgreementError(f"tensor-parallel ranks are out of lock-step: group rank 0 announced after "
                                 f"dispatched={got[2]} digest={got[3]}, this rank has dispatched={self._dispatched} "
                                 f"digest={self._digest}")
        return self.tasks[got[0]], None if got[1] < 0 else self.tasks[got[1]]

    def _decision(self, index: int, partner: int) -> torch.Tensor:
        return torch.tensor([index, partner, self._dispatched, self._digest, time.time_ns()], dtype=torch.int64)

    def commit(self, task: Task) -> None:
        self.stats.decisions += 1
        self._dispatched += 1
        self._digest = (self._digest * 1_000_003 + self.index[task] + 1) % (1 << 61)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    # -- the helper thread ---------------------------------------------------------------

    def _serve(self) -> None:
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._request is not None or self._closed)
                if self._request is None:
                    return
                request, self._request = self._request, None
            try:
                result: object = self._agree(*request)
            except BaseException as exc:  # noqa: BLE001 - handed to the compute thread
                result = exc
            with self._cv:
                self._result = result
                self._cv.notify_all()
            if isinstance(result, BaseException):
                return

    def _agree(self, mine: torch.Tensor, offered: frozenset, my_state: tuple) -> Agreed:
        start = time.perf_counter()
        out = self.collective.all_gather(mine)
        self.stats.collective_s += time.perf_counter() - start
        self.stats.rounds += 1
        n = len(self.tasks)
        words = out[:, n:].contiguous().view(torch.int64).view(self.size, _HEAD_WORDS + len(my_state))
        digests = words[:, :2]
        if not bool((digests == digests[0]).all()):
            views = "\n".join(
                f"  group rank {r}: dispatched={int(digests[r, 0])} digest={int(digests[r, 1])} "
                f"ready={[str(self.tasks[i]) for i in out[r, :n].nonzero().flatten().tolist()]}"
                for r in range(self.size))
            raise AgreementError(f"tensor-parallel ranks are out of lock-step:\n{views}")
        flags = out[:, :n]
        common = flags.min(dim=0).values.nonzero().flatten().tolist()
        union = flags.max(dim=0).values.nonzero().flatten().tolist()
        state = words[:, _HEAD_WORDS:]
        return Agreed(common=frozenset(self.tasks[i] for i in common),
                      union=frozenset(self.tasks[i] for i in union), mine=offered,
                      state=tuple(state.min(dim=0).values.tolist()) if my_state else (),
                      state_max=tuple(state.max(dim=0).values.tolist()) if my_state else (),
                      my_state=my_state, last_post_s=int(words[:, 2].max()) / 1e9)


__all__ = ["Agreed", "AgreementError", "Collective", "GlooCollective", "TPAgreement", "create_agreement_groups",
           "joined_groups"]
