"""`megatron-rrfp simulate`: compare policies over K seeds of the same variability.

    megatron-rrfp simulate --pp 8 -m 32 --reference --seeds 5                # at Megatron's memory (1x)
    megatron-rrfp simulate --pp 8 -m 32 --reference --baseline zbh1-strict  # also vs strict ZB-H1
    megatron-rrfp simulate --pp 8 -m 32 --chunks 2 --reference \
        --buffer-limit 1x,1.25x,1.5x,2x,4x --json out/curve.json            # + out/curve-curve.png
    megatron-rrfp simulate --pp 4 -m 16 --chunks 2 --reference --num-experts 16 \
        --expert-model-parallel-size 2 --a2a-time 0.64 --overlap-moe-expert-parallel-comm   # paired F and B

Speedups are per-seed ratios on the same realisation, then the median over seeds.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import ClassVar, Optional

from tqdm import tqdm

from ..checks import BUFFER_LIMIT, Bound, check_fields, integer
from ..policy.budget import LimitSpec, megatron_peak_in_flight, resolve_buffer_limit
from ..policy.plan import Plan
from ..policy.topology import Topology
from .bounds import lower_bound, policy_lower_bound
from .combined import simulate_combined
from .simulator import BASELINE, STRICT_SUFFIX, median, policy, simulate
from .variability import Variability, sample_realization

DEFAULT_POLICIES = ("1f1b-strict", "zbh1-strict", "default", "bf", "bfw", "zbh1")
PAIRED_POLICIES = ("1f1b-strict", "zbh1-strict", "default", "bf")
"""``DEFAULT_POLICIES`` under ``--overlap-moe-expert-parallel-comm`` (bfw and zbh1 place W themselves)."""
COMBINED = "combined-1f1b"
"""Megatron's combined 1F1B (``--overlap-moe-expert-parallel-comm``) as a fixed order (combined.py)."""


@dataclass(kw_only=True, slots=True)
class StudyConfig:
    """One simulated study."""

    pipeline_size: int = 8
    num_microbatches: int = 32
    num_chunks: int = 1
    policies: Sequence[str] = DEFAULT_POLICIES
    """Policy names: default, bf, bfw, 1f1b, zbh1, gpipe or a hint file; '-strict' suffix = fixed order."""
    buffer_limit: LimitSpec = "1x"
    """Per-stage (microbatch, chunk) forwards in flight: an int or a multiple of Megatron's own peak."""
    seeds: int = 5
    first_seed: int = 0
    variability: Variability = field(default_factory=Variability)
    baseline: str = BASELINE
    """A second reference (e.g. zbh1-strict): speedups over it are reported too, per seed."""
    overlap_moe_expert_parallel_comm: bool = False
    """MoE: readiness-first policies pair a ready F with a ready B (megatron-core's combined step) and
    Megatron's combined 1F1B runs beside them where Megatron has it (virtual stages at PP > 1)."""

    BOUNDS: ClassVar[dict[str, Bound]] = {
        "pipeline_size": integer(1, 1024), "num_microbatches": integer(1, 100_000), "num_chunks": integer(1, 64),
        "buffer_limit": BUFFER_LIMIT, "seeds": integer(1, 100_000), "first_seed": integer(0, 2**32 - 1),
    }
    FLAGS: ClassVar[dict[str, str]] = {
        "pipeline_size": "--pipeline-model-parallel-size", "num_microbatches": "--num-microbatches",
        "num_chunks": "--virtual-pipeline-model-parallel-size",
        "buffer_limit": "--buffer-limit", "seeds": "--seeds", "first_seed": "--first-seed",
    }
    MAX_TASKS = 10_000_000
    """Stages x chunks x microbatches: more would not fit one seed's durations in memory."""

    def __post_init__(self) -> None:
        """Every value, the layout and every policy's plan, before anything is simulated."""
        check_fields(self, self.BOUNDS, self.FLAGS)
        tasks = self.pipeline_size * self.num_chunks * self.num_microbatches
        if tasks > self.MAX_TASKS:
            raise ValueError(f"--pipeline-model-parallel-size x --virtual-pipeline-model-parallel-size x "
                             f"--num-microbatches = {tasks} tasks per stage set; at most {self.MAX_TASKS} fit one "
                             "seed's durations in memory")
        if isinstance(self.policies, str) or not self.policies or not all(isinstance(p, str) and p
                                                                          for p in self.policies):
            raise ValueError(f"--policies must be a comma list of policy names, got {self.policies!r}")
        self.variability.check_layout(self.pipeline_size)
        topology = Topology(self.pipeline_size, self.num_chunks)
        try:
            resolve_buffer_limit(self.buffer_limit, topology, self.num_microbatches)
        except ValueError as exc:
            raise ValueError(f"--buffer-limit: {exc}") from None
        for name in dict.fromkeys([BASELINE, self.baseline, *self.policies]):
            try:
                Plan.build(policy(name, self.buffer_limit), topology, self.num_microbatches)
            except ValueError as exc:  # HintError: unknown name, malformed or unrunnable hint file
                raise ValueError(f"--policies {name}: {exc}") from None
        if self.overlap_moe_expert_parallel_comm:
            self._check_pairs()

    def _check_pairs(self) -> None:
        if not self.variability.num_experts or self.variability.expert_parallel < 2:
            raise ValueError("--overlap-moe-expert-parallel-comm needs --num-experts and --expert-model-parallel-size "
                             "> 1 (the all-to-alls a pair overlaps)")
        for name in self.policies:
            hint = policy(name).parsed_hint
            if not _is_strict(name) and hint.name != "default" and hint.split_backward:
                raise ValueError(f"--policies {name}: places W tasks by its own order, which is not built for the "
                                 "pairs of --overlap-moe-expert-parallel-comm; use default, bf, 1f1b or a -strict "
                                 "order")

    def combined_runs(self) -> bool:
        """Megatron's combined 1F1B is simulated beside the policies (it needs virtual stages at PP > 1)."""
        return self.overlap_moe_expert_parallel_comm and (self.num_chunks > 1 or self.pipeline_size == 1)

    def arbiter(self, name: str, limit: Optional[LimitSpec] = None):
        """The ArbiterConfig of policy ``name`` at ``limit`` (a fixed order: its own memory); under
        ``overlap_moe_expert_parallel_comm`` readiness-first ones pair, as the runtime runs them."""
        config = policy(name) if limit is None else policy(name, limit)
        if self.overlap_moe_expert_parallel_comm and not _is_strict(name):
            config = dataclasses.replace(config, pair_forward_backward=True)
        return config


