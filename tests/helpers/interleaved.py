"""RRFP vs megatron-core's *interleaved* schedule (model chunks), under random delays: the
cases, compared by the package's ``selfcheck.equivalence.compare_with_megatron``.

Runs on every rank of a ``launch(..., vpp=2)``. Megatron's interleaved reference uses
non-batched p2p: at PP=2 its batched p2p gives silently wrong gradients
(see the brief; Megatron-LM's argument checks forbid that combination).
"""
from __future__ import annotations

import random


def compare_interleaved(*, num_microbatches: int = 8, iterations: int = 2, model: str = "gpt",
                        max_task_delay_s: float = 0.01, seed: int = 0, transport: str = "auto",
                        hint: str = "default", microbatches: tuple[int, ...] = (),
                        buffer_limit: object = None) -> dict:
    """``microbatches``: each iteration's number of microbatches (default ``num_microbatches``)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_rrfp.bench.around_schedules import sleep_before_tasks
    from megatron_rrfp.cpu import enable_cpu_reference_schedules
    from megatron_rrfp.mcore.config import RRFPConfig
    from megatron_rrfp.mcore.session import shutdown
    from megatron_rrfp.policy.hints import megatron_1f1b_order
    from megatron_rrfp.policy.topology import Topology
    from megatron_rrfp.selfcheck.equivalence import compare_with_megatron
    from megatron_rrfp.train import models

    from . import mlp
    from .equivalence import moe_options

    enable_cpu_reference_schedules()
    rank = dist.get_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    chunks = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    seq, mbs, vocab = 16, 2, 64

    def build(reference: bool):
        config = models.tiny_gpt_config(num_layers=(2 if model == "hybrid" else 1) * pp * chunks,
                                        **(moe_options() if model == "moe" else {}))
        if reference:
            config.batch_p2p_comm = False
        if model == "hybrid":  # one attention + one MLP layer per model chunk
            pattern = "|".join(["*-"] * (pp * chunks))
            return [models.build_hybrid_stage(config, hybrid_layer_pattern=pattern, vocab_size=vocab, seq_length=seq,
                                              seed=5, vp_stage=c) for c in range(chunks)]
        if model in ("gpt", "moe"):
            return [models.build_gpt_stage(config, vocab_size=vocab, seq_length=seq, seed=5, vp_stage=c)
                    for c in range(chunks)]
        return [mlp.build_mlp_stage(config, seed=5, vp_stage=c) for c in range(chunks)]

    def data(iteration: int):
        if model == "moe":  # each data-parallel replica its own data: the experts' loads differ
            iteration += 1000 * parallel_state.get_data_parallel_rank()
        if model in ("gpt", "moe", "hybrid"):
            return [models.synthetic_gpt_batches(seed=50 + iteration, micro_batch_size=mbs, seq_length=seq,
                                                 vocab_size=vocab) for _ in range(chunks)]
        return [mlp.synthetic_mlp_batches(seed=50 + iteration, micro_batch_size=mbs, seq_length=seq,
                                             hidden_size=32) for _ in range(chunks)]

    step = mlp.mlp_forward_step if model == "mlp" else models.gpt_forward_step
    reference, candidate = build(True), build(False)
    rng = random.Random(seed * 1000 + rank)
    task_delay = lambda task: rng.uniform(0.0, max_task_delay_s)  # noqa: E731
    options = RRFPConfig.of(timeout_s=60, transport=transport, hint=hint, buffer_limit=buffer_limit,
                            around_task=sleep_before_tasks(task_delay))  # perturbs RRFP only
    stage = parallel_state.get_pipeline_model_parallel_rank()
    megatron_order = ",".join(map(str, megatron_1f1b_order(stage, Topology(pp, chunks), num_microbatches)))
    found = compare_with_megatron(
        reference, candidate, forward_step=step, data=data,
        microbatches=[microbatches[i] if microbatches else num_microbatches for i in range(iterations)],
        seq_length=seq, micro_batch_size=mbs, rrfp_config=options)
    shutdown()
    return {"rank": rank, "stage": stage, "loss_rel_err": found.loss_rel_err, "grad_rel_err": found.grad_rel_err,
            "orders": [r.order_string for r in found.reports], "megatron_order": megatron_order,
            "num_losses": found.num_losses, "peak_in_flight": max(r.peak_in_flight for r in found.reports),
            "losses_megatron": [], "losses_rrfp": []}


def compare_interleaved_transports(transports: tuple[str, ...], **kwargs) -> list[dict]:
    """``compare_interleaved`` once per transport (a name, or (name, hint)), in one launch."""
    runs = [(t, kwargs.get("hint", "default")) if isinstance(t, str) else t for t in transports]
    kwargs.pop("hint", None)
    return [compare_interleaved(transport=transport, hint=hint, **kwargs) for transport, hint in runs]


def compare_interleaved_cases(cases: list[dict]) -> list[dict]:
    """``compare_interleaved(**case)`` for each case, in one launch."""
    return [compare_interleaved(**case) for case in cases]
