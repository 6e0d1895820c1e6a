"""The self-check's equivalence steps: a tiny megatron-core GPT, RRFP (rounds transport,
random task delays) against megatron-core's own schedule (1F1B, or interleaved 1F1B with
chunks) on the same weights and data, a few training iterations (``verify/selfcheck.py``).

``compare_with_megatron(ctx, tp=, pp=, chunks=)`` lays out TP x PP over the world; the rest
is data parallelism (megatron-core's DistributedDataParallel, no_sync and
finalize_model_grads as Megatron-LM wires them). Device-agnostic: on CPU (gloo) the same
function runs with megatron-core's CPU-redirected schedules."""
from __future__ import annotations

import random

GPU_TOLERANCE = 1e-4  # fp32 without TF32; CUDA's embedding backward accumulates atomically
BF16_TOLERANCE = 2e-2  # bf16 weights and activations: ~3 significant digits, reduced in fp32


def _on(device, batches):
    for batch in batches:
        yield {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _grads(model) -> list:
    import torch

    out = []
    for p in model.parameters():
        grad = getattr(p, "main_grad", None)
        grad = p.grad if grad is None else grad
        out.append(torch.zeros_like(p) if grad is None else grad.detach().clone())
    return out


def compare_with_megatron(ctx, *, tp: int = 1, pp=None, chunks: int = 1, iterations: int = 3,
                          num_microbatches: int = 8, device=None, hint=None, ep: int = 1, overlap: bool = False,
                          sequence_parallel: bool = False, bf16: bool = False, dp_overlap: str = "auto",
                          ) -> tuple[str, str]:
    """(PASS | FAIL, one-line detail), the same on every rank. ``hint``: RRFP's (default: the
    default policy, which splits the backward where the model allows).

    Production options, as Megatron-LM wires them: ``ep`` (MoE, alltoall dispatcher, EP over DP),
    ``overlap`` (DDP --overlap-grad-reduce --overlap-param-gather --use-distributed-optimizer, with
    interleaving the per-chunk grad_sync_func / param_sync_func; ``dp_overlap``: RRFPConfig's, where
    that DP communication goes), ``sequence_parallel``, ``bf16``
    (bf16 weights and p2p, fp32 reduction; tolerance ``BF16_TOLERANCE``)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import schedules

    from ..bench.hooks import sleep_before_tasks
    from ..mcore.config import RRFPConfig
    from ..mcore.schedule import forward_backward_rrfp
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
    reference_schedule = schedules.forward_backward_pipelining_with_interleaving if chunks > 1 else \
        schedules.forward_backward_pipelining_without_interleaving
    seq, mbs, vocab = 32, 2, 128
    layout = (f"TP={tp} x PP={pp}" + (f" x {chunks} chunks" if chunks > 1 else "") + f" x DP={dp}"
              + (f" x EP={ep} (alltoall)" if ep > 1 else "") + (", overlapped DP + distributed optimizer" if overlap
                                                                 else "")
              + (", SP" if sequence_parallel else "") + (", bf16" if bf16 else "") + f", hint {hint or 'default'}")
    tolerance = BF16_TOLERANCE if bf16 else GPU_TOLERANCE
    try:
        def build(reference: bool) -> list:
            extra = models.moe_fields(num_experts=2 * ep, expert_parallel=ep, topk=2, dispatcher="alltoall",
                                      aux_loss_coeff=0.0) if ep > 1 else {}
            if bf16:
                extra.update(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
            config = models.tiny_gpt_config(num_layers=pp * chunks, sequence_parallel=sequence_parallel, **extra)
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
                stages = [DistributedDataParallel(config, ddp, s, disable_bucketing=c > 0)
                          for c, s in enumerate(stages)]
                config.no_sync_func = [s.no_sync for s in stages] if chunks > 1 else stages[0].no_sync
                if overlap and chunks > 1:  # Megatron-LM's train(): align_grad_reduce / align_param_gather
                    config.grad_sync_func = [s.start_grad_sync for s in stages]
                    config.param_sync_func = [s.start_param_sync for s in stages]
                config.finalize_model_grads_func = finalize_model_grads
            return stages

        reference, candidate = build(True), build(False)
        rng = random.Random(ctx["seed"] * 101 + dist.get_rank())  # delays: per rank
        options = RRFPConfig.of(timeout_s=ctx["stall_timeout_s"], transport="rounds", hint=hint, dp_overlap=dp_overlap,
                                around_task=sleep_before_tasks(lambda task: rng.uniform(0, 0.005)))  # RRFP reorders
        data_seed = 100 + 7 * parallel_state.get_data_parallel_rank()
        loss_err = grad_err = 0.0
        for it in range(iterations):
            grads, losses = [], []
            for stages, schedule, extra in ((reference, reference_schedule, {}),
                                            (candidate, forward_backward_rrfp, {"rrfp_config": options})):
                for s in stages:
                    if hasattr(s, "zero_grad_buffer"):
                        s.zero_grad_buffer()
                    for p in s.parameters():
                        p.grad = None
                data = [_on(device, models.synthetic_gpt_batches(seed=data_seed + it, micro_batch_size=mbs,
                                                                 seq_length=seq, vocab_size=vocab))
                        for _ in range(chunks)]
                out = schedule(forward_step_func=models.gpt_forward_step, data_iterator=data if chunks > 1 else data[0],
                               model=stages if chunks > 1 else stages[0], num_microbatches=num_microbatches,
                               seq_length=seq, micro_batch_size=mbs, **extra)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                losses.append([float(v) for x in out for v in x.values() for v in v.flatten()])
                grads.append([g for s in stages for g in _grads(s)])
            if len(losses[0]) != len(losses[1]):
                raise AssertionError(f"{len(losses[1])} losses vs Megatron's {len(losses[0])}")
            for a, b in zip(*losses):
                loss_err = max(loss_err, abs(a - b) / max(1.0, abs(a)))
            for a, b in zip(*grads):
                scale = a.abs().max().item() or 1.0
                grad_err = max(grad_err, (a - b).abs().max().item() / scale)
            with torch.no_grad():
                for stages, g in ((reference, grads[0]), (candidate, grads[1])):
                    for p, d in zip((p for s in stages for p in s.parameters()), g):
                        p -= 0.05 * d
        errors = [None] * world
        dist.all_gather_object(errors, (loss_err, grad_err))
        worst = max(max(e) for e in errors)
        detail = (f"{layout}, {iterations} iterations x {num_microbatches} microbatches, max relative difference "
                  f"of losses {max(e[0] for e in errors):.2e}, of gradients {max(e[1] for e in errors):.2e} "
                  f"(tolerance {tolerance:g})")
        return ("PASS" if worst <= tolerance else "FAIL"), detail
    finally:
        shutdown()
        parallel_state.destroy_model_parallel()


def compare_with_megatron_on_gpu(ctx, **layout) -> tuple[str, str]:
    import torch

    return compare_with_megatron(ctx, device=torch.device("cuda", torch.cuda.current_device()), **layout)


__all__ = ["BF16_TOLERANCE", "GPU_TOLERANCE", "compare_with_megatron", "compare_with_megatron_on_gpu"]