def _is_strict(name: str) -> bool:
    return name.endswith(STRICT_SUFFIX)


def _fixed(name: str) -> bool:
    """A fixed order, run once per seed whatever the buffer limit (its memory is its own)."""
    return _is_strict(name) or name == COMBINED


def run_study(config: StudyConfig, *, progress: bool = True) -> dict:
    """Every policy on every seed at ``config.buffer_limit``; speedups vs strict 1F1B."""
    return run_tradeoff(config, [config.buffer_limit], progress=progress)["studies"][0]


def run_tradeoff(config: StudyConfig, limits: Sequence[LimitSpec], *, progress: bool = True) -> dict:
    """The study at each buffer limit, on the same seeds: readiness-first policies once per
    limit, strict ones once (a fixed order's memory is its own). Returns one report per
    limit under "studies" and, per policy, the (peak in flight, speedup) curve under "curve"."""
    topology = Topology(config.pipeline_size, config.num_chunks)
    m = config.num_microbatches
    resolved = [resolve_buffer_limit(spec, topology, m) for spec in limits]
    combined = [COMBINED] if config.combined_runs() else []
    policies = list(dict.fromkeys([BASELINE, config.baseline, *combined, *config.policies]))  # references always run
    strict = [p for p in policies if _fixed(p)]
    loose = [p for p in policies if not _fixed(p)]
    # a pair can beat the bound, which runs F and B in series: no /LB under the flag
    no_bound = config.overlap_moe_expert_parallel_comm

    def bound_of(name, realization, limit=None) -> float:
        if no_bound or name == COMBINED:
            return math.nan
        return policy_lower_bound(config.arbiter(name, limit), topology, realization)

    def run_fixed(name, realization):
        if name == COMBINED:
            return simulate_combined(topology, m, realization)
        return simulate(config.arbiter(name), topology, m, realization, name=name)

    runs: list[dict[str, list]] = [{name: [] for name in policies} for _ in limits]
    own_bounds: list[dict[str, list]] = [{name: [] for name in policies} for _ in limits]
    bounds, split_bounds = [], []
    seeds = range(config.first_seed, config.first_seed + config.seeds)
    for seed in tqdm(seeds, desc="simulating seeds", disable=not progress, leave=False):
        realization = sample_realization(config.variability, topology, m, seed)
        bounds.append(lower_bound(realization, topology, m))
        split_bounds.append(lower_bound(realization, topology, m, split_backward=True))
        fixed = {name: run_fixed(name, realization) for name in strict}
        fixed_bounds = {name: bound_of(name, realization) for name in strict}
        for index, limit in enumerate(resolved):
            for name in strict:
                runs[index][name].append(fixed[name])
                own_bounds[index][name].append(fixed_bounds[name])
            for name in loose:
                arbiter = config.arbiter(name, limit)
                runs[index][name].append(simulate(arbiter, topology, m, realization, name=name))
                own_bounds[index][name].append(bound_of(name, realization, limit))
    one_x = _one_x(topology, m)
    studies = [_report(config, spec, limit, one_x, seeds, bounds, split_bounds, by_policy, by_policy_bounds)
               for spec, limit, by_policy, by_policy_bounds in zip(limits, resolved, runs, own_bounds)]
    curve = {name: [{"buffer_limit": study["buffer_limit"], "buffer_limit_spec": study["buffer_limit_spec"],
                     "peak_in_flight": study["policies"][name]["peak_in_flight_max"],
                     "memory_vs_megatron": study["policies"][name]["memory_vs_megatron"],
                     "speedup_vs_1f1b_strict": study["policies"][name]["speedup_vs_1f1b_strict"],
                     "speedup_vs_baseline": study["policies"][name]["speedup_vs_baseline"],
                     "makespan_over_lower_bound": study["policies"][name]["makespan_over_lower_bound"]}
                    for study in (studies[:1] if _fixed(name) else studies)]
             for name in policies}
    return {"megatron_peak_in_flight": one_x, "studies": studies, "curve": curve}


