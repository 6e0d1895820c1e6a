"""RRFP against megatron-core's own schedule on the same model, weights and data: the one
comparison that the self-check's equivalence steps and the test suite both run.

``compare_with_megatron(reference, candidate, ...)`` trains two identical copies of a stage (a
list of model chunks; with more than one, Megatron's interleaved 1F1B is the reference, else its
1F1B) for a few iterations, one under megatron-core's schedule and one under
``forward_backward_rrfp``, and returns the largest relative differences of losses and gradients
with RRFP's report of each iteration. ``gpt_equivalence(ctx, tp=, pp=, chunks=, ...)`` is the
steps' layout: a tiny megatron-core GPT, TP x PP over the world, the rest data parallelism
(megatron-core's DistributedDataParallel, no_sync and finalize_model_grads as Megatron-LM wires
them), random task delays in RRFP only. Device-agnostic: on CPU (gloo) the same code runs with
megatron-core's CPU-redirected schedules.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from .result import Result

GPU_TOLERANCE = 1e-4  # fp32 without TF32; CUDA's embedding backward accumulates atomically
BF16_TOLERANCE = 2e-2  # bf16 weights and activations: ~3 significant digits, reduced in fp32


@dataclass(frozen=True)
class Comparison:
    """What ``compare_with_megatron`` found on this rank."""

    loss_rel_err: float
    """The largest difference of a reported loss tensor over its largest magnitude."""
    grad_rel_err: float
    """The same for every parameter's gradient (``main_grad`` where megatron's DDP keeps one)."""
    losses_megatron: list[float]
    """Each iteration's token-weighted mean loss (the first reported key; last stage only)."""
    losses_rrfp: list[float]
    num_losses: int
    """Loss reports per rank, summed over iterations (the same for both schedules, or it raises)."""
    reports: list
    """RRFP's ``IterationReport`` of each iteration."""


def relative_difference(a, b) -> float:
    """max |a - b| over max |a| (over 1 where a is all zeros)."""
    scale = a.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def model_grads(model) -> dict:
    """Every parameter's gradient by name: DDP's ``main_grad`` where it keeps one, zeros where none."""
    import torch

    out = {}
    for name, param in model.named_parameters():
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        out[name] = torch.zeros_like(param) if grad is None else grad.detach().clone()
    return out


def _zero_grads(model) -> None:
    if hasattr(model, "zero_grad_buffer"):
        model.zero_grad_buffer()
    for param in model.parameters():
        param.grad = None


def _sgd_step(model, lr: float) -> None:
    """Plain SGD on both copies alike, so the next iteration compares trained weights."""
    import torch

    with torch.no_grad():
        for param, grad in zip(model.parameters(), model_grads(model).values()):
            param -= lr * grad


def _mean_loss(losses: list, key: str) -> float:
    """Token-weighted mean of per-microbatch [summed loss, tokens] reports."""
    return sum(float(x[key][0]) for x in losses) / max(1, sum(float(x[key][1]) for x in losses))


