"""Hint orders: the schedule, consumed as a *ranking*, not as a plan.

Two families, one interface (``Hint.pick`` ranks the allowed ready tasks; ``Hint.order``
is the full per-stage order, used by strict mode and for display):

* rule hints — ``bf`` (the paper's default) and ``bfw`` — rank by direction;
* ordered hints — ``1f1b`` (Megatron's per-stage order, interleaved included), ``zbh1``
  (zero-bubble ZB-H1: 1F1B's skeleton with the backward split and W deferred), ``gpipe``,
  or an explicit per-stage list (JSON) — rank by position in the list.

``make_hint("bf" | "bfw" | "1f1b" | "zbh1" | "gpipe" | "path/to/hint.json")`` builds one;
``"default"`` resolves per layout and buffer limit (``DefaultHint.for_layout``) by the rows
of ``default.DEFAULT_RULES``: near Megatron's memory ``zbh1`` read readiness-first where the
model can split its backward (at 1x only deferred weight gradients give a stage something to
run in a bubble), else Megatron's own order: 1F1B waiting for late forwards without chunks
(``WAITING_1F1B``), the interleaved order with chunks (under jitter at 1x it beats
chunk-aware BF); with room to run ahead ``bfw`` or ``bf``.

With chunks, BF ranks forwards as Megatron's interleaved table does: microbatch group (of
PP) first, then chunk (lower first), then microbatch. Ranking forwards by chunk alone
(breadth-first, the paper's literal rule) filled an interleaved stage's memory with chunk-0
activations and fell far behind Megatron's interleaved schedule at 1x; read by group it is
never behind it without jitter (tests/unit/test_policy.py). Backwards hold no new memory, so
they rank by the work still chained behind them: the deepest chunk first, then microbatch.
``gpipe`` below room for all M x C forwards is refused (``Hint.check_memory``): forward-first
under a memory cap loses to Megatron everywhere.

Readiness-first on an ordered hint is *bounded* (``lookahead``, default one entry per
pipeline stage): a stage may run any ready task among the first K entries of its order it
has not run yet — the plan, slipped where the run time made it stale — but not leap
further ahead (with K = inf a stage 0 ran every chunk-0 forward first and left no memory
for the deeper chunks). Outside the window only the stage's oldest unfinished microbatch
may fill idle time, which keeps the arbiter deadlock-free (docs/design/deadlock-freedom.md).
Once a stage has run all its forwards, a built-in order's rest is ranked as ``bfw`` ranks
it (the deepest chunk's B first, W only when no B is ready): only backward chains are left.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from functools import lru_cache
from typing import Optional, Protocol

from .actions import Kind, Task, peak_in_flight
from .default import LEAD_ZBH1_THEN_BFW, WAITING_1F1B, Memory, default_choice
from .topology import Topology


class StageState(Protocol):
    """What a hint may read of its stage's arbiter when it ranks the ready tasks."""

    topology: Topology
    prefer: Kind
    """The direction BF prefers next (after an F: B; after a B: F)."""
    lookahead: Optional[int]
    """An ordered hint's window on this stage, in order entries (None: unbounded)."""
    oldest_unfinished: int
    """Lowest microbatch with work left on the stage."""
    stage: int
    """This stage's index in the pipeline."""
    forwards_left: int
    """The stage's forwards not yet dispatched (0: only backward work is left)."""

    def remaining_order(self) -> Iterator[Task]:
        """The stage's order, minus what already ran (ordered hints)."""

    def order_position(self, task: Task) -> int:
        """Index of ``task`` in the stage's order."""

    def admission_frontier(self) -> int:
        """Highest microbatch whose forwards the memory rule admits now (arbiter.py)."""

BUILTIN_HINTS = ("default", "bf", "bfw", "1f1b", "zbh1", "gpipe")
DEFAULT_LOOKAHEAD = "pp"
"""Window of an ordered hint, in order entries: "pp" = one entry per pipeline stage. Too wide
and a stage runs so far ahead of its plan that shallow pipelines fall behind the strict
order; unbounded (the paper's rule) is far behind at Megatron's memory (docs/simulator.md)."""


