"""The run-time variability model shared by the simulator and the benchmark's emulation.

Durations are drawn once per seed (``sample_realization``) and shared by every policy, so
policies are compared on exactly the same variability. Units: everything is in units of
``f0``, the nominal forward time of one stage (or seconds, when ``f0`` is in seconds).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Optional

import numpy as np

from ..checks import Bound, bound, check_fields, integer
from ..policy.actions import Kind, Task
from ..policy.topology import Topology


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
    # Mixture of experts (expert_parallel > 1: the replicas of a stage run in lock-step,
    # Megatron's schedule and RRFP's agreement alike; see moe_load_factor)
    num_experts: int = 0
    """Experts per MoE layer (0: a dense model, the fields below unused)."""
    expert_parallel: int = 1
    """EP degree: the experts are spread over this many ranks (data-parallel replicas)."""
    moe_topk: int = 2
    moe_tokens: int = 4096
    """Tokens per microbatch and replica routed by one layer."""
    moe_skew: float = 1.0
    """Zipf exponent of each layer's expert popularity (0: uniform router)."""
    moe_concentration: float = 50.0
    """Dirichlet concentration of the per-microbatch drift of the router's probabilities
    around the layer's popularity (large: stable routing; small: each microbatch its own hot experts)."""
    moe_share: float = 0.5
    """Share of a stage's compute in its experts (scales with the slowest EP rank's load)."""
    a2a_time: float = 0.0
    """All-to-all time per F (and per B) of a stage at a balanced load, in units of f0; it
    scales with the slowest rank's load and stays in B when the backward is split."""
    task_times: Optional[str] = None
    """A file ``scripts/measure_task_times.py`` wrote: task durations are drawn from its measured
    times instead of the compute model above (``measured.py``); message latencies stay modelled."""
    task_times_workload: Optional[str] = None
    """The file's workload to draw from (default: gpt, else its first)."""

    BOUNDS: ClassVar[dict[str, Bound]] = {
        "f0": bound(0, 1e6, low_open=True),
        "backward_ratio": bound(0, 1e3, low_open=True),
        "sigma_compute": bound(0, 10),  # larger: exp(sigma * z) overflows to inf
        "straggler_stage": integer(0, optional=True),
        "straggler_factor": bound(0, 1e3, low_open=True),
        "seq_len_sigma": bound(0, 10),
        "images_per_sample": bound(0, 1e3),
        "encoder_time_per_image": bound(0, 1e3),
        "image_token_share": bound(0, 1, high_open=True),
        "c50": bound(0, 1e6),
        "sigma_msg": bound(0, 10),
        "num_experts": integer(0, 1 << 16), "expert_parallel": integer(1, 1 << 16), "moe_topk": integer(1, 1 << 16),
        "moe_tokens": integer(1, 1 << 30), "moe_skew": bound(0, 10), "moe_concentration": bound(0, 1e9, low_open=True),
        "moe_share": bound(0, 1), "a2a_time": bound(0, 1e3),
    }
    """Accepted ranges: every duration drawn from them is finite (the simulator's event
    loop cannot advance on NaN or infinite times)."""
    FLAGS: ClassVar[dict[str, str]] = {
        "sigma_compute": "--sigma-compute", "backward_ratio": "--backward-ratio", "c50": "--c50",
        "sigma_msg": "--sigma-msg", "straggler_stage": "--straggler-stage", "straggler_factor": "--straggler-factor",
        "seq_len_sigma": "--seq-len-sigma", "images_per_sample": "--images-per-sample",
        "encoder_time_per_image": "--encoder-time", "image_token_share": "--image-token-share",
        "num_experts": "--num-experts", "expert_parallel": "--expert-model-parallel-size",
        "moe_topk": "--moe-router-topk", "moe_tokens": "--moe-tokens", "moe_skew": "--moe-skew",
        "moe_concentration": "--moe-concentration", "moe_share": "--moe-share", "a2a_time": "--a2a-time",
        "task_times": "--task-times", "task_times_workload": "--task-times-workload",
    }
    """The command-line flag of each field (``simulate``, ``bench``)."""

    def __post_init__(self) -> None:
        check_fields(self, self.BOUNDS, {name: f"{name} ({flag})" for name, flag in self.FLAGS.items()})
        if self.task_times is not None or self.task_times_workload is not None:
            from .measured import check_variability

            check_variability(self, Variability())

    def check_layout(self, num_stages: int) -> None:
        """The fields that depend on the pipeline: ValueError naming the flag."""
        if self.num_experts and (self.num_experts % self.expert_parallel or self.moe_topk > self.num_experts):
            raise ValueError(f"--num-experts {self.num_experts} must be a multiple of --expert-model-parallel-size "
                             f"{self.expert_parallel} and >= --moe-router-topk {self.moe_topk}")
        if self.straggler_stage is not None and not 0 <= self.straggler_stage < num_stages:
            raise ValueError(f"--straggler-stage must be an integer in [0, {num_stages - 1}] (a stage of the "
                             f"{num_stages}-stage pipeline), got {self.straggler_stage}")