def compare_with_megatron(reference: Sequence, candidate: Sequence, *, forward_step: Callable,
                          data: Callable[[int], object], microbatches: Sequence[int], seq_length: int,
                          micro_batch_size: int, rrfp_config, learning_rate: float = 0.05,
                          forward_only: bool = False,
                          after_iteration: Optional[Callable[[int], None]] = None) -> Comparison:
    """Train ``reference`` under megatron-core's schedule and ``candidate`` under RRFP, one
    iteration per entry of ``microbatches`` (its number of microbatches), and compare.

    ``reference`` and ``candidate``: the same stage built twice (same seed), a list of model
    chunks. ``data(iteration)``: a fresh ``data_iterator`` for one schedule call (a list, one
    per chunk, with several chunks). ``rrfp_config``: RRFP's options (the caller's delays
    perturb RRFP's order only). ``after_iteration(i)``: called after both schedules of
    iteration ``i`` ran, before the weights are updated."""
    import torch
    from megatron.core.pipeline_parallel import schedules

    from ..mcore.schedule import forward_backward_rrfp, last_iteration_report

    interleaved = len(reference) > 1
    megatron = (schedules.forward_backward_pipelining_with_interleaving if interleaved
                else schedules.forward_backward_pipelining_without_interleaving)
    on_cuda = next(reference[0].parameters()).device.type == "cuda"
    loss_err = grad_err = 0.0
    means: tuple[list, list] = ([], [])
    reports, num_losses = [], 0
    for iteration, m in enumerate(microbatches):
        outs = []
        for chunks, schedule, extra in ((reference, megatron, {}),
                                        (candidate, forward_backward_rrfp, {"rrfp_config": rrfp_config})):
            for chunk in chunks:
                _zero_grads(chunk)
            with torch.set_grad_enabled(not forward_only):
                losses = schedule(forward_step_func=forward_step, data_iterator=data(iteration),
                                  model=list(chunks) if interleaved else chunks[0], num_microbatches=m,
                                  seq_length=seq_length, micro_batch_size=micro_batch_size,
                                  forward_only=forward_only, **extra)
            if on_cuda:
                torch.cuda.synchronize()
            outs.append((losses, [] if forward_only else [model_grads(chunk) for chunk in chunks]))
        reports.append(last_iteration_report())
        (ref_losses, ref_grads), (our_losses, our_grads) = outs
        if len(ref_losses) != len(our_losses):
            raise AssertionError(f"{len(our_losses)} losses vs Megatron's {len(ref_losses)}")
        num_losses += len(our_losses)
        for a, b in zip(ref_losses, our_losses):
            for key in a:
                loss_err = max(loss_err, relative_difference(a[key], b[key]))
        if ref_losses:
            key = next(iter(ref_losses[0]))
            means[0].append(_mean_loss(ref_losses, key))
            means[1].append(_mean_loss(our_losses, key))
        for ref_chunk, our_chunk in zip(ref_grads, our_grads):
            grad_err = max([grad_err] + [relative_difference(ref_chunk[n], our_chunk[n]) for n in ref_chunk])
        if after_iteration is not None:
            after_iteration(iteration)
        if not forward_only:
            for chunk in (*reference, *candidate):
                _sgd_step(chunk, learning_rate)
    return Comparison(loss_rel_err=loss_err, grad_rel_err=grad_err, losses_megatron=means[0],
                      losses_rrfp=means[1], num_losses=num_losses, reports=reports)


# --------------------------------------------------------------------------- the steps' layout