class HintError(ValueError):
    """A hint that cannot drive this pipeline (unknown name, malformed or incomplete list)."""


def _forward_key(task: Task, group: int) -> tuple[int, int, int]:
    # Megatron's interleaved table: microbatch groups of PP, chunk by chunk within a group
    return (task.microbatch // group, task.chunk, task.microbatch)


def _backward_key(task: Task) -> tuple[int, int]:
    # the deepest chunk first, whatever its microbatch group: its gradient still has the most backward
    # hops ahead of it (every chunk below, on every stage), so it heads the longest chain left to the
    # iteration's end; the optimal orders run it ahead of an older microbatch's shallower backward, where
    # Megatron's group order left the stages below idle in the cool-down (docs/simulator.md)
    return (-task.chunk, task.microbatch)


def _backward_then_weight(allowed: set[Task]) -> Optional[Task]:
    """The best ready B (``_backward_key``), else the oldest ready W (per chunk in its B's order)."""
    backward = min((t for t in allowed if t.kind is Kind.B), key=_backward_key, default=None)
    if backward is not None:
        return backward
    return min((t for t in allowed if t.kind is Kind.W), key=lambda t: (t.microbatch, -t.chunk), default=None)


class Hint:
    """A ranking of one stage's tasks. ``pick`` chooses among the allowed ready tasks."""

    name: str = "hint"
    split_backward: bool = False
    waits_for_forward: bool = False
    """Waits for the forward its order runs next rather than run a ready backward (OrderedHint)."""

    def orders(self, topology: Topology, num_microbatches: int) -> Optional[list[list[Task]]]:
        """One order per stage, or None for a rule hint (its fixed-order form is
        materialised by ``plan.Plan`` with a dry run of the rule itself)."""
        return None

    def pick(self, allowed: set[Task], arbiter: StageState) -> Optional[Task]:
        raise NotImplementedError

    def for_layout(self, topology: Topology, *, split_backward: bool = True,
                   memory: Optional[Memory] = None) -> Hint:
        """The concrete hint for this layout (itself, except for ``default``);
        ``split_backward``: whether the model can defer its weight gradients (W tasks);
        ``memory``: the stage's buffer limit beside Megatron's peak (None: 1x)."""
        return self

    def check_memory(self, topology: Topology, num_microbatches: int, buffer_limit: int) -> None:
        """HintError where reading this hint readiness-first at ``buffer_limit`` forwards in
        flight would be slower than Megatron's own schedule without jitter (plan.py asks,
        before the first iteration); nothing for every other layout."""

    def __repr__(self) -> str:
        return f"<hint {self.name}>"

    def _identity(self) -> tuple:
        return (type(self).__name__, self.name)

    def __eq__(self, other: object) -> bool:  # equal hints make equal (cacheable) configs
        return isinstance(other, Hint) and self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())


class DirectionalHint(Hint):
    """BF: rounds of "one ready B, then one ready F"; a direction with nothing ready is
    skipped, never waited for. BFW adds W as filler: a W runs only when no B or F is ready.

    The arbiter remembers the direction to prefer next (``arbiter.prefer``): after an F it
    prefers B, after a B it prefers F — which makes the last stage behave exactly as 1F1B.
    Within a direction, the ranking of the module docstring (forwards: Megatron's interleaved table).
    """

    def __init__(self, *, with_weight_tasks: bool) -> None:
        self.split_backward = with_weight_tasks
        self.name = "bfw" if with_weight_tasks else "bf"

    def pick(self, allowed: set[Task], arbiter: StageState) -> Optional[Task]:
        group = arbiter.topology.num_stages
        best = {
            Kind.F: min((t for t in allowed if t.kind is Kind.F), key=lambda t: _forward_key(t, group), default=None),
            Kind.B: min((t for t in allowed if t.kind is Kind.B), key=_backward_key, default=None),
        }
        other = Kind.F if arbiter.prefer is Kind.B else Kind.B
        for direction in (arbiter.prefer, other):
            if best[direction] is not None:
                return best[direction]
        return _backward_then_weight(allowed)


