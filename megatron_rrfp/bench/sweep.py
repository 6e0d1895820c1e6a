"""What one `megatron-rrfp bench` runs: its schedules, each readiness-first RRFP schedule
once per buffer limit (`--buffer-limit 1x,1.5x,2x`), fixed orders once (their memory is
their own); and, with several limits, the measured speedup-vs-memory trade-off in the
shape the simulator's curve uses (sim/curve.py draws both).

torch-free: the parent process plans and reports; the ranks run what ``bench_runs`` lists.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..policy.arbiter import ArbiterConfig
from ..policy.budget import LimitSpec

# Each bench schedule and the simulator policy it runs: RRFP's runtime takes the same
# ArbiterConfig (sim.simulator.policy), so the "sim" column predicts exactly what ran.
SIM_POLICY = {
    "megatron-1f1b": "1f1b-strict",  # megatron-core's own schedule (interleaved with --chunks > 1)
    "rrfp-strict": "1f1b-strict",  # Megatron's order, run as a fixed order in RRFP's runtime
    "rrfp-default": "default",  # the project's default policy (what --rrfp-hint default gives)
    "rrfp-bf": "bf",
    "rrfp-bfw": "bfw",
    "rrfp-zbh1": "zbh1",  # readiness-first with the zero-bubble ZB-H1 order as its hint
    "rrfp-zbh1-strict": "zbh1-strict",  # ZB-H1 as a fixed order: the zero-bubble baseline
}
BENCH_SCHEDULES = tuple(SIM_POLICY)
# The project's claim at equal memory, against Megatron and both fixed-order baselines.
DEFAULT_SCHEDULES = ("megatron-1f1b", "rrfp-strict", "rrfp-default", "rrfp-bf", "rrfp-zbh1-strict")
DEMO_SCHEDULES = ("megatron-1f1b", "rrfp-strict", "rrfp-default")
FIXED_ORDER = ("megatron-1f1b", "rrfp-strict", "rrfp-zbh1-strict")
"""Schedules that run one order whatever the buffer limit: run once, ``buffer_limit`` null."""


@dataclass(frozen=True, slots=True)
class BenchRun:
    """One measured series: a schedule at one buffer limit."""

    key: str
    """Its name in per-rank results, traces and the table: the schedule, plus "@<limit>" when
    the bench sweeps several limits."""
    schedule: str
    limit: LimitSpec
    """The limit RRFP's runtime is given (a fixed order ignores it)."""
    swept: bool
    """False for fixed orders: the limit does not apply (reported as null)."""

    def arbiter(self) -> ArbiterConfig:
        from ..sim.simulator import policy

        return policy(SIM_POLICY[self.schedule], self.limit)


def limit_list(buffer_limit: LimitSpec | Sequence[LimitSpec]) -> list[LimitSpec]:
    return list(buffer_limit) if isinstance(buffer_limit, (list, tuple)) else [buffer_limit]


def bench_runs(schedules: Sequence[str], buffer_limit: LimitSpec | Sequence[LimitSpec]) -> list[BenchRun]:
    """Each schedule in the given order; a readiness-first one once per limit. Fixed orders
    get the first limit (today's single-limit behaviour; they ignore it)."""
    limits = limit_list(buffer_limit)
    sweep = len(limits) > 1
    runs = []
    for schedule in schedules:
        if schedule in FIXED_ORDER:
            runs.append(BenchRun(key=schedule, schedule=schedule, limit=limits[0], swept=False))
        else:
            runs.extend(BenchRun(key=f"{schedule}@{limit}" if sweep else schedule, schedule=schedule, limit=limit,
                                 swept=True) for limit in limits)
    return runs


def tradeoff_section(config, runs: list[dict], megatron_in_flight: int, megatron_bytes: int) -> dict:
    """The measured trade-off, shaped like ``sim.study.run_tradeoff``'s (``megatron_peak_in_flight``,
    ``studies``, ``curve``: per schedule its points in limit order), plus ``axes`` telling
    ``sim.curve.plot_tradeoff`` to draw measured speedup over peak activation MB."""
    from .emulation import draw_seed

    seeds = [draw_seed(config.seed, i) for i in range(config.warmup, config.warmup + config.iterations)]  # replica 0
    studies = [{"buffer_limit_spec": str(limit), "pipeline_size": config.pipeline_size,
                "num_microbatches": config.num_microbatches, "num_chunks": config.num_chunks, "seeds": seeds,
                "iterations": config.iterations} for limit in limit_list(config.buffer_limit)]
    curve: dict[str, list[dict]] = {}
    for run in runs:
        peak_bytes = run["peak_activation_bytes"]["max_over_ranks"]
        curve.setdefault(run["schedule"], []).append({
            "buffer_limit_spec": run["buffer_limit_spec"],
            "buffer_limit": run["buffer_limit"]["per_stage"] if run["buffer_limit"] else None,
            "peak_in_flight": run["peak_in_flight"]["max_over_ranks"],
            "peak_activation_mb": peak_bytes / 1e6,
            "memory_vs_megatron": run["activation_memory_vs_megatron_1f1b"],
            "speedup_vs_megatron_1f1b": run["speedup_vs_megatron_1f1b"],
            "simulated_speedup": run["simulated_speedup"],
            "iteration_time_s": run["iteration_time_s"]["median"],
        })
    title = (f"measured: {config.model} PP={config.pipeline_size} M={config.num_microbatches} "
             f"C={config.num_chunks} {config.variability}, median of {config.iterations} iterations")
    return {"megatron_peak_in_flight": megatron_in_flight, "megatron_peak_activation_mb": megatron_bytes / 1e6,
            "axes": {"x": "peak_activation_mb", "y": "speedup_vs_megatron_1f1b", "title": title},
            "fixed_order": [name for name in curve if name in FIXED_ORDER],
            "studies": studies, "curve": curve}