VARIABILITY_LEVELS = {
    "j0": dict(sigma_compute=0.0, c50=0.0, sigma_msg=0.0),
    "j1": dict(sigma_compute=0.1, c50=0.02, sigma_msg=0.5),
    "j2": dict(sigma_compute=0.2, c50=0.05, sigma_msg=1.0),
    "j3": dict(sigma_compute=0.3, c50=0.1, sigma_msg=1.5),
}
"""Run-time variability levels: compute jitter sigma_c, median message latency c50 (units
of f0) and its log-normal sigma_m. j3 is the paper's reference scenario."""
REFERENCE_J3 = VARIABILITY_LEVELS["j3"]


@dataclass(slots=True)
class Realization:
    """One seed's draw: durations [stage][chunk][mb] and latencies of each sent message."""

    forward: list
    backward_total: list
    activation_latency: list
    gradient_latency: list
    backward_comm: Optional[list] = None
    """Part of backward_total that is communication (MoE all-to-alls): it stays in B when split."""
    host_cost: Optional[list] = None
    """Per stage, {"F": s, "B": s, "W": s}: a measured host cost added to every task of that kind
    (``with_host_cost``); None: tasks are their device time alone (the default model)."""
    backward_input: Optional[list] = None
    """Measured times (``measured.py``): a split backward's B, [stage][chunk][mb]; None: half of
    backward_total (less its communication) each for B and W, the model's split."""
    weight: Optional[list] = None
    """Measured times: a split backward's W, beside ``backward_input``."""

    def duration(self, stage: int, task: Task, split_backward: bool) -> float:
        extra = self.host_cost[stage].get(task.kind.value, 0.0) if self.host_cost else 0.0
        if task.kind is Kind.F:
            return self.forward[stage][task.chunk][task.microbatch] + extra
        full = self.backward_total[stage][task.chunk][task.microbatch]
        if not split_backward:
            return full + extra
        if self.backward_input is not None:
            table = self.backward_input if task.kind is Kind.B else self.weight
            return table[stage][task.chunk][task.microbatch] + extra
        comm = self.backward_comm[stage][task.chunk][task.microbatch] if self.backward_comm else 0.0
        return (full - comm) / 2 + (comm if task.kind is Kind.B else 0.0) + extra

    def pair_duration(self, stage: int, forward: Task, backward: Task, split_backward: bool = False) -> float:
        """A ready F and B run together (megatron-core's combined step, two streams): each
        half's all-to-all hides behind the other's compute, so the pair takes the longer of the
        two resources, max(compute F + compute B, all-to-all F + all-to-all B). Optimistic: the
        layer-by-layer dependencies inside the step (an all-to-all waits for its own layer's
        compute) are not modelled. Without MoE communication it is the two in series.
        ``split_backward``: the backward defers its W (the pair holds its B only)."""
        return max(self.pair_parts(stage, forward, backward, split_backward))

    def pair_parts(self, stage: int, forward: Task, backward: Task,
                   split_backward: bool = False) -> tuple[float, float]:
        """(compute of both halves, the all-to-all time inside them) of a combined step."""
        alone = self.duration(stage, forward, False) + self.duration(stage, backward, split_backward)
        comm = (self.backward_comm[stage][forward.chunk][forward.microbatch]
                + self.backward_comm[stage][backward.chunk][backward.microbatch]) if self.backward_comm else 0.0
        return alone - comm, comm


def with_host_cost(realization: Realization, host_cost: list) -> Realization:
    """``realization`` with a measured per-task host cost (seconds, per stage and kind: what the
    launch-bound regime of small microbatches adds on a GPU, or the Python per task on a CPU
    bench) on top of each task's device time; ``bench`` measures it per schedule."""
    return replace(realization, host_cost=host_cost)


