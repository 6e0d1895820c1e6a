"""Ready-set arbitration: (ready set, stage state) -> next task, or wait.

Pure Python, no torch: the simulator and the distributed executor both drive this class,
so what the simulator predicts is what the executor does. Given the same sequence of
ready sets, every instance makes the same choices — tensor-parallel ranks rely on that.

Memory bound: ``in_flight`` (forwards run minus backwards run, minus W when the backward is
split) stays within the buffer limit, an int or a multiple of Megatron's own peak ("1x",
"1.5x": budget.py). B and W are always allowed; a forward only while the stage can still
finish its oldest microbatches in order (a banker's safe state), which keeps memory within
max(limit, chunks) and makes deadlock impossible for any limit >= 1 (the argument:
docs/design/deadlock-freedom.md). With ``memory_bytes`` (``membytes.py``) a forward must also
fit the stage's byte budget, and a B whose split would not fit runs unsplit.

Strict mode runs the hint's order exactly (the fixed-order baseline inside the same
runtime); its memory is the order's own, so the buffer limit does not apply.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Optional

from .actions import Kind, Task, all_tasks, format_order, peak_in_flight
from .budget import LimitSpec, check_limit_spec, megatron_peak_in_flight, resolve_buffer_limit, starting_limit
from .hint_specs import make_hint
from .hints import Hint, Memory, OrderedHint, _forward_key, validate_order
from .membytes import UNIT, ByteBudget, megatron_counts
from .topology import Topology

DEFAULT_HINT = "default"
"""Reads the layout, the buffer limit and whether the backward can split (hints.DefaultHint)."""
DEFAULT_BUFFER_LIMIT = "1x"
"""Megatron's own activation memory for the layout (budget.py)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ArbiterConfig:
    """How one stage arbitrates. The hint is parsed here, once: a bad name or file fails
    when the config is built, and every arbiter built from it shares the parsed hint."""

    hint: str | Hint = DEFAULT_HINT
    """default | bf | bfw | 1f1b | zbh1 | gpipe | path of a JSON / CSV hint file | a Hint
    object; a Hint after init."""
    buffer_limit: LimitSpec = DEFAULT_BUFFER_LIMIT
    """Max (microbatch, chunk) forwards in flight on a stage: an int >= 1, or a multiple of
    Megatron's own peak for the layout ("1x", "1.5x"; budget.py). "auto" is resolved to an
    int by the runtime, which measures memory, before it builds a plan."""
    strict: bool = False
    """True: wait for the next listed task (fixed order). False: readiness-first."""
    split_backward_ok: bool = True
    """The model can defer its weight gradients (W tasks): the ``default`` hint uses a split
    backward only then. The Megatron adapter sets it from the model (mcore/schedule.py)."""
    memory_bytes: Optional[tuple[ByteBudget, ...]] = None
    """Per stage, byte weights and budgets (membytes.py): admission and the split of each B
    then also keep the stage's modelled bytes within its budget. None: forwards in flight only.
    The runtime sets it for ``1x`` (mcore/byte_limit.py); the simulator takes it as given."""
    pair_forward_backward: bool = False
    """Dispatch a ready F and a ready B of this stage together as one combined task (megatron-core's
    combined forward-backward step: each one's MoE all-to-alls overlap the other's compute). When the
    hint picks a backward, its partner is the best ready forward the memory rule admits beside it
    (``Arbiter.take_partner``); a forward picked first runs alone (pairing it delayed the pipeline's
    backward chain in simulation: docs/moe.md). Never in strict mode. With a split backward a
    pair keeps the split where a forward is admitted without the backward's release, else its
    backward runs whole (the release admits the forward); a backward alone splits as usual."""

    def __post_init__(self) -> None:
        try:
            check_limit_spec(self.buffer_limit)
        except ValueError as exc:
            raise ValueError(f"buffer_limit (--rrfp-buffer-limit): {exc}") from None
        object.__setattr__(self, "hint", make_hint(self.hint))

    @property
    def parsed_hint(self) -> Hint:
        return self.hint  # type: ignore[return-value]  # always a Hint after __post_init__


