"""Discrete-event pipeline simulator driving the *same* ``Arbiter`` as the executor.

Model: PP stages x M microbatches (x C chunks); a stage runs one task at a time; a task
is ready when its inputs arrived (topology.py); every produced activation/gradient is a
message that arrives ``latency`` after its task finished, FIFO per directed link (one
stream per neighbour pair, as in the real transport). Durations and latencies are drawn
once per seed (``sample_realization``) and shared by every policy, so policies are
compared on exactly the same run-time variability.

Units: everything is in units of ``f0``, the nominal forward time of one stage.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .actions import Kind, Task
from .arbiter import Arbiter, ArbiterConfig
from .topology import Topology


@dataclass(kw_only=True, slots=True)
class Variability:
    """Duration model. F = f0*LogNormal(0, sigma_compute), B = backward_ratio * f0 * LogNormal(0, sigma_compute)
    per (stage, chunk, microbatch); split backward (BFW): B and W are each half of that."""

    f0: float = 1.0
    """Nominal forward time of a whole stage (all its chunks), in seconds or any unit."""
    backward_ratio: float = 2.0
    """Backward time / forward time."""
    sigma_compute: float = 0.0
    """Log-normal sigma of compute jitter (0.3 = the paper's reference J3 level)."""
    straggler_stage: Optional[int] = None
    """Stage whose every task is slowed by ``straggler_factor``."""
    straggler_factor: float = 1.0
    seq_len_sigma: float = 0.0
    """Per-microbatch length factor LogNormal(0, seq_len_sigma); durations scale with tokens."""
    images_per_sample: float = 0.0
    """Mean of Poisson images per microbatch (multimodal); each adds encoder time on stage 0."""
    encoder_time_per_image: float = 0.0
    """Extra stage-0 forward time per image, in units of f0 (backward: backward_ratio x)."""
    image_token_share: float = 0.0
    """Average share of decoder tokens that are image tokens (LLaVA-style: each image adds
    tokens to the sequence): every stage's work for microbatch j scales with
    (1 - share) + share * n_j / mean(n), n_j its images."""
    c50: float = 0.0
    """Median message latency, in units of f0 (0.1 = the paper's reference)."""
    sigma_msg: float = 0.0
    """Log-normal sigma of message latency (1.5 = the paper's reference)."""

    def __post_init__(self) -> None:
        for name in ("f0", "backward_ratio", "straggler_factor"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("sigma_compute", "seq_len_sigma", "images_per_sample", "encoder_time_per_image",
                     "c50", "sigma_msg"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.image_token_share < 1:
            raise ValueError(f"image_token_share must be in [0, 1), got {self.image_token_share}")


REFERENCE_J3 = dict(sigma_compute=0.3, c50=0.1, sigma_msg=1.5)
"""The paper's reference variability: sigma_c = 0.3, c50 = 0.1 f0, sigma_m = 1.5."""


@dataclass(slots=True)
class Realization:
    """One seed's draw: durations [stage][chunk][mb] and latencies of each sent message."""

    forward: list
    backward_total: list
    activation_latency: list
    gradient_latency: list

    def duration(self, stage: int, task: Task, split_backward: bool) -> float:
        if task.kind is Kind.F:
            return self.forward[stage][task.chunk][task.microbatch]
        full = self.backward_total[stage][task.chunk][task.microbatch]
        return full / 2 if split_backward else full


def sample_realization(variability: Variability, topology: Topology, num_microbatches: int,
                       seed: int) -> Realization:
    v, pp, chunks, m = variability, topology.num_stages, topology.num_chunks, num_microbatches
    rng = np.random.default_rng(seed)
    shape = (pp, chunks, m)
    per_chunk = v.f0 / chunks
    forward = per_chunk * rng.lognormal(0.0, v.sigma_compute, shape) if v.sigma_compute else np.full(shape, per_chunk)
    backward = v.backward_ratio * per_chunk * (
        rng.lognormal(0.0, v.sigma_compute, shape) if v.sigma_compute else np.ones(shape))
    if v.seq_len_sigma:
        length = rng.lognormal(0.0, v.seq_len_sigma, m)
        length /= length.mean()  # keep the mean work per microbatch at f0
        forward *= length
        backward *= length
    if v.straggler_stage is not None:
        if not 0 <= v.straggler_stage < pp:
            raise ValueError(f"straggler_stage {v.straggler_stage} outside 0..{pp - 1}")
        forward[v.straggler_stage] *= v.straggler_factor
        backward[v.straggler_stage] *= v.straggler_factor
    if v.images_per_sample:
        images = rng.poisson(v.images_per_sample, m)
        if v.image_token_share:
            tokens = (1 - v.image_token_share) + v.image_token_share * images / v.images_per_sample
            forward *= tokens
            backward *= tokens
        encoder = v.encoder_time_per_image * v.f0 * images
        forward[0, 0] += encoder
        backward[0, 0] += v.backward_ratio * encoder
    latency = (lambda: v.c50 * v.f0 * rng.lognormal(0.0, v.sigma_msg, shape)) if v.c50 else (lambda: np.zeros(shape))
    return Realization(forward.tolist(), backward.tolist(), latency().tolist(), latency().tolist())


@dataclass(slots=True)
class SimResult:
    policy: str
    makespan: float
    busy: list[float]
    peak_in_flight: list[int]
    orders: list[list[Task]]
    trace: list[tuple[int, Task, float, float]] = field(default_factory=list)

    @property
    def bubble_fraction(self) -> float:
        """1 - (sum of stage busy time) / (stages x makespan): the idle share of the pipeline."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


class DeadlockError(RuntimeError):
    pass


def lower_bound(realization: Realization, topology: Topology, num_microbatches: int,
                split_backward: bool = False) -> float:
    """LB = max_s [ sum_{i<s} min_j F_i^j + sum_j (F_s^j + B_s^j (+W_s^j)) + sum_{i<s} min_j B_i^j ].

    Stage s cannot start before the cheapest forward reached it, must run all its own work,
    and the last gradient must still travel back to stage 0. With a split backward the
    trip back only needs the input-gradient half B (W is off the critical path). Latency is
    ignored (it only lowers the bound). F_s^j / B_s^j sum over the stage's chunks.
    """
    forward_totals = [[sum(realization.forward[s][c][j] for c in range(topology.num_chunks))
                       for j in range(num_microbatches)] for s in range(topology.num_stages)]
    backward_totals = [[sum(realization.backward_total[s][c][j] for c in range(topology.num_chunks))
                        for j in range(num_microbatches)] for s in range(topology.num_stages)]
    best, head, tail = 0.0, 0.0, 0.0
    for s in range(topology.num_stages):
        best = max(best, head + sum(forward_totals[s]) + sum(backward_totals[s]) + tail)
        head += min(forward_totals[s])
        tail += min(backward_totals[s]) / (2 if split_backward else 1)
    return best


_ARRIVE, _FINISH = 0, 1


def simulate(config: ArbiterConfig, topology: Topology, num_microbatches: int, realization: Realization,
             *, name: Optional[str] = None, record_trace: bool = False) -> SimResult:
    """Run one iteration; raises DeadlockError if the policy stalls with work left."""
    pp, m = topology.num_stages, num_microbatches
    arbiters = [Arbiter(config, stage=s, topology=topology, num_microbatches=m) for s in range(pp)]
    split = arbiters[0].split_backward
    ready: list[set[Task]] = [set() for _ in range(pp)]
    forward_done: list[set[tuple[int, int]]] = [set() for _ in range(pp)]
    grad_arrived: list[set[tuple[int, int]]] = [set() for _ in range(pp)]
    busy_until: list[Optional[float]] = [None] * pp
    busy = [0.0] * pp
    link_clear: dict[tuple[int, int], float] = {}
    trace: list[tuple[int, Task, float, float]] = []
    events: list = []
    seq = 0

    def push(time: float, kind: int, stage: int, payload) -> None:
        nonlocal seq
        heapq.heappush(events, (time, seq, kind, stage, payload))
        seq += 1

    def send(src: int, dst_stage: int, time: float, latency: float, payload) -> None:
        link = (src, dst_stage)
        arrival = time if src == dst_stage else max(time + latency, link_clear.get(link, 0.0))
        link_clear[link] = arrival  # FIFO: a message never overtakes an earlier one on its link
        push(arrival, _ARRIVE, dst_stage, payload)

    def mark_backward_ready(stage: int, mb: int, chunk: int) -> None:
        key = (mb, chunk)
        if key in forward_done[stage] and key in grad_arrived[stage]:
            ready[stage].add(Task(Kind.B, mb, chunk))

    for mb in range(m):
        ready[0].add(Task(Kind.F, mb, 0))

    def finish(stage: int, task: Task, time: float) -> None:
        mb, chunk = task.microbatch, task.chunk
        if task.kind is Kind.F:
            forward_done[stage].add((mb, chunk))
            nxt = topology.downstream(stage, chunk)
            if nxt is None:
                grad_arrived[stage].add((mb, chunk))  # the loss is its own output gradient
                mark_backward_ready(stage, mb, chunk)
            else:
                send(stage, nxt[0], time, realization.activation_latency[stage][chunk][mb], ("F", mb, nxt[1]))
        elif task.kind is Kind.B:
            if split:
                ready[stage].add(Task(Kind.W, mb, chunk))
            prev = topology.upstream(stage, chunk)
            if prev is not None:
                send(stage, prev[0], time, realization.gradient_latency[stage][chunk][mb], ("B", mb, prev[1]))

    def arrive(stage: int, payload) -> None:
        direction, mb, chunk = payload
        if direction == "F":
            ready[stage].add(Task(Kind.F, mb, chunk))
        else:
            grad_arrived[stage].add((mb, chunk))
            mark_backward_ready(stage, mb, chunk)

    now = 0.0
    while True:
        for stage in range(pp):  # decide only after every event of this instant is applied
            if busy_until[stage] is None and ready[stage]:
                task = arbiters[stage].choose(ready[stage])
                if task is not None:
                    ready[stage].discard(task)
                    arbiters[stage].record(task)
                    duration = realization.duration(stage, task, split)
                    busy_until[stage] = now + duration
                    busy[stage] += duration
                    if record_trace:
                        trace.append((stage, task, now, now + duration))
                    push(now + duration, _FINISH, stage, task)
        if not events:
            break
        now = events[0][0]
        while events and events[0][0] == now:
            _, _, kind, stage, payload = heapq.heappop(events)
            if kind == _FINISH:
                busy_until[stage] = None
                finish(stage, payload, now)
            else:
                arrive(stage, payload)

    if not all(a.done for a in arbiters):
        states = "\n".join(f"  {a.describe()} ready={sorted(map(str, ready[a.stage]))}" for a in arbiters)
        raise DeadlockError(f"policy {name or config.hint} stalled at t={now:.3f} with work left:\n{states}")
    return SimResult(
        policy=name or str(config.hint),
        makespan=now,
        busy=busy,
        peak_in_flight=[a.peak_in_flight for a in arbiters],
        orders=[list(a.dispatched) for a in arbiters],
        trace=trace,
    )


_MATERIALIZED: dict[tuple, list[list[Task]]] = {}


def materialize_order(hint, topology: Topology, num_microbatches: int, buffer_limit: int = 32) -> list[list[Task]]:
    """The per-stage order a rule hint produces with constant durations (F=1, B=2) and no
    latency: the fixed-order ("strict") form of a rule hint."""
    key = (hint.name, topology, num_microbatches, buffer_limit)
    if key not in _MATERIALIZED:
        realization = sample_realization(Variability(), topology, num_microbatches, seed=0)
        result = simulate(ArbiterConfig(hint=hint, buffer_limit=buffer_limit), topology, num_microbatches,
                          realization, name=f"{hint.name}-materialize")
        _MATERIALIZED[key] = result.orders
    return [list(order) for order in _MATERIALIZED[key]]


# -- policies compared by `megatron-rrfp simulate` -------------------------------------

def policy(spec: str, buffer_limit: int = 32) -> ArbiterConfig:
    """'bf', 'bfw', '1f1b', 'gpipe' (readiness-first) or '<hint>-strict' (fixed order)."""
    strict = spec.endswith("-strict")
    return ArbiterConfig(hint=spec[: -len("-strict")] if strict else spec, buffer_limit=buffer_limit, strict=strict)


BASELINE = "1f1b-strict"
DEFAULT_POLICIES = ("1f1b-strict", "1f1b", "bf", "bfw")


def median(values) -> float:
    return float(np.median(values)) if len(values) else math.nan
