"""Task times measured on a device as a source of realisations (``simulate --task-times FILE``).

``scripts/measure_task_times.py`` times F, B (the whole backward), I (the input-gradient half
of a split backward) and W (its weight-gradient half) of one real megatron-core stage over
many microbatches, per workload. Here each simulated task takes the time of a measured
microbatch instead of the compute model of ``variability.py``, so the same policies and the
same simulator run on the kernels' own variability:

* stage 0 draws from the workload's "first" stage when it has one (the multimodal encoder
  stage), every other stage from its "middle" stage;
* a stage whose covariate is the microbatch's data and varies (tokens under variable
  sequence lengths, images) draws one measured microbatch per simulated microbatch, the same
  on every stage (a long microbatch is long everywhere; its kernel jitter is then common to
  the stages too); otherwise each (stage, chunk, microbatch) draws on its own;
* a split backward takes the measured I and W (not half of B each);
* with C chunks per stage each chunk takes 1/C of the drawn stage time.

Units: f0 = the median measured F of the workload's middle stage (``TaskTimes.ms_per_f0``
converts back to milliseconds), so figures compare with the j0-j3 model's. Message latencies
still come from ``--c50`` / ``--sigma-msg`` (nothing here measures communication), a
``--straggler-stage`` still slows its stage; the knobs the file replaces are refused.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..policy.topology import Topology

FORMAT = "megatron-rrfp-task-times"
KINDS = ("F", "B", "I", "W")
DEFAULT_WORKLOAD = "gpt"
WRITER = "scripts/measure_task_times.py"
REPLACED = {
    "sigma_compute": "--sigma-compute (--reference sets it; its message latency is --c50 0.1 --sigma-msg 1.5)",
    "backward_ratio": "--backward-ratio", "seq_len_sigma": "--seq-len-sigma",
    "images_per_sample": "--images-per-sample", "encoder_time_per_image": "--encoder-time",
    "image_token_share": "--image-token-share",
    "num_experts": "--num-experts", "a2a_time": "--a2a-time",
}
"""Variability fields whose effect the measured times already hold, with their flags."""


@dataclass(frozen=True, slots=True)
class StageTimes:
    """One measured stage: per kind, the times of its microbatches (ms, in measured order)."""

    times: dict
    covariate: str
    values: np.ndarray
    """The covariate per microbatch (tokens, images or expert load imbalance)."""
    shared: bool
    """Drawn once per microbatch for every stage: the covariate is the data's and it varies."""

    def __len__(self) -> int:
        return len(self.times["F"])


@dataclass(frozen=True, slots=True)
class TaskTimes:
    """One workload of a task-times file."""

    path: str
    workload: str
    description: str
    metadata: dict
    middle: StageTimes
    first: Optional[StageTimes] = None

    @property
    def ms_per_f0(self) -> float:
        """Milliseconds per simulated time unit: the median F of the middle stage."""
        return float(np.median(self.middle.times["F"]))

    def stage(self, index: int) -> StageTimes:
        return self.first if index == 0 and self.first is not None else self.middle


def _error(path: str, what: str) -> ValueError:
    return ValueError(f"--task-times {path}: {what} (write it with {WRITER})")


