"""The self-check's equivalence step: a tiny megatron-core GPT on CUDA, PP = every rank,
RRFP (NCCL rounds, random task delays) against megatron-core's own 1F1B on the same
weights and data, a few training iterations (``verify/selfcheck.py``)."""
from __future__ import annotations

import random

GPU_TOLERANCE = 1e-4  # fp32 without TF32; CUDA's embedding backward accumulates atomically


def _cuda_batches(batches):
    for batch in batches:
        yield {k: v.cuda(non_blocking=True) for k, v in batch.items()}


def compare_with_megatron_on_gpu(ctx, *, iterations: int = 3, num_microbatches: int = 8) -> tuple[str, str]:
    """(PASS | FAIL, one-line detail)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    from ..bench.hooks import delay_tasks
    from ..mcore.config import RRFPConfig
    from ..mcore.schedule import forward_backward_rrfp
    from ..mcore.session import shutdown
    from ..train import models

    world = ctx["world"]
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    seq, mbs, vocab = 32, 2, 128
    try:
        config = models.tiny_gpt_config()

        def build():
            return models.build_gpt_stage(config, vocab_size=vocab, seq_length=seq, seed=11).cuda()

        reference, candidate = build(), build()
        rng = random.Random(ctx["seed"] * 101 + dist.get_rank())
        options = RRFPConfig.of(timeout_s=ctx["stall_timeout_s"], transport="rounds")
        loss_err = grad_err = 0.0
        for it in range(iterations):
            grads, losses = [], []
            for model, schedule, extra in ((reference, forward_backward_pipelining_without_interleaving, {}),
                                           (candidate, forward_backward_rrfp, {"rrfp_config": options})):
                delay_tasks((lambda task: rng.uniform(0, 0.005)) if schedule is forward_backward_rrfp else None)
                for p in model.parameters():
                    p.grad = None
                data = _cuda_batches(models.synthetic_gpt_batches(seed=100 + it, micro_batch_size=mbs,
                                                                  seq_length=seq, vocab_size=vocab))
                out = schedule(forward_step_func=models.gpt_forward_step, data_iterator=data, model=model,
                               num_microbatches=num_microbatches, seq_length=seq, micro_batch_size=mbs, **extra)
                torch.cuda.synchronize()
                losses.append([float(v) for x in out for v in x.values() for v in v.flatten()])
                grads.append([p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                              for p in model.parameters()])
            delay_tasks(None)
            for a, b in zip(*losses):
                loss_err = max(loss_err, abs(a - b) / max(1.0, abs(a)))
            for a, b in zip(*grads):
                scale = a.abs().max().item() or 1.0
                grad_err = max(grad_err, (a - b).abs().max().item() / scale)
            with torch.no_grad():
                for model, g in ((reference, grads[0]), (candidate, grads[1])):
                    for p, d in zip(model.parameters(), g):
                        p -= 0.05 * d
        errors = [None] * world
        dist.all_gather_object(errors, (loss_err, grad_err))
        worst = max(max(e) for e in errors)
        detail = (f"PP={world}, {iterations} iterations x {num_microbatches} microbatches, max relative difference "
                  f"of losses {max(e[0] for e in errors):.2e}, of gradients {max(e[1] for e in errors):.2e} "
                  f"(tolerance {GPU_TOLERANCE:g})")
        return ("PASS" if worst <= GPU_TOLERANCE else "FAIL"), detail
    finally:
        shutdown()
        parallel_state.destroy_model_parallel()


__all__ = ["GPU_TOLERANCE", "compare_with_megatron_on_gpu"]