class DefaultHint(Hint):
    """What a user who names no hint gets: the named hint that wins for this layout, this
    buffer limit and what the model's backward allows (``default.DEFAULT_RULES``).

    Where the model can defer its weight gradients: ZB-H1 read readiness-first near
    Megatron's memory — at 1x the W tasks are what a stage can run in a bubble without
    holding another forward (where BF, with nothing to fill a bubble, gains almost nothing over
    strict 1F1B) — and ``bfw`` once the limit leaves room to run ahead (``DEFAULT_RULES``).
    Otherwise, without chunks, Megatron's 1F1B order waiting for late forwards at 1x and BF
    (the paper's) from 1.25x; Megatron's own interleaved order with chunks
    (``bf`` from 1.5x with 2 chunks, from 2x with 3+). Without jitter it is never slower than the order it
    reads strictly (tests/unit/test_policy.py sweeps it)."""

    name = "default"

    def for_layout(self, topology: Topology, *, split_backward: bool = True,
                   memory: Optional[Memory] = None) -> Hint:
        choice = default_choice(topology, split_backward=split_backward, memory=memory)
        if choice == LEAD_ZBH1_THEN_BFW:
            return LeadStageOrderedHint()
        return OrderedHint("1f1b", waits_for_forward=True) if choice == WAITING_1F1B else builtin_hint(choice)


class OrderedHint(Hint):
    """A per-stage list; readiness-first dispatches the first *ready* entry not yet run among
    the next ``lookahead`` entries ("pp": as many as pipeline stages; None: anywhere in the
    list, the paper's rule; the arbiter widens it by 2 per slot of memory above Megatron's),
    else the first ready task of the stage's oldest unfinished microbatch, else waits.

    ``waits_for_forward``: when the next entry is a forward the memory rule admits but whose
    input has not arrived, wait for it instead of running a ready backward ahead of it (what
    ``default`` reads for 1F1B without the split at 1x, ``WAITING_1F1B``). Deadlock-free on
    Megatron's one-chunk 1F1B order while every stage may hold its Megatron count, which the
    arbiter checks (docs/design/deadlock-freedom.md)."""

    def __init__(self, name: str, orders: Optional[Sequence[Sequence[Task]]] = None, *,
                 lookahead: int | str | None = DEFAULT_LOOKAHEAD, waits_for_forward: bool = False) -> None:
        if not (lookahead is None or lookahead == "pp" or (isinstance(lookahead, int) and lookahead >= 1)):
            raise HintError(f"hint {name!r}: lookahead must be an int >= 1, 'pp' (one entry per stage) "
                            f"or None (unbounded), got {lookahead!r}")
        self.name = name
        self.lookahead = lookahead
        self.waits_for_forward = waits_for_forward
        self._orders = [list(o) for o in orders] if orders is not None else None
        self.split_backward = name == "zbh1" or (bool(self._orders) and any(
            t.kind is Kind.W for order in self._orders for t in order
        ))

    def _identity(self) -> tuple:
        orders = None if self._orders is None else tuple(tuple(o) for o in self._orders)
        return (type(self).__name__, self.name, orders, self.lookahead, self.waits_for_forward)

    def orders(self, topology: Topology, num_microbatches: int) -> list[list[Task]]:
        if self._orders is not None:
            if len(self._orders) != topology.num_stages:
                raise HintError(
                    f"hint {self.name!r} lists {len(self._orders)} stages but the pipeline has "
                    f"{topology.num_stages}; give one order per pipeline stage"
                )
            return [list(order) for order in self._orders]
        if self.name == "1f1b":
            return [megatron_1f1b_order(s, topology, num_microbatches) for s in range(topology.num_stages)]
        if self.name == "zbh1":
            return [zbh1_order(s, topology, num_microbatches) for s in range(topology.num_stages)]
        if self.name == "gpipe":
            return [gpipe_order(topology, num_microbatches)] * topology.num_stages
        raise HintError(f"hint {self.name!r} has no order")

    def check_memory(self, topology: Topology, num_microbatches: int, buffer_limit: int) -> None:
        # GPipe runs every forward before any backward. Below room for all of them the
        # memory rule cuts it into a forward-first 1F1B whose last stages delay the
        # backward wave, well behind Megatron's schedule even without jitter; with room for all it
        # ties (docs/simulator.md).
        need = num_microbatches * topology.num_chunks
        if self.name == "gpipe" and self._orders is None and buffer_limit < need:
            raise HintError(
                f"hint 'gpipe' runs all M x chunks = {need} forwards of a stage before its first backward; at a "
                f"buffer limit of {buffer_limit} it would run slower than Megatron's own schedule: use hint "
                f"'default' (--rrfp-hint default), or give the buffer limit room for {need} (--rrfp-buffer-limit "
                f"{need}, GPipe's memory)")

    def pick(self, allowed: set[Task], arbiter: StageState) -> Optional[Task]:
        if not allowed:
            return None
        if arbiter.forwards_left == 0 and self._orders is None:
            # a built-in order's cool-down: with every forward run there is no memory or warm-up left to
            # keep, only the backward chains to the end; the order's fixed B/W interleave ran a W, or a
            # shallower chunk's B, while a deeper one waited and left the stages below idle. As bfw:
            # the deepest chunk's B first, W only when no B is ready
            return _backward_then_weight(allowed)
        window = arbiter.lookahead  # self.lookahead, widened with spare memory (arbiter.py)
        for seen, task in enumerate(arbiter.remaining_order()):
            if window is not None and seen >= window:
                break
            if task in allowed:
                return task
            if (seen == 0 and self.waits_for_forward and task.kind is Kind.F
                    and task.microbatch <= arbiter.admission_frontier()):
                return None  # the order's next forward is admitted but has not arrived: wait for it
        # nothing in the window: only the oldest microbatch may fill the wait (progress
        # guarantee), earliest-listed first
        oldest = [t for t in allowed if t.microbatch == arbiter.oldest_unfinished]
        return min(oldest, key=arbiter.order_position, default=None)


