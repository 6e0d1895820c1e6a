"""`megatron-rrfp simulate`: compare policies over K seeds of the same variability."""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import ClassVar, Optional

from tqdm import tqdm

from ..checks import Bound, check_fields, integer
from ..policy.arbiter import DEFAULT_BUFFER_LIMIT
from ..policy.plan import Plan
from ..policy.topology import Topology
from .bounds import lower_bound
from .simulator import BASELINE, median, policy, simulate
from .variability import Variability, sample_realization

DEFAULT_POLICIES = ("1f1b-strict", "1f1b", "bf", "bfw")


@dataclass(kw_only=True, slots=True)
class StudyConfig:
    """One simulated study."""

    pipeline_size: int = 8
    num_microbatches: int = 32
    num_chunks: int = 1
    policies: Sequence[str] = DEFAULT_POLICIES
    """Policy names: bf, bfw, 1f1b, gpipe or a hint file; '-strict' suffix = fixed order."""
    buffer_limit: int = DEFAULT_BUFFER_LIMIT
    seeds: int = 5
    first_seed: int = 0
    variability: Variability = field(default_factory=Variability)

    BOUNDS: ClassVar[dict[str, Bound]] = {
        "pipeline_size": integer(1, 1024), "num_microbatches": integer(1, 100_000), "num_chunks": integer(1, 64),
        "buffer_limit": integer(1), "seeds": integer(1, 100_000), "first_seed": integer(0, 2**32 - 1),
    }
    FLAGS: ClassVar[dict[str, str]] = {
        "pipeline_size": "--pp", "num_microbatches": "--microbatches", "num_chunks": "--chunks",
        "buffer_limit": "--buffer-limit", "seeds": "--seeds", "first_seed": "--first-seed",
    }
    MAX_TASKS = 10_000_000
    """Stages x chunks x microbatches: more would not fit one seed's durations in memory."""

    def __post_init__(self) -> None:
        """Every value, the layout and every policy's plan, before anything is simulated."""
        check_fields(self, self.BOUNDS, self.FLAGS)
        tasks = self.pipeline_size * self.num_chunks * self.num_microbatches
        if tasks > self.MAX_TASKS:
            raise ValueError(f"--pp x --chunks x --microbatches = {tasks} tasks per stage set; at most "
                             f"{self.MAX_TASKS} fit one seed's durations in memory")
        if isinstance(self.policies, str) or not self.policies or not all(isinstance(p, str) and p
                                                                          for p in self.policies):
            raise ValueError(f"--policies must be a comma list of policy names, got {self.policies!r}")
        self.variability.check_layout(self.pipeline_size)
        topology = Topology(self.pipeline_size, self.num_chunks)
        for name in dict.fromkeys([BASELINE, *self.policies]):
            try:
                Plan.build(policy(name, self.buffer_limit), topology, self.num_microbatches)
            except ValueError as exc:  # HintError: unknown name, malformed or unrunnable hint file
                raise ValueError(f"--policies {name}: {exc}") from None


def run_study(config: StudyConfig, *, progress: bool = True) -> dict:
    topology = Topology(config.pipeline_size, config.num_chunks)
    policies = list(dict.fromkeys([BASELINE, *config.policies]))  # the baseline is always measured
    runs: dict[str, list] = {name: [] for name in policies}
    bounds, split_bounds = [], []
    seeds = range(config.first_seed, config.first_seed + config.seeds)
    for seed in tqdm(seeds, desc="simulating seeds", disable=not progress, leave=False):
        realization = sample_realization(config.variability, topology, config.num_microbatches, seed)
        bounds.append(lower_bound(realization, topology, config.num_microbatches))
        split_bounds.append(lower_bound(realization, topology, config.num_microbatches, split_backward=True))
        for name in policies:
            runs[name].append(simulate(policy(name, config.buffer_limit), topology,
                                       config.num_microbatches, realization, name=name))
    baseline = [r.makespan for r in runs[BASELINE]]
    report = {
        "pipeline_size": config.pipeline_size,
        "num_microbatches": config.num_microbatches,
        "num_chunks": config.num_chunks,
        "buffer_limit": config.buffer_limit,
        "seeds": list(seeds),
        "variability": asdict(config.variability),
        "lower_bound_median": median(bounds),
        "lower_bound_split_median": median(split_bounds),
        "policies": {},
    }
    for name, results in runs.items():
        makespans = [r.makespan for r in results]
        split = results[0].orders and any(t.kind.value == "W" for t in results[0].orders[0])
        own_bounds = split_bounds if split else bounds
        report["policies"][name] = {
            "makespan_median": median(makespans),
            "makespan_per_seed": makespans,
            # per-seed ratio on the same realisation, then the median over seeds
            "speedup_vs_1f1b_strict": median([b / m for b, m in zip(baseline, makespans)]),
            "bubble_fraction_median": median([r.bubble_fraction for r in results]),
            "makespan_over_lower_bound": median([m / lb for m, lb in zip(makespans, own_bounds)]),
            "peak_in_flight_max": max(max(r.peak_in_flight) for r in results),
            "busy_per_stage_median": [median([r.busy[s] for r in results]) for s in range(config.pipeline_size)],
        }
    return report


def format_report(report: dict) -> str:
    head = (f"PP={report['pipeline_size']} M={report['num_microbatches']} C={report['num_chunks']} "
            f"limit={report['buffer_limit']} seeds={len(report['seeds'])}  "
            f"lower bound (median) = {report['lower_bound_median']:.3f}")
    rows = [head, f"{'policy':<16}{'makespan':>10}{'speedup':>9}{'bubble':>8}{'/LB':>7}{'peak D':>8}"]
    for name, p in report["policies"].items():
        rows.append(f"{name:<16}{p['makespan_median']:>10.3f}{p['speedup_vs_1f1b_strict']:>8.3f}x"
                    f"{100 * p['bubble_fraction_median']:>7.1f}%{p['makespan_over_lower_bound']:>7.3f}"
                    f"{p['peak_in_flight_max']:>8d}")
    return "\n".join(rows)


def write_timeline(config: StudyConfig, path: str, *, trace_path: Optional[str] = None) -> str:
    """PNG (and optionally Chrome trace) of every policy on the first seed."""
    from ..trace import plot_timelines, spans_from_simulation, write_chrome_trace

    topology = Topology(config.pipeline_size, config.num_chunks)
    realization = sample_realization(config.variability, topology, config.num_microbatches, config.first_seed)
    runs = {}
    for name in dict.fromkeys([BASELINE, *config.policies]):
        result = simulate(policy(name, config.buffer_limit), topology, config.num_microbatches, realization,
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
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2)