def lockstep(replicas: list[Realization]) -> Realization:
    """One stage sequence run by several replicas in lock-step (the whole-stage agreement,
    ``mcore/dp_overlap.py``): every task is dispatched once it is ready on every replica and
    each replica has finished its previous one, so it takes the slowest replica's duration and
    each message the slowest replica's latency. Pessimistic: the real lock-step waits for
    max(duration + latency) over replicas, not max(duration) + max(latency); the agreement's own
    exchange is taken as free."""
    def slowest(field: str):
        tables = [getattr(r, field) for r in replicas]
        return None if tables[0] is None else np.maximum.reduce([np.asarray(t) for t in tables]).tolist()

    if any(r.host_cost is not None or r.backward_comm is not None or r.backward_input is not None
           for r in replicas):
        raise ValueError("lockstep: replicas with a host cost, all-to-all time or measured times are not modelled")
    return Realization(*(slowest(name) for name in ("forward", "backward_total", "activation_latency",
                                                    "gradient_latency")))


def moe_load_factor(v: Variability, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Per task: the slowest expert-parallel rank's token load over the balanced load.

    Each (stage, chunk) is a layer with its own expert popularity: Zipf(moe_skew) over the
    experts in a random order. Per microbatch the router's probabilities drift:
    p ~ Dirichlet(moe_concentration * popularity). Every replica routes moe_tokens x topk
    assignments, multinomial over p; EP rank r serves experts [r E/EP, (r+1) E/EP) for all
    replicas (the all-to-all), so its load is the sum of their counts there. The layer waits
    for the slowest rank: factor = max_r load_r / (moe_tokens x topk), 1.0 when balanced.
    """
    e, ep = v.num_experts, v.expert_parallel
    per_rank = e // ep
    factor = np.empty(shape)
    base = (np.arange(e) + 1.0) ** -v.moe_skew
    for index in np.ndindex(shape[:-1]):
        popularity = rng.permutation(base / base.sum())
        for mb in range(shape[-1]):
            p = rng.dirichlet(v.moe_concentration * popularity)
            counts = rng.multinomial(v.moe_tokens * v.moe_topk, p, size=ep).sum(axis=0)  # every replica's tokens
            load = counts.reshape(ep, per_rank).sum(axis=1)
            factor[(*index, mb)] = load.max() / (v.moe_tokens * v.moe_topk)
    return factor


def sample_realization(variability: Variability, topology: Topology, num_microbatches: int,
                       seed: int) -> Realization:
    v, pp, chunks, m = variability, topology.num_stages, topology.num_chunks, num_microbatches
    if v.task_times is not None:  # measured durations instead of the model below
        from .measured import measured_tables

        tables = measured_tables(v, topology, m, seed)
        # message latencies as the model draws them (no compute knobs: check_variability refused those)
        messages = sample_realization(Variability(f0=v.f0, c50=v.c50, sigma_msg=v.sigma_msg), topology, m, seed)
        return Realization(tables["F"].tolist(), tables["B"].tolist(), messages.activation_latency,
                           messages.gradient_latency, backward_input=tables["I"].tolist(),
                           weight=tables["W"].tolist())
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
    comm = None
    if v.num_experts:
        moe = np.random.default_rng([seed, 1])  # its own stream: the dense draws above stay as they were
        load = moe_load_factor(v, shape, moe)
        if v.expert_parallel > 1 and v.sigma_compute:  # lock-step replicas: a task waits for the slowest one
            for _ in range(v.expert_parallel - 1):
                forward = np.maximum(forward, per_chunk * moe.lognormal(0.0, v.sigma_compute, shape))
                backward = np.maximum(backward, v.backward_ratio * per_chunk * moe.lognormal(0.0, v.sigma_compute,
                                                                                               shape))
        forward = forward * ((1 - v.moe_share) + v.moe_share * load)
        backward = backward * ((1 - v.moe_share) + v.moe_share * load)
        comm = v.a2a_time * per_chunk * load
        forward = forward + comm
        backward = backward + comm
        comm = comm.tolist()
    lat_a, lat_g = latency(), latency()
    if v.num_experts and v.expert_parallel > 1 and v.c50:  # an input is common once every replica has it
        for _ in range(v.expert_parallel - 1):
            lat_a, lat_g = np.maximum(lat_a, latency()), np.maximum(lat_g, latency())
    return Realization(forward.tolist(), backward.tolist(), lat_a.tolist(), lat_g.tolist(), comm)
