"""``1x`` in bytes on real megatron-core GPT stages (tests/distributed/test_memory_bytes.py): Megatron's
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

    from megatron_rrfp.bench.around_schedules import count_in_flight, count_received, sleep_before_tasks
    from megatron_rrfp.cpu import enable_cpu_reference_schedules
    from megatron_rrfp.mcore.compat import pipeline_device
    from megatron_rrfp.mcore.config import RRFPConfig
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
    jitter = sleep_before_tasks(lambda task: rng.uniform(0.0, jitter_s)) if jitter_s else None
    worst = 0.0
    for _ in range(calls):
        zero()
        forward_backward_rrfp(data_iterator=data(0), rrfp_config=RRFPConfig.of(timeout_s=120.0, around_task=jitter),
                              **kwargs)
        r = last_iteration_report()
        ours = grads()
        worst = max([worst] + [float((ours[n] - g).abs().max()) for n, g in reference.items()])
        out["rrfp"].append({"bytes": r.peak_activation_bytes, "in_flight": r.peak_in_flight,
                            "byte_budget": r.byte_budget, "unsplit": r.unsplit_backwards,
                            "split": any(t.kind.value == "W" for t in r.order)})
    out["max_grad_diff"] = worst
    from megatron_rrfp.mcore.state import ScheduleState

    out["budgets"] = [repr(state.budgets) for state in ScheduleState.get().byte_budgets.values()]
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
    return _te_sp_stage(sequence_parallel=sequence_parallel)


_SEQ = 32


def _te_sp_stage(*, sequence_parallel: bool):
    """A pipeline stage of Transformer Engine stand-in linears (helpers/te_standin.py): x (this
    rank's sequence shard) -> norm -> te1 (column, SP: gathers the sequence) -> gelu -> te2 (row)
    -> this rank's shard, + x; the last stage's loss is the squared output. Seeded alike on
    every rank, so Megatron's schedule and RRFP's run the same function."""
    from functools import partial

    import torch
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType
    from megatron.core.transformer.module import MegatronModule

    from helpers import mlp, te_standin
    from megatron_rrfp.train import models

    config = models.tiny_gpt_config(sequence_parallel=sequence_parallel)
    group = parallel_state.get_tensor_model_parallel_group()
    tp, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    pre, post = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    hidden, ffn = config.hidden_size, config.ffn_hidden_size

    class Stage(MegatronModule):
        def __init__(self):
            super().__init__(config=config)
            self.model_type = ModelType.encoder_or_decoder
            self.share_embeddings_and_output_weights = False
            self.pre_process, self.post_process, self.input_tensor = pre, post, None
            torch.manual_seed(17 + parallel_state.get_pipeline_model_parallel_rank())
            self.norm = torch.nn.LayerNorm(hidden)
            self.te1 = te_standin.Linear(hidden, ffn, parallel_mode="column", sequence_parallel=sequence_parallel,
                                         tp_group=group)
            self.te2 = te_standin.Linear(ffn, hidden, parallel_mode="row")

        def set_input_tensor(self, input_tensor):
            self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

        def forward(self, inputs=None):
            x = inputs if self.pre_process else self.input_tensor
            y = self.te2(torch.nn.functional.gelu(self.te1(self.norm(x))))
            if sequence_parallel:
                y = y.narrow(0, rank * x.shape[0], x.shape[0])
            return x + y

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["inputs"] if pre else None)
        return output, partial(mlp._mlp_loss, torch.zeros_like(output) if post else None)

    def data(seed: int):
        for batch in mlp.synthetic_mlp_batches(seed=seed, micro_batch_size=2, seq_length=_SEQ, hidden_size=hidden):
            inputs = batch["inputs"]
            if sequence_parallel:
                inputs = inputs.narrow(0, rank * (_SEQ // tp), _SEQ // tp).contiguous()
            yield {"inputs": inputs}
    return Stage(), forward_step, data