def _on(device, batches):
    for batch in batches:
        yield {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _gpt_stages(config_fields: dict, *, reference: bool, chunks: int, dp: int, overlap: bool, bf16: bool,
                device, vocab: int, seq: int, paired: bool = False) -> list:
    """One rank's model chunks of the tiny GPT, wrapped as Megatron-LM wraps them."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from ..train import models

    config = models.tiny_gpt_config(**config_fields)
    if paired:  # set after the constructor, whose bf16 / fp16 assert is about GPU kernels (the CPU run is fp32)
        config.overlap_moe_expert_parallel_comm = True
    config.batch_p2p_comm = not reference  # Megatron's interleaved reference: non-batched p2p
    stages = [models.build_gpt_stage(config, vocab_size=vocab, seq_length=seq, seed=11,
                                     vp_stage=c if chunks > 1 else None).to(device) for c in range(chunks)]
    if bf16:
        from megatron.core.transformer.module import Float16Module

        stages = [Float16Module(config, s) for s in stages]
    if dp > 1:
        ddp = DistributedDataParallelConfig(overlap_grad_reduce=overlap, overlap_param_gather=overlap,
                                            use_distributed_optimizer=overlap, grad_reduce_in_fp32=bf16,
                                            align_param_gather=overlap and chunks > 1)
        stages = [DistributedDataParallel(config, ddp, s, disable_bucketing=c > 0) for c, s in enumerate(stages)]
        config.no_sync_func = [s.no_sync for s in stages] if chunks > 1 else stages[0].no_sync
        if overlap and chunks > 1:  # Megatron-LM's train(): align_grad_reduce / align_param_gather
            config.grad_sync_func = [s.start_grad_sync for s in stages]
            config.param_sync_func = [s.start_param_sync for s in stages]
        config.finalize_model_grads_func = finalize_model_grads
    return stages


def gpt_equivalence(ctx, *, tp: int = 1, pp=None, chunks: int = 1, iterations: int = 3, num_microbatches: int = 8,
                    device=None, hint=None, ep: int = 1, overlap: bool = False, sequence_parallel: bool = False,
                    bf16: bool = False, dp_overlap: str = "auto", paired: bool = False) -> tuple[str, str]:
    """(PASS | FAIL, one-line detail), the same on every rank. ``hint``: RRFP's (default: the
    default policy, which splits the backward where the model allows).

    Production options, as Megatron-LM wires them: ``ep`` (MoE, alltoall dispatcher, EP over DP),
    ``overlap`` (DDP --overlap-grad-reduce --overlap-param-gather --use-distributed-optimizer, with
    interleaving the per-chunk grad_sync_func / param_sync_func; ``dp_overlap``: RRFPConfig's, where
    that DP communication goes), ``sequence_parallel``, ``bf16``
    (bf16 weights and p2p, fp32 reduction; tolerance ``BF16_TOLERANCE``), ``paired``
    (``--overlap-moe-expert-parallel-comm`` with ``ep`` and chunks: every F and B through megatron-core's
    combined step, on its two streams on a GPU, against Megatron's combined-1F1B interleaved schedule;
    FAIL too where no rank ran a pair)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from ..bench.around_schedules import sleep_before_tasks
    from ..mcore.config import RRFPConfig
    from ..mcore.session import shutdown
    from ..train import models

    world = ctx["world"]
    pp = pp or world // tp
    device = torch.device(device or "cuda")
    dp = world // (tp * pp)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None,
                                             expert_model_parallel_size=ep)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    else:
        from ..cpu import enable_cpu_reference_schedules

        enable_cpu_reference_schedules()
    seq, mbs, vocab = 32, 2, 128
    layout = (f"TP={tp} x PP={pp}" + (f" x {chunks} chunks" if chunks > 1 else "") + f" x DP={dp}"
              + (f" x EP={ep} (alltoall)" if ep > 1 else "") + (", overlapped DP + distributed optimizer" if overlap
                                                                 else "")
              + (", SP" if sequence_parallel else "") + (", bf16" if bf16 else "")
              + (", paired F and B (combined steps)" if paired else "") + f", hint {hint or 'default'}")
    tolerance = BF16_TOLERANCE if bf16 else GPU_TOLERANCE
    fields = models.moe_fields(num_experts=2 * ep, expert_parallel=ep, topk=2, dispatcher="alltoall",
                               aux_loss_coeff=0.0) if ep > 1 else {}
    if bf16:
        fields.update(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    fields.update(num_layers=pp * chunks, sequence_parallel=sequence_parallel)
    try:
        reference, candidate = (_gpt_stages(fields, reference=r, chunks=chunks, dp=dp, overlap=overlap, bf16=bf16,
                                            device=device, vocab=vocab, seq=seq, paired=paired) for r in (True, False))
        rng = random.Random(ctx["seed"] * 101 + dist.get_rank())  # delays: per rank
        options = RRFPConfig.of(timeout_s=ctx["stall_timeout_s"], transport="rounds", hint=hint, dp_overlap=dp_overlap,
                                around_task=sleep_before_tasks(lambda task: rng.uniform(0, 0.005)))  # RRFP reorders
        data_seed = 100 + 7 * parallel_state.get_data_parallel_rank()

        def data(it: int):
            iterators = [_on(device, models.synthetic_gpt_batches(seed=data_seed + it, micro_batch_size=mbs,
                                                                  seq_length=seq, vocab_size=vocab))
                         for _ in range(chunks)]
            return iterators if chunks > 1 else iterators[0]

        found = compare_with_megatron(reference, candidate, forward_step=models.gpt_forward_step, data=data,
                                      microbatches=[num_microbatches] * iterations, seq_length=seq,
                                      micro_batch_size=mbs, rrfp_config=options)
        errors = [None] * world
        pairs = sum(len(report.pairs) for report in found.reports)
        dist.all_gather_object(errors, (found.loss_rel_err, found.grad_rel_err, pairs))
        worst = max(max(e[:2]) for e in errors)
        detail = (f"{layout}, {iterations} iterations x {num_microbatches} microbatches, max relative difference "
                  f"of losses {max(e[0] for e in errors):.2e}, of gradients {max(e[1] for e in errors):.2e} "
                  f"(tolerance {tolerance:g})" + (f", {sum(e[2] for e in errors)} pairs run" if paired else ""))
        return ("PASS" if worst <= tolerance and (not paired or any(e[2] for e in errors)) else "FAIL"), detail
    finally:
        shutdown()
        parallel_state.destroy_model_parallel()


def _on_this_gpu(ctx, **layout) -> tuple[str, str]:
    import torch

    return gpt_equivalence(ctx, device=torch.device("cuda", torch.cuda.current_device()), **layout)


# --------------------------------------------------------------------------- the steps

EQUIVALENCE_STEPS = {
    "megatron-equivalence": {},  # PP = every GPU (gpt_equivalence's default)
    "equivalence-tp2-pp2": dict(tp=2, pp=2),  # the TP agreement on NCCL
    "equivalence-pp4-chunks2-dp2": dict(pp=4, chunks=2),  # interleaving and data-parallel reductions
}
# Megatron-LM's production flags, each against Megatron's own schedule on the same GPUs (DP = the
# rest of the world: 2 at 4 GPUs, 4 at 8), a few iterations of a 2-4 layer model each.
PRODUCTION_STEPS = {
    "production-sp-tp2-pp2": dict(tp=2, pp=2, sequence_parallel=True),  # W re-gathers its input over TP
    # --overlap-grad-reduce --overlap-param-gather --use-distributed-optimizer, interleaved (mcore/dp_overlap.py):
    # the default (the epoch rule); under the whole-stage agreement; DP communication out of the task loop
    "production-dp-overlap-pp2-chunks2": dict(pp=2, chunks=2, overlap=True),
    "production-dp-lockstep-pp2-chunks2": dict(pp=2, chunks=2, overlap=True, dp_overlap="lockstep"),
    "production-dp-after-loop-pp2-chunks2": dict(pp=2, chunks=2, overlap=True, dp_overlap="after-loop"),
    "production-dp-epochs-pp4-chunks2": dict(pp=4, chunks=2, overlap=True, dp_overlap="epochs"),
    "production-moe-ep2-pp2": dict(pp=2, ep=2),  # alltoall dispatcher, EP over DP replicas
    "production-bf16-dp-overlap-pp2-chunks2": dict(pp=2, chunks=2, overlap=True, bf16=True),
    # --overlap-moe-expert-parallel-comm: pairs on megatron-core's two streams (EP > 1 is megatron-core's rule)
    "production-moe-paired-ep2-pp2-chunks2": dict(pp=2, chunks=2, ep=2, paired=True, bf16=True),
}


def _step(name: str, layout: dict) -> Callable:
    def step(ctx) -> Result:
        return Result(name, *_on_this_gpu(ctx, **layout))

    return step


GPT_STEPS = {name: _step(name, layout) for name, layout in {**EQUIVALENCE_STEPS, **PRODUCTION_STEPS}.items()}

__all__ = ["BF16_TOLERANCE", "GPT_STEPS", "GPU_TOLERANCE", "PRODUCTION_STEPS", "Comparison", "compare_with_megatron",
           "gpt_equivalence", "model_grads", "relative_difference"]
