"""RRFP with paired forward and backward (``--overlap-moe-expert-parallel-comm``) against
megatron-core's own schedules, on every rank of a ``launch(..., pp=2, ep=2[, vpp=2])``.

The candidate runs megatron-core's combined-1F1B step for every F and B and for each pair the
arbiter forms; the references are Megatron's combined-1F1B interleaved schedule (it exists only
with virtual stages) and its plain 1F1B / interleaved schedule. All three start from the same
weights; losses and every gradient are compared over a few SGD iterations.

CPU only: megatron-core asserts bf16 / fp16 when the flag is set in a TransformerConfig (its
GPU kernels); these fp32 CPU models get the flags after the config is built.
"""
from __future__ import annotations

import random


def compare_combined(*, num_microbatches: int = 4, iterations: int = 2, hint: str = "default",
                     buffer_limit: object = None, delay_wgrad: bool = True, max_task_delay_s: float = 0.01,
                     seed: int = 0) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_with_interleaving,
        forward_backward_pipelining_without_interleaving,
    )

    from megatron_rrfp.bench.around_schedules import sleep_before_tasks
    from megatron_rrfp.cpu import enable_cpu_reference_schedules
    from megatron_rrfp.mcore.config import RRFPConfig
    from megatron_rrfp.mcore.schedule import forward_backward_rrfp, last_iteration_report
    from megatron_rrfp.mcore.session import shutdown
    from megatron_rrfp.train import models

    from .equivalence import moe_options

    enable_cpu_reference_schedules()
    rank = dist.get_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    chunks = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    seq, mbs, vocab = 16, 2, 64

    def build(combined: bool) -> list:
        config = models.tiny_gpt_config(num_layers=2 * pp * chunks, **moe_options())
        config.batch_p2p_comm = False  # Megatron's interleaved reference at PP=2 (see helpers/interleaved.py)
        if combined:
            config.overlap_moe_expert_parallel_comm = True
            config.delay_wgrad_compute = delay_wgrad
        return [models.build_gpt_stage(config, vocab_size=vocab, seq_length=seq, seed=5,
                                       vp_stage=c if chunks > 1 else None) for c in range(chunks)]

    def data(iteration: int) -> list:
        iteration += 1000 * parallel_state.get_data_parallel_rank()  # each replica its own data
        return [models.synthetic_gpt_batches(seed=50 + iteration, micro_batch_size=mbs, seq_length=seq,
                                             vocab_size=vocab) for _ in range(chunks)]

    plain = (forward_backward_pipelining_with_interleaving if chunks > 1
             else forward_backward_pipelining_without_interleaving)
    runs = [("plain", build(False), plain, {})]
    if chunks > 1:  # Megatron's combined 1F1B needs virtual stages when PP > 1
        runs.append(("combined", build(True), forward_backward_pipelining_with_interleaving, {}))
    rng = random.Random(seed * 1000 + rank)
    options = RRFPConfig.of(timeout_s=90, hint=hint, buffer_limit=buffer_limit,
                            around_task=sleep_before_tasks(lambda task: rng.uniform(0.0, max_task_delay_s)))
    runs.append(("rrfp", build(True), forward_backward_rrfp, {"rrfp_config": options}))
    errors = {name: [0.0, 0.0] for name, *_ in runs[:-1]}
    orders, pairs, unsplit, num_losses = [], [], [], 0
    for iteration in range(iterations):
        results = {}
        for name, chunk_models, schedule, extra in runs:
            for m in chunk_models:
                _zero_grads(m)
            model = chunk_models if chunks > 1 else chunk_models[0]
            iterator = data(iteration) if chunks > 1 else data(iteration)[0]
            losses = schedule(forward_step_func=models.gpt_forward_step, data_iterator=iterator, model=model,
                              num_microbatches=num_microbatches, seq_length=seq, micro_batch_size=mbs, **extra)
            results[name] = (losses, [_gradients(m) for m in chunk_models])
        report = last_iteration_report()
        orders.append(report.order_string)
        pairs.append([f"{f}+{b}" for f, b in report.pairs])
        unsplit.append(report.unsplit_backwards)
        ours_losses, ours_grads = results["rrfp"]
        num_losses += len(ours_losses)
        for name in errors:
            ref_losses, ref_grads = results[name]
            assert len(ref_losses) == len(ours_losses), (name, len(ref_losses), len(ours_losses))
            for a, b in zip(ref_losses, ours_losses):
                for key in a:
                    errors[name][0] = max(errors[name][0], _relative_difference(a[key], b[key]))
            for ref_chunk, our_chunk in zip(ref_grads, ours_grads):
                differences = [_relative_difference(ref_chunk[n], our_chunk[n]) for n in ref_chunk]
                errors[name][1] = max([errors[name][1]] + differences)
        for _, chunk_models, _, _ in runs:
            for m in chunk_models:
                _sgd_step(m, 0.05)
    shutdown()
    return {"rank": rank, "stage": parallel_state.get_pipeline_model_parallel_rank(), "errors": errors,
            "orders": orders, "pairs": pairs, "unsplit": unsplit, "num_losses": num_losses}


def _gradients(model) -> dict:
    """Every parameter's gradient by name (zeros where none)."""
    import torch

    return {name: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            for name, p in model.named_parameters()}


def _relative_difference(a, b) -> float:
    scale = a.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def _zero_grads(model) -> None:
    for param in model.parameters():
        param.grad = None


def _sgd_step(model, lr: float) -> None:
    """Plain SGD on every copy alike, so the next iteration compares trained weights."""
    import torch

    with torch.no_grad():
        for name, grad in _gradients(model).items():
            model.get_parameter(name).sub_(lr * grad)


def compare_combined_cases(cases: list[dict]) -> list[dict]:
    """``compare_combined(**case)`` for each case, in one launch."""
    return [compare_combined(**case) for case in cases]
