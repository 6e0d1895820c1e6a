"""Discrete-event pipeline simulator: the policy's own dry run (``policy/dryrun.py``) with
sampled durations and message latencies (``variability.py``). It drives the *same*
``Arbiter`` as the executor, so what it predicts is what the executor decides.

Units: everything is in units of ``f0``, the nominal forward time of one stage.
"""
from __future__ import annotations

import math

import numpy as np

from ..policy.actions import Kind, Task
from ..policy.arbiter import DEFAULT_BUFFER_LIMIT, ArbiterConfig
from ..policy.budget import LimitSpec
from ..policy.dryrun import DeadlockError, DryRun, run
from ..policy.plan import Plan
from ..policy.topology import Topology
from .variability import Realization

SimResult = DryRun


def simulate(config: ArbiterConfig, topology: Topology, num_microbatches: int, realization: Realization,
             *, name: str | None = None, record_trace: bool = False) -> SimResult:
    """Run one iteration; raises DeadlockError if the policy stalls with work left."""
    plan = Plan.build(config, topology, num_microbatches)
    split = plan.split_backward

    def latency(stage: int, task: Task) -> float:
        table = realization.activation_latency if task.kind is Kind.F else realization.gradient_latency
        return table[stage][task.chunk][task.microbatch]

    return run(plan.arbiters(), topology, duration=lambda stage, task: realization.duration(stage, task, split),
               latency=latency, name=name or config.parsed_hint.name, record_trace=record_trace,
               pair_duration=realization.pair_duration)


# -- policies compared by `megatron-rrfp simulate` -------------------------------------

STRICT_SUFFIX = "-strict"
BASELINE = "1f1b" + STRICT_SUFFIX
"""Megatron's own order, run as a fixed order: every speedup is measured against it."""


def policy(spec: str, buffer_limit: LimitSpec = DEFAULT_BUFFER_LIMIT) -> ArbiterConfig:
    """'default', 'bf', 'bfw', '1f1b', 'zbh1', 'gpipe', a hint file (readiness-first) or
    '<hint>-strict' (fixed order); ``buffer_limit`` an int or a multiple of Megatron's
    peak ("1x")."""
    strict = spec.endswith(STRICT_SUFFIX)
    return ArbiterConfig(hint=spec[: -len(STRICT_SUFFIX)] if strict else spec, buffer_limit=buffer_limit,
                         strict=strict)


def median(values) -> float:
    return float(np.median(values)) if len(values) else math.nan


__all__ = ["BASELINE", "DeadlockError", "SimResult", "median", "policy", "simulate"]
