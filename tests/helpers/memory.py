"""Activation memory on real megatron-core stages, measured the same way around Megatron's
own 1F1B (wrapped from outside) and RRFP (which reports it), for tests/distributed/test_memory.py.

The MLP stage (helpers/mlp.py) keeps a figure one can compute by hand: per forward, each
block saves its input x [s, b, h], fc1's output (gelu's input) and gelu's output [s, b, f]
(fp32); the last stage adds the head's input and the squared error's difference [s, b, h]
and the int32 token count Megatron's forward_step divides the loss by.
"""
from __future__ import annotations

import random

from . import mlp

S, B, H, MICROBATCHES = 16, 2, 32, 8


def hand_computed_bytes_per_forward(*, blocks: int, ffn: int, last: bool) -> int:
    per_block = 4 * S * B * (H + 2 * ffn)
    return blocks * per_block + (2 * 4 * S * B * H + 4 if last else 0)


def message_bytes() -> int:
    return 4 * S * B * H  # one activation or gradient between stages


def memory_checks(budget_forwards: float) -> dict:
    """PP=2: Megatron's 1F1B, then RRFP at 1x (bf, strict 1f1b, bfw), then a forward-only
    call and three auto calls under an injected budget of ``budget_forwards`` stage-0
    forwards. Returns this rank's figures."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    from megatron_rrfp.bench.around_schedules import count_in_flight, sleep_before_tasks
    from megatron_rrfp.cpu import enable_cpu_reference_schedules
    from megatron_rrfp.mcore.config import RRFPConfig
    from megatron_rrfp.mcore.schedule import forward_backward_rrfp, last_iteration_report
    from megatron_rrfp.mcore.session import shutdown
    from megatron_rrfp.runtime.memory import ActivationMeter, model_tensors
    from megatron_rrfp.train import models

    enable_cpu_reference_schedules()
    config = models.tiny_gpt_config()
    stage = mlp.build_mlp_stage(config, seed=11)
    last = parallel_state.is_pipeline_last_stage()
    rank = dist.get_rank()
    common = dict(forward_step_func=mlp.mlp_forward_step, model=stage, num_microbatches=MICROBATCHES,
                  seq_length=S, micro_batch_size=B)

    def data():
        return mlp.synthetic_mlp_batches(seed=3, micro_batch_size=B, seq_length=S, hidden_size=H)

    out = {"rank": rank, "last": last, "expected_per_forward": hand_computed_bytes_per_forward(
        blocks=len(stage.blocks), ffn=config.ffn_hidden_size, last=last)}
    counter = count_in_flight()
    meter = ActivationMeter("cpu", persistent=model_tensors([stage]))
    counter.active = True
    with meter:
        forward_backward_pipelining_without_interleaving(data_iterator=data(), **common)
    counter.active = False
    out["megatron"] = {"bytes": meter.peak_bytes, "in_flight": counter.peak, "method": meter.method}

    rng = random.Random(rank)
    drift = sleep_before_tasks(lambda task: rng.uniform(0.0, 0.004))  # the stages drift: RRFP really reorders

    def rrfp(**options) -> dict:
        forward_only = options.pop("forward_only", False)
        with torch.set_grad_enabled(not forward_only):  # evaluation runs under no_grad, as in Megatron-LM
            forward_backward_rrfp(data_iterator=data(), forward_only=forward_only,
                                  rrfp_config=RRFPConfig.of(timeout_s=60.0, around_task=drift, **options), **common)
        r = last_iteration_report()
        return {"bytes": r.peak_activation_bytes, "in_flight": r.peak_in_flight, "limit": r.buffer_limit,
                "wgrad_bytes": r.peak_deferred_wgrad_bytes, "method": r.activation_measure}

    out["bf-1x"] = rrfp(hint="bf", buffer_limit="1x")
    out["strict-1x"] = rrfp(hint="1f1b", strict=True, buffer_limit="1x")
    out["bfw-1x"] = rrfp(hint="bfw", buffer_limit="1x")
    out["bf-8"] = rrfp(hint="bf", buffer_limit=8)
    budget = int(budget_forwards * hand_computed_bytes_per_forward(blocks=len(stage.blocks),
                                                                  ffn=config.ffn_hidden_size, last=False))
    out["budget"] = budget
    out["eval"] = rrfp(hint="bf", buffer_limit="auto", activation_budget_bytes=budget, forward_only=True)
    out["auto"] = [rrfp(hint="bf", buffer_limit="auto", activation_budget_bytes=budget) for _ in range(3)]
    shutdown()
    return out