class LeadStageOrderedHint(OrderedHint):
    """``LEAD_ZBH1_THEN_BFW``: the pipeline's first stage reads ZB-H1's order readiness-first
    (its window, its fallback), every later stage ranks its ready tasks as ``bfw``. Each stage
    returns a task whenever one is allowed and ready, so the arbiter's progress argument holds
    per stage as for either hint alone."""

    def __init__(self) -> None:
        super().__init__("zbh1")  # ZB-H1's split backward and window
        self.name = LEAD_ZBH1_THEN_BFW
        self._later_stages = DirectionalHint(with_weight_tasks=True)

    def orders(self, topology: Topology, num_microbatches: int) -> list[list[Task]]:
        return [zbh1_order(s, topology, num_microbatches) for s in range(topology.num_stages)]

    def pick(self, allowed: set[Task], arbiter: StageState) -> Optional[Task]:
        if arbiter.stage > 0:
            return self._later_stages.pick(allowed, arbiter)
        return super().pick(allowed, arbiter)


def builtin_hint(name: str) -> Hint:
    """The built-in hint of this name (one of ``BUILTIN_HINTS``; ``default`` resolves per layout)."""
    if name == "default":
        return DefaultHint()
    if name in ("bf", "bfw"):
        return DirectionalHint(with_weight_tasks=name == "bfw")
    return OrderedHint(name)


def megatron_1f1b_order(stage: int, topology: Topology, num_microbatches: int,
                        group_size: Optional[int] = None) -> list[Task]:
    """Megatron-core's per-stage order: warm-up forwards, steady 1F1B, cool-down backwards.

    Interleaved (C > 1): Megatron's schedule table walks microbatch groups of
    ``group_size`` (``microbatch_group_size_per_vp_stage``, default PP) chunk by chunk;
    backwards visit chunks in reverse. Warm-up = 2(PP - s - 1) + (C - 1) * group_size.
    """
    pp, chunks, m = topology.num_stages, topology.num_chunks, num_microbatches
    if chunks == 1:
        warmup = min(pp - stage - 1, m)
        forwards = [Task(Kind.F, i) for i in range(m)]
        backwards = [Task(Kind.B, i) for i in range(m)]
    else:
        group = group_size or pp
        if not pp <= group <= m or 0 < m % group < pp:
            raise HintError(
                f"interleaved 1f1b hint needs PP <= microbatch group <= M and M % group == 0 or >= PP "
                f"(Megatron's own rule); got PP={pp}, M={m}, group={group}: use a multiple of {pp} microbatches"
            )
        table = [
            (mb, c)
            for start in range(0, m, group)
            for c in range(chunks)
            for mb in range(start, m if start + group >= m else start + group)
        ]
        warmup = min(2 * (pp - stage - 1) + (chunks - 1) * group, len(table))
        forwards = [Task(Kind.F, mb, c) for mb, c in table]
        backwards = [Task(Kind.B, mb, chunks - 1 - c) for mb, c in table]
    order = forwards[:warmup]
    for k in range(len(forwards) - warmup):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[len(forwards) - warmup:]