def _one_x(topology: Topology, num_microbatches: int) -> Optional[int]:
    try:
        return megatron_peak_in_flight(topology, num_microbatches)
    except ValueError:  # a layout Megatron's interleaved schedule refuses: no 1x reference
        return None


def _report(config: StudyConfig, spec: LimitSpec, limit: int, one_x: Optional[int], seeds, bounds, split_bounds,
            runs: dict[str, list], policy_bounds: dict[str, list]) -> dict:
    megatron = [r.makespan for r in runs[BASELINE]]
    baseline = [r.makespan for r in runs[config.baseline]]
    report = {
        "pipeline_size": config.pipeline_size,
        "num_microbatches": config.num_microbatches,
        "num_chunks": config.num_chunks,
        "buffer_limit": limit,
        "buffer_limit_spec": str(spec),
        "megatron_peak_in_flight": one_x,
        "seeds": list(seeds),
        "baseline": config.baseline,
        "variability": asdict(config.variability),
        "overlap_moe_expert_parallel_comm": config.overlap_moe_expert_parallel_comm,
        "lower_bound_median": median(bounds),
        "lower_bound_split_median": median(split_bounds),
        "policies": {},
    }
    for name, results in runs.items():
        makespans = [r.makespan for r in results]
        peak = max(max(r.peak_in_flight) for r in results)
        report["policies"][name] = {
            "makespan_median": median(makespans),
            "makespan_per_seed": makespans,
            # per-seed ratio on the same realisation, then the median over seeds
            "speedup_vs_1f1b_strict": median([b / m for b, m in zip(megatron, makespans)]),
            "speedup_vs_baseline": median([b / m for b, m in zip(baseline, makespans)]),
            "bubble_fraction_median": median([r.bubble_fraction for r in results]),
            # the bound for this policy's split and memory (sim/bounds.py)
            "makespan_over_lower_bound": median([m / lb for m, lb in zip(makespans, policy_bounds[name])]),
            "peak_in_flight_max": peak,
            "memory_vs_megatron": peak / one_x if one_x else None,
            "busy_per_stage_median": [median([r.busy[s] for r in results]) for s in range(config.pipeline_size)],
        }
    return report