def memory_of(buffer_limit: int, topology: Topology, num_microbatches: int) -> Optional[Memory]:
    """What ``default`` reads of the memory (default.DEFAULT_RULES); None for a layout
    Megatron's schedule refuses (no 1x to compare with)."""
    try:
        peak = megatron_peak_in_flight(topology, num_microbatches)
    except ValueError:
        return None
    return Memory(buffer_limit, peak, num_microbatches * topology.num_chunks)


def config_memory(config: ArbiterConfig, topology: Topology, num_microbatches: int) -> Optional[Memory]:
    """``memory_of`` a config's limit; ``auto`` reads as 1x, where every run starts (the
    runtime replaces it by the measured int before it builds the call's plan)."""
    limit = resolve_buffer_limit(starting_limit(config.buffer_limit), topology, num_microbatches)
    return memory_of(limit, topology, num_microbatches)


class Arbiter:
    """Per-stage policy state. Call ``choose(ready)`` then ``record(task)`` on dispatch.

    ``order`` is this stage's full task order, needed by ordered hints and strict mode;
    ``plan.Plan`` builds and validates it (for a strict rule hint it is materialised by a
    dry run). Ordered hints compute it themselves when it is not given.
    """

    def __init__(self, config: ArbiterConfig, *, stage: int, topology: Topology,
                 num_microbatches: int, forward_only: bool = False,
                 order: Optional[list[Task]] = None) -> None:
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        if not 0 <= stage < topology.num_stages:
            raise ValueError(f"stage {stage} outside pipeline of {topology.num_stages} stages")
        self.config = config
        self.buffer_limit = resolve_buffer_limit(config.buffer_limit, topology, num_microbatches)
        self.hint = config.parsed_hint.for_layout(topology, split_backward=config.split_backward_ok,
                                                  memory=memory_of(self.buffer_limit, topology, num_microbatches))
        if self.hint.waits_for_forward and not self._stages_above_hold(
                config.memory_bytes, stage, topology, num_microbatches):
            # the wait is deadlock-free only while every stage above can hold the next one's Megatron
            # count (OrderedHint); byte budgets measured tighter than that get the plain readiness-first order
            self.hint = OrderedHint(self.hint.name, lookahead=self.hint.lookahead)
        self.stage = stage
        self.topology = topology
        self.num_microbatches = num_microbatches
        self.forward_only = forward_only
        self.split_backward = self.hint.split_backward and not forward_only
        self.tasks = all_tasks(num_microbatches, topology.num_chunks,
                               split_backward=self.split_backward, forward_only=forward_only)
        self.prefer = Kind.B  # BF rounds start with the backward slot
        # a microbatch must be able to hold all its chunks at once (see the module docstring)
        self._admission_limit = max(self.buffer_limit, topology.num_chunks)
        self._forwards_run = [0] * num_microbatches  # per microbatch, chunks forwarded here
        self.forwards_left = num_microbatches * topology.num_chunks  # on this stage, not yet dispatched
        self._released = [0] * num_microbatches  # per microbatch, chunks whose memory is freed
        self._oldest = 0  # lowest microbatch not finished on this stage
        self._frontier_at, self._frontier = -1, -1  # admission_frontier, cached per dispatch count
        self.in_flight = 0
        self.peak_in_flight = 0
        self.dispatched: list[Task] = []
        self.dispatched_set: set[Task] = set()
        self._order: Optional[list[Task]] = None
        self._order_pos = 0
        self._position: dict[Task, int] = {}
        if config.strict or isinstance(self.hint, OrderedHint):
            self._order = self._checked_order(order)
            self._position = {task: i for i, task in enumerate(self._order)}
        self.lookahead = self._scaled_lookahead()
        self._bytes = self._stage_bytes(config.memory_bytes)
        self.level = 0.0  # modelled bytes held (membytes.py); in units without memory_bytes
        self.peak_level = 0.0
        self._held_bytes = [0.0] * num_microbatches
        self._inline: set[tuple[int, int]] = set()  # B that ran unsplit: their W release nothing
        self.pairs: list[tuple[Task, Task]] = []  # (F, B) dispatched together, in dispatch order
        self._pairs_on = config.pair_forward_backward and not config.strict and not forward_only
        self._partner: Optional[tuple[Task, Task]] = None  # (task choose() returned, its partner)
        self._ready_seen: set[Task] = set()  # the ready set choose() was last given (a partner comes from it)

    # -- policy ----------------------------------------------------------------------

    def choose(self, ready: Iterable[Task]) -> Optional[Task]:
        """The task to dispatch now, or None to wait for the next readiness event."""
        ready = set(ready)
        self._partner = None
        if self.config.strict:
            nxt = self.next_in_order()
            return nxt if nxt is not None and nxt in ready else None
        if not ready:
            return None
        allowed = self._allowed(ready)
        self._ready_seen = ready
        task = self.hint.pick(allowed, self)
        if task is not None and self._pairs_on and task.kind is Kind.B:  # a forward picked first runs alone
            partner = self._partner_of(task)
            if partner is not None:
                self._partner = (task, partner)
        return task

    def take_partner(self, task: Optional[Task]) -> Optional[Task]:
        """The task to run together with ``task``, the one ``choose`` just returned (None: run it
        alone). Every rank that fed ``choose`` the same ready set gets the same answer; a driver
        that dispatches a task ``choose`` did not return here passes it and gets None."""
        chosen, self._partner = self._partner, None
        return chosen[1] if chosen is not None and chosen[0] == task else None

    def pair_with(self, task: Task, partner: Optional[Task]) -> None:
        """The driver learned that ``task`` runs with ``partner`` (None: alone) from whoever chose
        it (an agreement's group rank 0, from this same state): ``take_partner(task)`` returns it."""
        self._partner = None if partner is None else (task, partner)

    def runs_alone_unpaired(self, task: Task) -> bool:
        """``task``, which ``choose`` just returned, is a backward it found no forward to pair with
        while forwards remain: a ready set with later arrivals might pair it."""
        return self._pairs_on and task.kind is Kind.B and self._partner is None and self.forwards_left > 0

    def record_pair(self, first: Task, partner: Task) -> None:
        """The driver dispatched ``first`` and ``partner`` together: recorded as the backward,
        then the forward (admitted on the state the backward left: split, its stash; whole, its release)."""
        forward, backward = (first, partner) if first.kind is Kind.F else (partner, first)
        if self.split_backward and forward.microbatch > self._frontier_beside_split(backward):
            self._inline.add((backward.microbatch, backward.chunk))  # its release admitted the forward: whole
        self.record(backward)
        self.record(forward)
        self.pairs.append((forward, backward))

    def _partner_of(self, backward: Task) -> Optional[Task]:
        """The forward to run beside ``backward``: an ordered hint's next ready one within its window
        (none outside it: a pair never pulls work from further ahead), a rule hint's BF ranking
        otherwise. It is admitted by the memory rule on the state after the backward's release, as if
        the backward ran first: the pair's layers free the backward's activations while the forward's
        build up (megatron-core's combined step), so inside the pair at most one forward more than the
        limit is held, as in Megatron's combined 1F1B. With a split backward a forward admitted
        beside the split (no release) comes first: the pair then defers its W like a lone B."""
        forwards = {t for t in self._ready_seen if t.kind is Kind.F}
        beside = self._frontier_beside_split(backward)
        candidates = {t for t in forwards if t.microbatch <= beside}
        if not candidates:
            frontier = self._frontier_after_backward(backward)
            candidates = {t for t in forwards if t.microbatch <= frontier}
        if not candidates:
            return None
        if self._order is not None:
            window = self.lookahead
            for seen, listed in enumerate(t for t in self.remaining_order() if t != backward):
                if window is not None and seen >= window:
                    return None
                if listed in candidates:
                    return listed
            return None
        group = self.topology.num_stages
        return min(candidates, key=lambda t: _forward_key(t, group))

    def record(self, task: Task) -> None:
        """The driver dispatched ``task``: update counters and hint position."""
        if task in self.dispatched_set:
            raise RuntimeError(f"stage {self.stage}: task {task} dispatched twice; dispatched so far: "
                               f"{format_order(self.dispatched)}")
        self.dispatched_set.add(task)
        self.dispatched.append(task)
        mb = task.microbatch
        weights = self._bytes.stage if self._bytes is not None else UNIT  # without bytes: the level in units
        if task.kind is Kind.F:
            self.prefer = Kind.B
            self._forwards_run[mb] += 1
            self.forwards_left -= 1
            if self.forward_only:
                self._advance_oldest()
            else:
                self.in_flight += 1
                self._add_bytes(mb, weights.forward)
        elif task.kind is Kind.B:
            self.prefer = Kind.F
            if self.split_backward and (mb, task.chunk) not in self._inline and self._split_fits():
                self._add_bytes(mb, weights.pending - weights.forward)
            else:  # unsplit: frees what its forward held (split: W would, but its split does not fit)
                if self.split_backward:
                    self._inline.add((mb, task.chunk))
                self._add_bytes(mb, -weights.forward)
                self._release(mb)
        elif (mb, task.chunk) not in self._inline:  # W releases the activations a split backward kept
            self._add_bytes(mb, -weights.pending)
            self._release(mb)
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        if self._order is not None:
            while self._order_pos < len(self._order) and self._order[self._order_pos] in self.dispatched_set:
                self._order_pos += 1

    def defers_weight(self, task: Task) -> bool:
        """Whether the recorded B ``task`` defers its weight gradients to its W (False: the
        byte budget had no room for its stash, so it runs unsplit and its W is a no-op)."""
        return self.split_backward and (task.microbatch, task.chunk) not in self._inline

    @property
    def byte_budget(self) -> float:
        """This stage's byte budget for forwards (0.0: none, forwards in flight only)."""
        return 0.0 if self._bytes is None else self._bytes.admit

    @property
    def stage_bytes(self) -> Optional[ByteBudget]:
        """This stage's byte weights and budgets (None: forwards in flight only)."""
        return self._bytes

    @property
    def unsplit_backwards(self) -> int:
        """B run unsplit: their stash did not fit the byte budget, or a pair's forward needed their release."""
        return len(self._inline)

    @property
    def done(self) -> bool:
        return len(self.dispatched) == len(self.tasks)

    @property
    def at_limit(self) -> bool:
        return not self.forward_only and self.in_flight >= self.buffer_limit

    def memory_blocked(self, ready: Iterable[Task]) -> bool:
        """A ready forward is refused by the memory rule now: waiting is backpressure, not
        a bubble (the rule can refuse a forward below the limit too)."""
        if self.forward_only:
            return False
        frontier = self.admission_frontier()
        return any(t.kind is Kind.F and t.microbatch > frontier for t in ready)

    @property
    def oldest_unfinished(self) -> int:
        """Lowest microbatch with work left on this stage (M when none)."""
        return self._oldest

    def order_position(self, task: Task) -> int:
        """Index of ``task`` in this stage's hint order (ordered hints and strict mode)."""
        return self._position[task]

    def next_in_order(self) -> Optional[Task]:
        return self._order[self._order_pos] if self._order and self._order_pos < len(self._order) else None

    def remaining_order(self) -> Iterator[Task]:
        assert self._order is not None
        for task in self._order[self._order_pos:]:
            if task not in self.dispatched_set:
                yield task

    def describe(self) -> dict:
        """State for diagnostics (hang dumps, TP disagreement reports)."""
        return {
            "stage": self.stage,
            "hint": self.hint.name + (" (waits for late forwards)" if self.hint.waits_for_forward else ""),
            "strict": self.config.strict,
            "dispatched": len(self.dispatched),
            "total": len(self.tasks),
            "in_flight": self.in_flight,
            "buffer_limit": self.buffer_limit,
            "level": self.level,
            "byte_budget": None if self._bytes is None else self._bytes.admit,
            "prefer": self.prefer.value,
            "next_in_order": str(self.next_in_order()) if self._order else None,
            "last_dispatched": format_order(self.dispatched[-6:]),
        }

    # -- internals -------------------------------------------------------------------

    def _checked_order(self, order: Optional[list[Task]]) -> list[Task]:
        if order is None:
            orders = self.hint.orders(self.topology, self.num_microbatches)
            if orders is None:
                raise ValueError(f"strict {self.hint.name!r} needs its materialised order: build arbiters "
                                 "through megatron_rrfp.policy.plan.Plan")
            order = orders[self.stage]
        if self.forward_only:
            order = [t for t in order if t.kind is Kind.F]
        validate_order(order, self.tasks, stage=self.stage, hint_name=self.hint.name)
        return list(order)

    def _scaled_lookahead(self) -> Optional[int]:
        """An ordered hint's window, widened with the memory above Megatron's: K + 2 entries
        (a forward and the backward it pairs with) per extra slot. At 1x the plan keeps its
        shape; with room to spare a stage may run further ahead of it (unwidened, a window of
        one entry per stage wastes much of what the spare memory buys: docs/simulator.md)."""
        base = getattr(self.hint, "lookahead", None)
        if base is None or self._order is None:
            return None
        if base == "pp":
            base = self.topology.num_stages
        try:
            reference = megatron_peak_in_flight(self.topology, self.num_microbatches)
        except ValueError:  # a layout Megatron's interleaved schedule refuses: the hint's own peak
            reference = peak_in_flight(self._order)
        return base + 2 * max(0, self.buffer_limit - reference)

    @staticmethod
    def _stages_above_hold(budgets: Optional[tuple[ByteBudget, ...]], stage: int, topology: Topology,
                           num_microbatches: int) -> bool:
        """Whether every stage u above ``stage`` can hold, in bytes, stage u + 1's Megatron count
        of unsplit forwards (u runs its n-th while n - 1 forwards and one forward's peak fit its
        budget). In forwards in flight it can: the limit is at least 1x, stage 0's count."""
        if stage == 0 or budgets is None or len(budgets) != topology.num_stages:
            return True
        counts = megatron_counts(topology, num_microbatches)
        return all(above.stage.forward <= 0 or (counts[u + 1] - 1) * above.stage.forward + above.stage.forward_peak
                   <= above.admit * _TOLERANCE for u, above in enumerate(budgets[:stage]))

    def _stage_bytes(self, budgets: Optional[tuple[ByteBudget, ...]]) -> Optional[ByteBudget]:
        if budgets is None or self.forward_only or self.config.strict:
            return None  # strict runs its order's own memory; evaluation holds nothing for backward
        if len(budgets) != self.topology.num_stages:
            raise ValueError(f"memory_bytes has {len(budgets)} stages' budgets for a pipeline of "
                             f"{self.topology.num_stages}")
        return budgets[self.stage]

    def _add_bytes(self, mb: int, amount: float) -> None:
        self.level += amount
        self._held_bytes[mb] += amount
        self.peak_level = max(self.peak_level, self.level)

    def _release(self, mb: int) -> None:
        self.in_flight -= 1
        self._released[mb] += 1
        self._advance_oldest()

    def _advance_oldest(self) -> None:
        done = self._forwards_run if self.forward_only else self._released
        chunks = self.topology.num_chunks
        while self._oldest < self.num_microbatches and done[self._oldest] == chunks:
            self._oldest += 1

    def _allowed(self, ready: set[Task]) -> set[Task]:
        if self.forward_only or not any(t.kind is Kind.F for t in ready):
            return ready
        frontier = self.admission_frontier()
        if frontier >= self.num_microbatches - 1:  # every forward admitted
            return ready
        return {t for t in ready if t.kind is not Kind.F or t.microbatch <= frontier}

    def _split_fits(self) -> bool:
        """A B split now keeps its stash within the byte budget (always, without bytes)."""
        return self._bytes is None or self.level + self._bytes.stage.split_peak <= self._bytes.split * _TOLERANCE

    def _frontier_beside_split(self, backward: Task) -> int:
        """The admission frontier beside ``backward`` split, whose release comes only with its W (-1:
        it would not split)."""
        if not self.split_backward or (backward.microbatch, backward.chunk) in self._inline or not self._split_fits():
            return -1
        return self._frontier_after_backward(backward, split=True)

    def _frontier_after_backward(self, backward: Task, *, split: bool = False) -> int:
        """``admission_frontier`` as it would be once ``backward`` ran (state restored): unsplit,
        its forward's memory released; split, its stash kept until its W."""
        mb = backward.microbatch
        saved = (self.in_flight, self._released[mb], self._oldest, self._frontier_at, self._frontier, self.level,
                 self._held_bytes[mb], self.peak_level)
        try:
            weights = self._bytes.stage if self._bytes is not None else UNIT
            if split:
                self._add_bytes(mb, weights.pending - weights.forward)
            else:
                self._add_bytes(mb, -weights.forward)
                self._release(mb)
            self._frontier_at = -1
            return self.admission_frontier()
        finally:
            (self.in_flight, self._released[mb], self._oldest, self._frontier_at, self._frontier, self.level,
             self._held_bytes[mb], self.peak_level) = saved

    def admission_frontier(self) -> int:
        """Highest microbatch whose forwards may run now (-1: none; M: any).

        F(j, .) is allowed iff in_flight < L and T_k < L for every unfinished k < j, with
        T_k = in_flight - sum_{i<k} held(i) + need(k) (module docstring). T only matters up
        to the first k with T_k >= L, so the answer is that k (its own forwards fit: they
        are counted in T_k) — a scan over the microbatches in flight, O(window).
        """
        if self._frontier_at == len(self.dispatched):  # unchanged since the last dispatch
            return self._frontier
        limit, chunks, in_flight = self._admission_limit, self.topology.num_chunks, self.in_flight
        forwards_run, released, m = self._forwards_run, self._released, self.num_microbatches
        frontier = m
        if in_flight >= limit:
            frontier = -1
        else:
            older_held = 0  # sum of held(i) for i < k
            for k in range(self._oldest, m):
                forwarded = forwards_run[k]
                if older_held == in_flight and forwarded == 0:
                    # nothing from k on is in flight: T_k = need(k) = C for all of them
                    frontier = k if chunks >= limit else m
                    break
                if in_flight - older_held + chunks - forwarded >= limit:
                    frontier = k
                    break
                older_held += forwarded - released[k]
        frontier = min(frontier, self._byte_frontier())
        self._frontier_at, self._frontier = len(self.dispatched), frontier
        return frontier

    def _byte_frontier(self) -> int:
        """``admission_frontier``'s rule in bytes (membytes.py): the same scan, each held
        forward weighing its bytes; the oldest unfinished microbatch is always admitted."""
        m = self.num_microbatches
        if self._bytes is None:
            return m
        weights, admit = self._bytes.stage, self._bytes.admit * _TOLERANCE
        extra = weights.forward_peak - weights.forward  # a forward's peak above what it then holds
        if self.level + weights.forward_peak > admit:
            return self._oldest
        chunks, older_held = self.topology.num_chunks, 0.0
        for k in range(self._oldest, m):
            forwarded = self._forwards_run[k]
            if forwarded == 0 and older_held >= self.level - 1e-9:  # nothing from k on is held: T_k = C forwards
                return m if chunks * weights.forward + extra <= admit else k
            if self.level - older_held + (chunks - forwarded) * weights.forward + extra > admit:
                return max(k, self._oldest)
            older_held += self._held_bytes[k]
        return m


_TOLERANCE = 1 + 1e-9
"""Budgets compare with a hair of slack: measured bytes are exact integers, sums of floats not."""

__all__ = ["DEFAULT_BUFFER_LIMIT", "DEFAULT_HINT", "Arbiter", "ArbiterConfig", "config_memory",
           "memory_of"]