def zbh1_order(stage: int, topology: Topology, num_microbatches: int) -> list[Task]:
    """Zero-bubble ZB-H1 (Qi et al., arXiv 2401.10241, section 2.1): Megatron's 1F1B order
    (interleaved included) with the backward split into B (input gradient, sent upstream at
    once) and W (weight gradient), W of the k-th backward run right after the (k + d)-th.

    d = P_max - P_s, P_s = stage s's 1F1B peak in flight, P_max = the most of any stage
    (stage 0's). Without chunks d = s, as in the paper and torch.distributed.pipelining's
    ZB1P: every stage then holds P_max = min(PP, M) in flight (F - W) — the paper's "same
    peak memory as 1F1B" is this global peak; the later stages spend the room 1F1B leaves
    them on deferred W, which fill the drain bubble. Remaining W close the order.
    """
    base = megatron_1f1b_order(stage, topology, num_microbatches)
    delay = _megatron_peak_max(topology, num_microbatches) - peak_in_flight(base)
    order: list[Task] = []
    backwards: list[Task] = []
    for task in base:
        order.append(task)
        if task.kind is Kind.B:
            backwards.append(task)
            if len(backwards) > delay:
                done = backwards[len(backwards) - 1 - delay]
                order.append(Task(Kind.W, done.microbatch, done.chunk))
    released = max(0, len(backwards) - delay)
    return order + [Task(Kind.W, t.microbatch, t.chunk) for t in backwards[released:]]


@lru_cache(maxsize=256)
def _megatron_peak_max(topology: Topology, num_microbatches: int) -> int:
    """The most forwards any stage holds in Megatron's order (stage 0's); once per layout, not
    once per stage (the simulator's sweeps build every stage's ZB-H1 order)."""
    return max(peak_in_flight(megatron_1f1b_order(s, topology, num_microbatches))
               for s in range(topology.num_stages))


def gpipe_order(topology: Topology, num_microbatches: int) -> list[Task]:
    """All forwards (chunk by chunk), then all backwards in reverse."""
    forwards = [Task(Kind.F, m, c) for c in range(topology.num_chunks) for m in range(num_microbatches)]
    backwards = [Task(Kind.B, m, c) for c in reversed(range(topology.num_chunks)) for m in range(num_microbatches)]
    return forwards + backwards


def validate_order(order: Iterable[Task], expected: Iterable[Task], *, stage: int, hint_name: str) -> None:
    """Each expected task exactly once, nothing else — checked before the first dispatch."""
    order = list(order)
    expected_set = set(expected)
    if len(order) == len(expected_set) and set(order) == expected_set:
        return  # the common case, checked in O(n); below only to name the first fault
    seen: set[Task] = set()
    for task in order:
        if task not in expected_set:
            raise HintError(f"hint {hint_name!r}, stage {stage}: task {task} does not exist in this pipeline")
        if task in seen:
            raise HintError(f"hint {hint_name!r}, stage {stage}: task {task} is listed twice")
        seen.add(task)
    missing = sorted(expected_set - seen, key=lambda t: (t.kind.value, t.chunk, t.microbatch))
    if missing:
        shown = ",".join(str(t) for t in missing[:8]) + ("..." if len(missing) > 8 else "")
        raise HintError(f"hint {hint_name!r}, stage {stage}: {len(missing)} task(s) missing: {shown}")