@functools.lru_cache(maxsize=8)
def load_task_times(path: str, workload: Optional[str] = None) -> TaskTimes:
    """The named workload (default: gpt, else the file's first) of a file ``measure_task_times``
    wrote. Every error is a ValueError naming --task-times (or --task-times-workload)."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except OSError as exc:
        raise _error(path, f"cannot read it ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _error(path, f"not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != 1:
        raise _error(path, f"not a task-times file (format {FORMAT!r} version 1 expected)")
    if data.get("units") != "ms":
        raise _error(path, f"units must be 'ms', got {data.get('units')!r}")
    workloads = data.get("workloads")
    if not isinstance(workloads, dict) or not workloads:
        raise _error(path, "no workloads")
    name = workload or (DEFAULT_WORKLOAD if DEFAULT_WORKLOAD in workloads else next(iter(workloads)))
    if name not in workloads:
        raise ValueError(f"--task-times-workload {name}: not in --task-times {path}, which holds "
                         f"{', '.join(workloads)}")
    stages = workloads[name].get("stages") if isinstance(workloads[name], dict) else None
    if not isinstance(stages, dict) or "middle" not in stages:
        raise _error(path, f"workload {name} has no middle stage")
    roles = {role: _stage_times(path, f"{name}/{role}", stages[role]) for role in ("middle", "first") if role in stages}
    if not roles["middle"].times["F"].min() > 0:
        raise _error(path, f"{name}/middle: a forward time <= 0")
    return TaskTimes(path=path, workload=name, description=str(workloads[name].get("description", "")),
                     metadata=dict(data.get("metadata") or {}), **roles)


def _stage_times(path: str, where: str, record) -> StageTimes:
    if not isinstance(record, dict):
        raise _error(path, f"{where} is not an object")
    times = {}
    for kind in KINDS:
        values = record.get(kind)
        if not isinstance(values, list) or not values or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
                for x in values):
            raise _error(path, f"{where}: {kind} must be a non-empty list of finite times >= 0 (ms)")
        times[kind] = np.asarray(values, dtype=float)
    counts = {kind: len(values) for kind, values in times.items()}
    if len(set(counts.values())) != 1:
        raise _error(path, f"{where}: one time per microbatch for every kind, got {counts}")
    covariate = record.get("covariate")
    values = record.get(covariate) if isinstance(covariate, str) else None
    if not isinstance(values, list) or len(values) != counts["F"]:
        raise _error(path, f"{where}: its covariate ({covariate!r}) needs one value per microbatch")
    values = np.asarray(values, dtype=float)
    shared = bool(record.get("shared_across_stages")) and len(np.unique(values)) > 1
    return StageTimes(times=times, covariate=covariate, values=values, shared=shared)


def check_variability(v, default) -> None:
    """``v.task_times`` readable and not combined with a knob the file replaces (ValueError);
    ``v`` a ``Variability``, ``default`` its default instance (this module does not import it:
    ``variability.py`` calls here)."""
    if v.task_times is None:
        raise ValueError(f"--task-times-workload {v.task_times_workload} needs --task-times FILE")
    load_task_times(v.task_times, v.task_times_workload)
    clashes = [flag for name, flag in REPLACED.items() if getattr(v, name) != getattr(default, name)]
    if clashes:
        raise ValueError(f"--task-times replaces the compute model: drop {', '.join(clashes)}")


def measured_tables(v, topology: Topology, num_microbatches: int, seed: int) -> dict[str, np.ndarray]:
    """One seed's F / B / I / W durations [stage, chunk, microbatch] drawn from the measured times
    of ``v.task_times`` (see the module docstring), in units of f0; ``v`` a ``Variability``."""
    times = load_task_times(v.task_times, v.task_times_workload)
    pp, chunks, m = topology.num_stages, topology.num_chunks, num_microbatches
    rng = np.random.default_rng([seed, 2])
    roles = [r for r in (times.middle, times.first) if r is not None]
    per_microbatch = {id(r): rng.integers(len(r), size=m) for r in roles if r.shared}
    scale = v.f0 / times.ms_per_f0 / chunks
    tables = {kind: np.empty((pp, chunks, m)) for kind in KINDS}
    for s in range(pp):
        role = times.stage(s)
        index = per_microbatch.get(id(role))
        index = np.broadcast_to(index, (chunks, m)) if index is not None else rng.integers(len(role), size=(chunks, m))
        factor = v.straggler_factor if s == v.straggler_stage else 1.0
        for kind in KINDS:
            tables[kind][s] = role.times[kind][index] * scale * factor
    return tables


def spread(values) -> float:
    """(p95 - p5) / p50: the paper's measure of variability."""
    p5, p50, p95 = np.percentile(np.asarray(values, dtype=float), [5, 50, 95])
    return float((p95 - p5) / p50) if p50 else math.nan


def describe(times: TaskTimes) -> str:
    """Two lines for ``simulate``'s output: where the times come from and how much they vary."""
    meta = times.metadata
    head = (f"task times: {times.path}, workload {times.workload} ({meta.get('device_name', '?')}, "
            f"{meta.get('device', '?')}, {meta.get('dtype', '?')}, megatron-core {meta.get('megatron_core', '?')}); "
            f"1 f0 = {times.ms_per_f0:.4g} ms (the middle stage's median F)")
    roles = [("first", times.first), ("middle", times.middle)]
    cells = []
    for role, stage in roles:
        if stage is None:
            continue
        ratios = ", ".join(f"{k} {np.median(stage.times[k]) / times.ms_per_f0:.2f}" for k in KINDS)
        spreads = ", ".join(f"{k} {spread(stage.times[k]):.2f}" for k in KINDS)
        cells.append(f"{role} stage ({len(stage)} microbatches): median / f0 {ratios}; (p95-p5)/p50 {spreads}")
    return "\n".join([head, *cells])


__all__ = ["FORMAT", "KINDS", "StageTimes", "TaskTimes", "check_variability", "describe", "load_task_times",
           "measured_tables", "spread"]
