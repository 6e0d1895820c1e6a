"""The clairvoyant optimum of one simulated iteration: the per-stage order with the smallest
makespan when every task time and message latency is known in hindsight, found by a
constraint solver (OR-Tools CP-SAT, the optional extra ``pip install megatron-rrfp[optimal]``).

The model is the simulator's rules (``policy/dryrun.py``), nothing more and nothing less:

* a stage runs one task at a time (a no-overlap constraint per stage);
* F(v, j) starts after the activation from virtual stage v - 1 arrived, B(v, j) after its own
  F and the gradient from v + 1 (the last virtual stage: its own F), W(v, j) after B(v, j);
* a message arrives ``latency`` after its task ends, FIFO per directed link (stage pair): a
  later send on a link never arrives before an earlier one (an order literal per pair of sends
  on a link whose latencies differ; with equal latencies the stage's own order implies it);
* memory in the arbiter's unit: (microbatch, chunk) forwards in flight on a stage — from the
  F's start to the end of the task that releases it (W when split, else B) — stay within the
  cap (the resolved buffer limit, at least the chunk count, what the arbiter guarantees);
* the backward is split into B and W only where the caller says the model allows it.

Times are integers for the solver: every duration and latency is rounded *up* to a multiple of
``1 / scale`` (``scale`` a power of two near 2^14 per median forward, so times on a dyadic
grid stay exact). The reported makespan is the simulator's own replay of the solver's orders on
the exact times (strict, ``simulate``), which is what a schedule would achieve; rounding can
cost it at most a few ``1 / scale`` per task on its critical path. Refused above
``MAX_TASKS`` tasks (one line), where the solver rarely proves anything in seconds.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..policy.actions import Kind, Task, peak_in_flight
from ..policy.arbiter import ArbiterConfig
from ..policy.hints import OrderedHint
from ..policy.topology import Topology
from .simulator import simulate
from .variability import Realization

MAX_TASKS = 800
"""Most tasks (every stage's F, B and W together) the optimum is computed for: PP 4 x 4 chunks
x M 16 with the split backward is 768."""
INSTALL_HINT = "pip install megatron-rrfp[optimal]"


@dataclass(frozen=True, slots=True)
class Optimum:
    """One realisation's clairvoyant optimum."""

    makespan: float
    """The simulator's replay of ``orders`` on the realisation's exact times (units of f0)."""
    solver_makespan: float
    """The solver's objective on the rounded-up times, divided by the scale."""
    solver_bound: float
    """The solver's proven bound on the rounded-up problem (= ``solver_makespan`` when proven)."""
    proven: bool
    """The solver proved ``orders`` optimal on the rounded times (False: stopped at its time limit)."""
    orders: list[list[Task]]
    """Per stage, the tasks in the solver's start order."""
    seconds: float
    split_backward: bool
    cap: int
    """Forwards in flight allowed per stage (the buffer limit, at least the chunk count; the
    largest where the stages' limits differ)."""
    scale: int
    """Solver time units per unit of the realisation's times."""


def check_size(topology: Topology, num_microbatches: int, *, split_backward: bool, flag: str = "--optimal") -> None:
    """ValueError, one line, for a layout above ``MAX_TASKS``."""
    tasks = task_count(topology, num_microbatches, split_backward=split_backward)
    if tasks > MAX_TASKS:
        raise ValueError(f"{flag}: PP {topology.num_stages} x {topology.num_chunks} chunks x M {num_microbatches} is "
                         f"{tasks} tasks; the optimum is computed for at most {MAX_TASKS} (e.g. PP 4, 4 chunks, "
                         "M 16 with the split backward): use fewer --num-microbatches or a smaller layout")


def task_count(topology: Topology, num_microbatches: int, *, split_backward: bool) -> int:
    return topology.num_virtual_stages * num_microbatches * (3 if split_backward else 2)


def _cp_model():
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        raise ImportError(f"--optimal needs OR-Tools' CP-SAT solver: {INSTALL_HINT}") from None
    return cp_model


def choose_scale(realization: Realization) -> int:
    """A power of two giving about 2^14 solver units per median forward."""
    median = float(np.median(np.asarray(realization.forward, dtype=float)))
    return 2 ** max(0, min(40, 14 - round(math.log2(median)) if median > 0 else 14))


def rounded(realization: Realization, topology: Topology, scale: int, *, split_backward: bool) -> Realization:
    """``realization`` with every time the simulator uses rounded up to a multiple of 1/scale, as
    explicit F / B / W tables (``backward_input``, ``weight``): the solver's own times, which
    the simulator replays exactly."""
    def up(x: float, least: int) -> float:
        return max(least, math.ceil(x * scale - 1e-9)) / scale

    pp, chunks = topology.num_stages, topology.num_chunks
    m = len(realization.forward[0][0])
    shape = (pp, chunks, m)
    forward, backward, weight, full = (np.zeros(shape) for _ in range(4))
    for s, c, j in np.ndindex(shape):
        forward[s, c, j] = up(realization.duration(s, Task(Kind.F, j, c), split_backward), 1)
        backward[s, c, j] = up(realization.duration(s, Task(Kind.B, j, c), split_backward), 1)
        weight[s, c, j] = up(realization.duration(s, Task(Kind.W, j, c), True), 1) if split_backward else 0.0
        full[s, c, j] = backward[s, c, j] + weight[s, c, j]
    latency = {name: [[[up(x, 0) for x in row] for row in stage] for stage in getattr(realization, name)]
               for name in ("activation_latency", "gradient_latency")}
    return Realization(forward.tolist(), full.tolist(), latency["activation_latency"], latency["gradient_latency"],
                       backward_input=backward.tolist() if split_backward else None,
                       weight=weight.tolist() if split_backward else None)


def replay(orders: Sequence[Sequence[Task]], topology: Topology, realization: Realization, *,
           record_trace: bool = False):
    """The simulator running ``orders`` as fixed orders (strict): each task starts as soon as its
    inputs arrived and the stage's previous task ended."""
    m = len(realization.forward[0][0])
    hint = OrderedHint("optimal", [list(order) for order in orders])
    config = ArbiterConfig(hint=hint, strict=True, buffer_limit=m * topology.num_chunks)  # strict: its own memory
    return simulate(config, topology, m, realization, name="optimal", record_trace=record_trace)


class _Model:
    """The CP-SAT model of one realisation (integer times: ``rounded`` ones times ``scale``)."""

    def __init__(self, cp_model, times: Realization, topology: Topology, scale: int, *, split_backward: bool,
                 cap: Sequence[int], lower_bound: float, in_order: bool = False) -> None:
        self.cp, self.topology, self.split, self.in_order = cp_model, topology, split_backward, in_order
        self.model = model = cp_model.CpModel()
        pp, chunks = topology.num_stages, topology.num_chunks
        self.m = m = len(times.forward[0][0])
        kinds = (Kind.F, Kind.B, Kind.W) if split_backward else (Kind.F, Kind.B)
        self.duration = {(s, Task(k, j, c)): round(times.duration(s, Task(k, j, c), split_backward) * scale)
                         for s in range(pp) for c in range(chunks) for j in range(m) for k in kinds}
        self.lat = {"F": times.activation_latency, "B": times.gradient_latency}
        self.scale = scale
        latencies = sum(round(x * scale) for name in ("F", "B") for stage in self.lat[name] for row in stage
                        for x in row) if pp > 1 else 0
        self.horizon = horizon = sum(self.duration.values()) + latencies
        self.start, self.end, self.interval = {}, {}, {}
        for key, length in self.duration.items():
            stage, task = key
            self.start[key] = model.NewIntVar(0, horizon, f"s{stage}_{task}")
            self.end[key] = model.NewIntVar(0, horizon, f"e{stage}_{task}")
            self.interval[key] = model.NewIntervalVar(self.start[key], length, self.end[key], f"i{stage}_{task}")
        for s in range(pp):
            model.AddNoOverlap([iv for (stage, _), iv in self.interval.items() if stage == s])
        self.arrival: dict = {}
        self.links: dict[tuple[int, int], list] = {}
        self._messages(horizon)
        self._dependencies()
        if in_order:
            self._in_order()
        self.order_literals = self._fifo()
        self._memory(cap)
        self.makespan = model.NewIntVar(0, horizon, "makespan")
        for (_, task), end in self.end.items():
            if task.kind is not Kind.F:
                model.Add(self.makespan >= end)
        model.Add(self.makespan >= max(0, math.floor(lower_bound * scale) - 1))  # a proven bound: a cut
        model.Minimize(self.makespan)

    def _messages(self, horizon: int) -> None:
        """Every sent message: its arrival (>= the sender's end + its latency) and its link."""
        topology = self.topology
        for (stage, task), end in self.end.items():
            if task.kind is Kind.W:
                continue
            nxt = (topology.downstream if task.kind is Kind.F else topology.upstream)(stage, task.chunk)
            if nxt is None:
                continue
            if nxt[0] == stage:  # a rank's message to itself arrives at once
                self.arrival[(stage, task)] = end
                continue
            latency = round(self.lat[task.kind.value][stage][task.chunk][task.microbatch] * self.scale)
            arrival = self.model.NewIntVar(0, horizon, f"a{stage}_{task}")
            self.model.Add(arrival >= end + latency)
            self.arrival[(stage, task)] = arrival
            self.links.setdefault((stage, nxt[0]), []).append((task, latency))

    def _dependencies(self) -> None:
        topology, model = self.topology, self.model
        for (stage, task), start in self.start.items():
            j, c = task.microbatch, task.chunk
            if task.kind is Kind.F:
                prev = topology.upstream(stage, c)
                if prev is not None:
                    model.Add(start >= self.arrival[(prev[0], Task(Kind.F, j, prev[1]))])
            elif task.kind is Kind.B:
                model.Add(start >= self.end[(stage, Task(Kind.F, j, c))])
                nxt = topology.downstream(stage, c)
                if nxt is not None:
                    model.Add(start >= self.arrival[(nxt[0], Task(Kind.B, j, nxt[1]))])
            else:
                model.Add(start >= self.end[(stage, Task(Kind.B, j, c))])

    def _in_order(self) -> None:
        """Microbatches in order per (stage, chunk, kind), as the policies run them: what is left
        when the optimum may not reorder microbatches by their (clairvoyant) times."""
        for (stage, task), start in self.start.items():
            if task.microbatch:
                earlier = (stage, Task(task.kind, task.microbatch - 1, task.chunk))
                self.model.Add(start >= self.end[earlier])
                if (stage, task) in self.arrival and earlier in self.arrival:
                    self.model.Add(self.arrival[(stage, task)] >= self.arrival[earlier])

    def _fifo(self) -> dict:
        """Per pair of sends on one link (latencies differing): which is sent first, and then it
        also arrives first."""
        literals = {}
        for (src, _), sent in self.links.items():
            if len({latency for _, latency in sent}) <= 1:
                continue  # equal latencies: arrival order = send order already
            for i, (a, _) in enumerate(sent):
                for b, _ in sent[i + 1:]:
                    if self.in_order and a.kind is b.kind and a.chunk == b.chunk:
                        continue  # sent and arriving in microbatch order (_in_order)
                    first = self.model.NewBoolVar(f"o{src}_{a}_{b}")
                    ka, kb = (src, a), (src, b)
                    self.model.Add(self.end[ka] <= self.start[kb]).OnlyEnforceIf(first)
                    self.model.Add(self.arrival[kb] >= self.arrival[ka]).OnlyEnforceIf(first)
                    self.model.Add(self.end[kb] <= self.start[ka]).OnlyEnforceIf(first.Not())
                    self.model.Add(self.arrival[ka] >= self.arrival[kb]).OnlyEnforceIf(first.Not())
                    literals[(ka, kb)] = first
        return literals

    def _memory(self, caps: Sequence[int]) -> None:
        """Forwards in flight: one unit from F's start to the release's end, at most the stage's cap."""
        chunks, release = self.topology.num_chunks, Kind.W if self.split else Kind.B
        for s, cap in enumerate(caps):
            if cap >= self.m * chunks:
                continue  # room for every forward: the limit cannot bind
            held = []
            for c in range(chunks):
                for j in range(self.m):
                    begin, finish = self.start[(s, Task(Kind.F, j, c))], self.end[(s, Task(release, j, c))]
                    size = self.model.NewIntVar(0, self.horizon, f"h{s}_{c}_{j}")
                    held.append(self.model.NewIntervalVar(begin, size, finish, f"m{s}_{c}_{j}"))
            self.model.AddCumulative(held, [1] * len(held), cap)

    def hint(self, trace) -> None:
        """Warm start from a schedule the simulator ran on the same integer times."""
        starts = {(stage, task): round(begin * self.scale) for stage, task, begin, _ in trace}
        for key, value in starts.items():
            self.model.AddHint(self.start[key], value)
            self.model.AddHint(self.end[key], value + self.duration[key])
        clear: dict = {}
        for (src, dst), sent in sorted(self.links.items()):
            for task, latency in sorted(sent, key=lambda item: starts[(src, item[0])]):
                at = max(starts[(src, task)] + self.duration[(src, task)] + latency, clear.get((src, dst), 0))
                clear[(src, dst)] = at
                self.model.AddHint(self.arrival[(src, task)], at)
        for (ka, kb), literal in self.order_literals.items():
            self.model.AddHint(literal, starts[ka] < starts[kb])
        self.model.AddHint(self.makespan, max(starts[k] + self.duration[k] for k in starts))

    def orders(self, solver) -> list[list[Task]]:
        stages: list[list[tuple[int, Task]]] = [[] for _ in range(self.topology.num_stages)]
        for (stage, task), start in self.start.items():
            stages[stage].append((solver.Value(start), task))
        return [[task for _, task in sorted(items, key=lambda item: item[0])] for items in stages]


def _as_split(orders: Sequence[Sequence[Task]], split_backward: bool) -> list[list[Task]]:
    """A policy's orders in the optimum's task set: W right after its B where the policy ran the
    backward whole (the same memory and a gradient sent no later), dropped where the optimum does not split."""
    result = []
    for order in orders:
        tasks = [t for t in order if split_backward or t.kind is not Kind.W]
        if split_backward and not any(t.kind is Kind.W for t in tasks):
            tasks = [x for t in tasks for x in ((t, Task(Kind.W, t.microbatch, t.chunk)) if t.kind is Kind.B else (t,))]
        result.append(tasks)
    return result


def optimal_schedule(realization: Realization, topology: Topology, *, buffer_limit: int | Sequence[int],
                     split_backward: bool,
                     time_limit_s: float = 10.0, workers: int = 8, warm_start: Sequence[Sequence[Task]] = (),
                     lower_bound: float = 0.0, scale: Optional[int] = None, in_order: bool = False) -> Optimum:
    """The clairvoyant optimum on ``realization`` (module docstring).

    ``buffer_limit``: forwards in flight per stage, resolved (an int, or one per stage; the cap
    is at least the chunk count, as the arbiter's). ``warm_start``: per-stage orders the simulator can run
    (a policy's), the best of which starts the search. ``lower_bound``: a proven bound on the
    exact times (``bounds.lower_bound``), given to the solver as a cut. ``in_order``: keep each
    (stage, chunk, kind)'s microbatches in order, as every policy here does — the optimum a
    policy could reach without reordering microbatches by times it cannot know in advance.
    """
    cp_model = _cp_model()
    m = len(realization.forward[0][0])
    check_size(topology, m, split_backward=split_backward)
    scale = scale or choose_scale(realization)
    times = rounded(realization, topology, scale, split_backward=split_backward)
    limits = [buffer_limit] * topology.num_stages if isinstance(buffer_limit, (int, np.integer)) else buffer_limit
    caps = [max(int(limit), topology.num_chunks) for limit in limits]
    began = time.perf_counter()
    model = _Model(cp_model, times, topology, scale, split_backward=split_backward, cap=caps,
                   lower_bound=lower_bound, in_order=in_order)
    starts = [orders for orders in (_as_split(o, split_backward) for o in warm_start)
              if all(peak_in_flight(order) <= cap for order, cap in zip(orders, caps))]
    warm = min((replay(orders, topology, times, record_trace=True) for orders in starts),
               key=lambda run: run.makespan, default=None)
    if warm is not None:
        model.hint(warm.trace)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = int(workers)
    # one worker searches for a proof (the default portfolio's bound rarely rises above the cut with
    # interleaving): an unproven solve then still brackets the optimum
    solver.parameters.extra_subsolvers.append("lb_tree_search")
    status = solver.Solve(model.model)
    seconds = time.perf_counter() - began
    found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    if not found and warm is None:
        raise RuntimeError(f"--optimal: the solver found no schedule in {time_limit_s:g} s "
                           f"({solver.StatusName(status)}); raise its time limit (--optimal-time-limit)")
    candidates = [model.orders(solver)] if found else []
    if warm is not None and status != cp_model.OPTIMAL:  # stopped unproven: the warm start where it is better
        candidates.append(warm.orders)
    makespan, orders = min(((replay(o, topology, realization).makespan, o) for o in candidates),
                           key=lambda item: item[0])
    return Optimum(makespan=makespan,
                   solver_makespan=solver.ObjectiveValue() / scale if found else warm.makespan,
                   solver_bound=solver.BestObjectiveBound() / scale, proven=status == cp_model.OPTIMAL,
                   orders=orders, seconds=seconds, split_backward=split_backward, cap=max(caps), scale=scale)


def require_solver() -> None:
    """ValueError, one line naming the extra, where OR-Tools is not installed."""
    try:
        _cp_model()
    except ImportError as exc:
        raise ValueError(str(exc)) from None


def check_study(config, limits: Sequence) -> None:
    """``simulate --optimal``'s checks before anything is simulated (one-line ValueErrors): the
    solver is installed and every limit's layout is within ``MAX_TASKS``."""
    from ..policy.budget import resolve_buffer_limit

    require_solver()
    topology = Topology(config.pipeline_size, config.num_chunks)
    m = config.num_microbatches
    for spec in limits:
        limit = resolve_buffer_limit(spec, topology, m)
        check_size(topology, m, split_backward=_splits([config.baseline, *config.policies], limit, topology, m))


def _splits(names: Sequence[str], limit: int, topology: Topology, m: int) -> bool:
    """The optimum splits the backward where any compared policy does (the model allows it)."""
    from ..policy.plan import Plan
    from .simulator import policy

    return any(Plan.build(policy(name, limit), topology, m).split_backward for name in names)


def add_optimum(config, tradeoff: dict, *, time_limit_s: float = 10.0, workers: int = 8,
                progress: bool = True) -> dict:
    """``simulate --optimal``: for each study of ``tradeoff`` (``study.run_tradeoff`` on ``config``)
    and each seed, the optimum at that study's buffer limit, with the backward split if any
    compared policy splits it; adds "optimal" (per seed: makespan, proven, seconds, the policy
    bound) and each policy's "makespan_over_optimal" (per-seed ratio, median). Every compared
    policy's order on the seed warm-starts the solver."""
    from tqdm import tqdm

    from .bounds import lower_bound
    from .simulator import median, policy
    from .variability import sample_realization

    topology = Topology(config.pipeline_size, config.num_chunks)
    m = config.num_microbatches
    seeds = tradeoff["studies"][0]["seeds"]
    for study in tqdm(tradeoff["studies"], desc="optimum per limit", disable=not progress, leave=False):
        limit = study["buffer_limit"]
        names = list(study["policies"])
        split = _splits(names, limit, topology, m)
        check_size(topology, m, split_backward=split)
        per_seed = []
        for seed in seeds:
            realization = sample_realization(config.variability, topology, m, seed)
            cap = max(limit, topology.num_chunks)
            bound = lower_bound(realization, topology, m, split_backward=split,
                                in_flight_caps=[cap] * config.pipeline_size)
            warm = [simulate(policy(name, limit), topology, m, realization, name=name).orders for name in names]
            per_seed.append((optimal_schedule(realization, topology, buffer_limit=limit, split_backward=split,
                                              time_limit_s=time_limit_s, workers=workers, warm_start=warm,
                                              lower_bound=bound), bound))
        makespans = [o.makespan for o, _ in per_seed]
        study["optimal"] = {"split_backward": split, "cap": per_seed[0][0].cap, "makespan_per_seed": makespans,
                            "makespan_median": median(makespans), "proven_per_seed": [o.proven for o, _ in per_seed],
                            "solver_bound_per_seed": [o.solver_bound for o, _ in per_seed],
                            "seconds_per_seed": [o.seconds for o, _ in per_seed],
                            "lower_bound_per_seed": [b for _, b in per_seed],
                            "lower_bound_over_optimal": median([b / o.makespan for o, b in per_seed]),
                            "solver_bound_over_lower_bound": median([max(b, o.solver_bound) / b for o, b in per_seed]),
                            "time_limit_s": time_limit_s}
        for p in study["policies"].values():
            p["makespan_over_optimal"] = median([x / o for x, o in zip(p["makespan_per_seed"], makespans)])
    return tradeoff


def optimum_for_policy(config: ArbiterConfig, topology: Topology, realizations: Sequence[Realization], *,
                       stage_limits: Optional[Sequence[Optional[int]]] = None, latency: bool = True,
                       warm_starts: Sequence[Sequence] = (), time_limit_s: float = 10.0, workers: int = 8,
                       cache: Optional[dict] = None) -> dict:
    """Per realisation, the optimum for what ``config`` may do — its split, its memory per stage
    (``bounds.in_flight_caps``: a fixed order's own peak, else the limit a run resolved) and the
    message latency where ``latency`` — beside the bound for the same (``bounds.median_lower_bound``'s
    per realisation): what ``bench --optimal`` divides its measured times by. ``warm_starts[i]``:
    orders the simulator ran on realisation i. ``cache``: solves shared between the runs that
    agree on split, caps and latency."""
    from ..policy.plan import Plan
    from .bounds import in_flight_caps, lower_bound, without_latency
    from .simulator import median

    m = len(realizations[0].forward[0][0])
    plan = Plan.build(config, topology, m)
    caps, split = in_flight_caps(plan, stage_limits), plan.split_backward
    check_size(topology, m, split_backward=split)
    cache = {} if cache is None else cache
    solved = []
    for i, realization in enumerate(realizations):
        key = (i, split, tuple(caps), latency)
        if key not in cache:
            times = realization if latency else without_latency(realization)
            bound = lower_bound(times, topology, m, split_backward=split, in_flight_caps=caps)
            cache[key] = (optimal_schedule(times, topology, buffer_limit=caps, split_backward=split,
                                           time_limit_s=time_limit_s, workers=workers, lower_bound=bound,
                                           warm_start=warm_starts[i] if warm_starts else ()), bound)
        solved.append(cache[key])
    makespans = [o.makespan for o, _ in solved]
    return {"split_backward": split, "caps": list(caps), "makespan_per_iteration": makespans,
            "makespan_median": median(makespans), "proven_per_iteration": [o.proven for o, _ in solved],
            "seconds_per_iteration": [o.seconds for o, _ in solved],
            "solver_bound_per_iteration": [o.solver_bound for o, _ in solved],
            "solver_bound_over_lower_bound": median([max(b, o.solver_bound) / b for o, b in solved]),
            "lower_bound_over_optimal": median([b / o.makespan for o, b in solved]), "time_limit_s": time_limit_s}


def format_optimum(study: dict) -> str:
    """One line: the optimum beside the bound, how many seeds the solver proved, its time."""
    o = study["optimal"]
    proven = sum(o["proven_per_seed"])
    return (f"optimum (clairvoyant, CP-SAT{', split backward' if o['split_backward'] else ''}, {o['cap']} in flight): "
            f"makespan {o['makespan_median']:.3f}, LB / optimum {o['lower_bound_over_optimal']:.3f}, proven on "
            f"{proven} of {len(o['proven_per_seed'])} seeds (else the best order found in "
            f"{o['time_limit_s']:g} s, and the solver proved the optimum at least "
            f"{o['solver_bound_over_lower_bound']:.3f} x LB), solver {max(o['seconds_per_seed']):.1f} s at most "
            "per seed")


__all__ = ["INSTALL_HINT", "MAX_TASKS", "Optimum", "add_optimum", "check_size", "check_study", "choose_scale",
           "format_optimum", "optimal_schedule", "optimum_for_policy", "replay", "require_solver",
           "rounded", "task_count"]