def format_report(report: dict) -> str:
    one_x = report.get("megatron_peak_in_flight")
    memory = f" ({report['buffer_limit'] / one_x:.3g}x Megatron's {one_x})" if one_x else ""
    head = (f"PP={report['pipeline_size']} M={report['num_microbatches']} C={report['num_chunks']} "
            f"limit={report['buffer_limit']}{memory} seeds={len(report['seeds'])}  "
            f"lower bound (median, no memory limit) = {report['lower_bound_median']:.3f}, "
            f"{report['lower_bound_split_median']:.3f} with a split backward")
    other = report.get("baseline", BASELINE) != BASELINE
    extra = f"{'vs ' + report['baseline']:>18}" if other else ""
    optimum = "optimal" in report  # simulate --optimal (optimal.py): makespan / optimum beside /LB
    rows = [head, f"{'policy':<16}{'makespan':>10}{'speedup':>9}{'bubble':>8}" + (f"{'/opt':>7}" if optimum else "")
            + f"{'/LB':>7}{'peak D':>8}{extra}"]
    for name, p in report["policies"].items():
        rows.append(f"{name:<16}{p['makespan_median']:>10.3f}{p['speedup_vs_1f1b_strict']:>8.3f}x"
                    f"{100 * p['bubble_fraction_median']:>7.1f}%"
                    + (f"{p['makespan_over_optimal']:>7.3f}" if optimum else "")
                    + f"{p['makespan_over_lower_bound']:>7.3f}"
                    f"{p['peak_in_flight_max']:>8d}" + (f"{p['speedup_vs_baseline']:>17.3f}x" if other else ""))
    if report.get("overlap_moe_expert_parallel_comm"):
        rows.append("--overlap-moe-expert-parallel-comm: readiness-first policies pair a ready F with a ready B; "
                    "/LB left out (the bound runs F and B in series)" + (
                        "" if COMBINED in report["policies"] else
                        "; Megatron's combined 1F1B needs virtual stages at PP > 1: not simulated"))
    elif optimum:
        from .optimal import format_optimum

        rows.append(format_optimum(report))
    else:
        from .optimal import MAX_TASKS, task_count

        if task_count(Topology(report["pipeline_size"], report["num_chunks"]), report["num_microbatches"],
                      split_backward=True) <= MAX_TASKS:  # a layout --optimal takes
            rows.append("/LB can overstate the room left (a loose bound with interleaving and jitter: "
                        "docs/simulator.md); --optimal prints each policy over the clairvoyant optimum beside it")
    return "\n".join(rows)


def format_tradeoff(tradeoff: dict) -> str:
    """Speedup over strict 1F1B (peak in flight) per policy and buffer limit."""
    studies = tradeoff["studies"]
    first = studies[0]
    one_x = tradeoff["megatron_peak_in_flight"]
    head = (f"PP={first['pipeline_size']} M={first['num_microbatches']} C={first['num_chunks']} "
            f"seeds={len(first['seeds'])}  Megatron's peak in flight (1x) = {one_x}\n"
            f"speedup over strict 1F1B (peak in flight) /makespan over the lower bound, per buffer limit"
            + (f"; speedups over {first['baseline']} in the JSON"
               if first.get("baseline", BASELINE) != BASELINE else ""))
    columns = [f"{s['buffer_limit_spec']}={s['buffer_limit']}" for s in studies]
    rows = [head, f"{'policy':<16}" + "".join(f"{c:>22}" for c in columns)]
    for name, points in tradeoff["curve"].items():
        cells = [f"{p['speedup_vs_1f1b_strict']:.3f}x ({p['peak_in_flight']}) /{p['makespan_over_lower_bound']:.2f}"
                 for p in points]
        if len(cells) == 1 and len(columns) > 1:
            cells = [cells[0] + " fixed"] + [""] * (len(columns) - 1)
        rows.append(f"{name:<16}" + "".join(f"{c:>22}" for c in cells))
    for study in studies:  # simulate --optimal (optimal.py)
        if "optimal" in study:
            from .optimal import format_optimum

            ratios = ", ".join(f"{name} {p['makespan_over_optimal']:.3f}" for name, p in study["policies"].items())
            rows.append(f"{study['buffer_limit_spec']}: {format_optimum(study)}\n  makespan / optimum: {ratios}")
    return "\n".join(rows)


def write_timeline(config: StudyConfig, path: str, *, trace_path: Optional[str] = None) -> str:
    """PNG (and optionally Chrome trace) of every policy on the first seed."""
    from ..trace import plot_timelines, spans_from_simulation, write_chrome_trace

    topology = Topology(config.pipeline_size, config.num_chunks)
    realization = sample_realization(config.variability, topology, config.num_microbatches, config.first_seed)
    runs = {}
    for name in dict.fromkeys([BASELINE, config.baseline, *config.policies]):
        result = simulate(config.arbiter(name, config.buffer_limit), topology, config.num_microbatches, realization,
                          name=name, record_trace=True)
        runs[name] = spans_from_simulation(result.trace)
    if trace_path:
        merged = [s.__class__(s.rank + 1000 * i, s.name, s.category, s.start, s.end)
                  for i, spans in enumerate(runs.values()) for s in spans]
        labels = {1000 * i + r: f"{name} stage {r}" for i, name in enumerate(runs)
                  for r in range(config.pipeline_size)}
        write_chrome_trace(merged, trace_path, rank_labels=labels, metadata={"simulated": True})
    return plot_timelines(runs, path, title=f"simulated seed {config.first_seed} (time in units of f0)",
                          time_unit="f0")


def save_json(report: dict, path: str) -> None:
    """A report as indented JSON at ``path`` (its folder made): ``simulate --json`` and ``bench``'s bench.json."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2)
