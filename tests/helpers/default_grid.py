"""Is ``default`` the best shipped policy? One grid cell: every named hint and ``default`` on
the same seeds, medians of makespans (``scripts/sim_default_grid.py`` and
``scripts/sim_default_seeds.py`` sweep the grid, ``tests/unit/test_policy.py`` checks a subset).

A cell is (PP, chunks, buffer limit, workload, whether the backward can split). ``default``
is compared with the best *allowed* named hint (``bfw`` and ``zbh1`` need the split; ``gpipe``
needs room for all M x C forwards) and with Megatron's own order run strictly. ``auto`` on a
device with room for 4x is the 4x cell: the simulator runs the limit ``auto`` resolves to.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_rrfp.policy.arbiter import ArbiterConfig
from megatron_rrfp.policy.hints import HintError
from megatron_rrfp.policy.plan import Plan
from megatron_rrfp.policy.topology import Topology
from megatron_rrfp.sim.simulator import median, simulate
from megatron_rrfp.sim.variability import VARIABILITY_LEVELS, Variability, sample_realization

NAMED_HINTS = ("bf", "bfw", "zbh1", "1f1b", "gpipe")
SPLIT_ONLY = ("bfw", "zbh1")
_MOE = dict(num_experts=8, moe_skew=1.0, moe_concentration=20.0, moe_share=0.5, a2a_time=0.1)
WORKLOADS = {
    **{level: dict(knobs) for level, knobs in VARIABILITY_LEVELS.items()},
    # docs/simulator.md's multimodal and docs/moe.md's MoE settings, on top of j3
    "multimodal": dict(VARIABILITY_LEVELS["j3"], images_per_sample=1.0, encoder_time_per_image=0.5,
                       image_token_share=0.6),
    **{f"moe-ep{ep}": dict(VARIABILITY_LEVELS["j3"], expert_parallel=ep, **_MOE) for ep in (2, 4, 8)},
    "straggler": dict(VARIABILITY_LEVELS["j3"], straggler_factor=1.3),  # stage PP // 2
    "seq-len": dict(VARIABILITY_LEVELS["j3"], seq_len_sigma=0.5),
}


def workload(name: str, pipeline_size: int) -> Variability:
    knobs = dict(WORKLOADS[name])
    if name == "straggler":
        knobs["straggler_stage"] = pipeline_size // 2
    return Variability(**knobs)


@dataclass(frozen=True, slots=True)
class Cell:
    pipeline_size: int
    num_chunks: int
    buffer_limit: str
    workload: str
    split_backward_ok: bool
    makespans: dict  # policy -> median makespan over the seeds ("1f1b-strict" included)

    @property
    def best_named(self) -> tuple[str, float]:
        named = {k: v for k, v in self.makespans.items() if k in NAMED_HINTS}
        name = min(named, key=named.get)
        return name, named[name]

    @property
    def default_over_best(self) -> float:
        """default's median makespan / the best named hint's (the target: <= 1.01)."""
        return self.makespans["default"] / self.best_named[1]

    @property
    def default_over_strict(self) -> float:
        """default's median makespan / strict Megatron's (<= 1)."""
        return self.makespans["default"] / self.makespans["1f1b-strict"]

    def describe(self) -> str:
        best, _ = self.best_named
        base = self.makespans["1f1b-strict"]
        speedups = " ".join(f"{k}={base / v:.3f}" for k, v in self.makespans.items() if k != "1f1b-strict")
        return (f"PP{self.pipeline_size:<2} C{self.num_chunks} {self.buffer_limit:>5} {self.workload:<10} "
                f"{'split' if self.split_backward_ok else 'nosplit':<7} {speedups}  best={best} "
                f"default/best={self.default_over_best:.3f} default/strict={self.default_over_strict:.3f}")


def evaluate(pipeline_size: int, num_chunks: int, buffer_limit: str, workload_name: str, *, seeds: int = 3,
             split_backward_ok: bool = True, num_microbatches: int | None = None) -> Cell:
    """Every allowed named hint, ``default`` and strict 1F1B on ``seeds`` shared realisations."""
    topology = Topology(pipeline_size, num_chunks)
    m = num_microbatches or 4 * pipeline_size
    variability = workload(workload_name, pipeline_size)
    configs = {"1f1b-strict": ArbiterConfig(hint="1f1b", strict=True)}
    for name in ("default", *NAMED_HINTS):
        if not split_backward_ok and name in SPLIT_ONLY:
            continue
        config = ArbiterConfig(hint=name, buffer_limit=buffer_limit, split_backward_ok=split_backward_ok)
        try:
            Plan.build(config, topology, m)
        except HintError:  # gpipe below room for all its forwards: refused, not shipped there
            continue
        configs[name] = config
    runs: dict[str, list[float]] = {name: [] for name in configs}
    for seed in range(seeds):
        realization = sample_realization(variability, topology, m, seed)
        for name, config in configs.items():
            runs[name].append(simulate(config, topology, m, realization).makespan)
    return Cell(pipeline_size, num_chunks, buffer_limit, workload_name, split_backward_ok,
                {name: median(values) for name, values in runs.items()})


__all__ = ["NAMED_HINTS", "WORKLOADS", "Cell", "evaluate", "workload"]
