"""``1x`` in bytes on real megatron-core GPT stages (tests/test_memory_bytes.py): Megatron's
own 1F1B, measured from outside, beside RRFP's default over several calls (the first runs
before any measurement, the later ones with the calibrated byte budget), and the gradients
of each against Megatron's."""
from __future__ import annotations

import random


def bytes_and_gradients(*, sequence_parallel: bool, microbatches: int, calls: int = 3, te: bool = False,
                        jitter_s: float = 0.0, pp: int = 2, tp: int = 2) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    from megatron_rrfp.bench.hooks import count_in_flight, count_received, delay_tasks
    from megatron_rrfp.mcore.compat import pipeline_device
    from megatron_rrfp.mcore.config import RRFPConfig
    from megatron_rrfp.mcore.cpu import enable_cpu_reference_schedules
    from megatron_rrfp.mcore.schedule import forward_backward_rrfp, last_iteration_report
    from megatron_rrfp.mcore.session import shutdown
    from megatron_rrfp.runtime.memory import ActivationMeter, model_tensors

    enable_cpu_reference_schedules()
    stage, forward_step, data = _stage(sequence_parallel=sequence_parallel, te=te, pp=pp, tp=tp)
    kwargs = dict(forward_step_func=forward_step, model=stage, num_microbatches=microbatches, seq_length=32,
                  micro_batch_size=2)

    def grads() -> dict:
        return {n: p.grad.detach().clone() for n, p in stage.named_parameters() if p.grad is not None}

    def zero() -> None:
        for p in stage.parameters():
            p.grad = None

    counter = count_in_flight()
    meter = ActivationMeter(pipeline_device(), persistent=model_tensors([stage]))
    counter.active = True
    with meter:
        forward_backward_pipelining_without_interleaving(data_iterator=data(0), **kwargs)
    counter.active = False
    out = {"rank": dist.get_rank(), "megatron": {"bytes": meter.peak_bytes, "in_flight": counter.peak}, "rrfp": []}
    reference = grads()
    zero()
    count_received(meter)  # again, its receive buffers counted too, as RRFP's waiting messages are
    with meter:
        forward_backward_pipelining_without_interleaving(data_iterator=data(0), **kwargs)
    count_received(None)
    out["megatron"]["bytes_with_receives"] = meter.peak_bytes
    rng = random.Random(dist.get_rank() // tp)  # TP ranks of one stage drift alike (they agree anyway)
    if jitter_s:
        delay_tasks(lambda task: rng.uniform(0.0, jitter_s))
    worst = 0.0
    for _ in range(calls):
        zero()
        forward_backward_rrfp(data_iterator=data(0), rrfp_config=RRFPConfig.of(timeout_s=120.0), **kwargs)
        r = last_iteration_report()
        ours = grads()
        worst = max([worst] + [float((ours[n] - g).abs().max()) for n, g in reference.items()])
        out["rrfp"].append({"bytes": r.peak_activation_bytes, "in_flight": r.peak_in_flight,
                            "byte_budget": r.byte_budget, "unsplit": r.unsplit_backwards,
                            "split": any(t.kind.value == "W" for t in r.order)})
    out["max_grad_diff"] = worst
    from megatron_rrfp.mcore import byte_limit

    out["budgets"] = [repr(state.budgets) for state in byte_limit._states.values()]
    delay_tasks(None)
    shutdown()
    torch.distributed.barrier()
    return out


def _stage(*, sequence_parallel: bool, te: bool, pp: int, tp: int):
    """The bench's GPT stage (real megatron-core GPTModel, local spec), or TE stand-in linears."""
    from megatron_rrfp.bench.run import BenchConfig
    from megatron_rrfp.bench.stages import build_stage

    config = BenchConfig(pipeline_size=pp, tensor_parallel=tp, sequence_parallel=sequence_parallel,
                         num_microbatches=8)
    if not te:
        stage, forward_step, data = build_stage(config)
        return stage, forward_step, lambda seed: data(seed)
    raise NotImplementedError("TE stand-in pipeline stage")
