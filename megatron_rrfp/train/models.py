"""GPT pipeline stages and synthetic data for the training driver and the benchmarks.

``build_gpt_stage``: megatron-core's own ``GPTModel`` with the local (no Transformer
Engine) layer spec, as one pipeline stage (``set_input_tensor(list)``, a ``config``
attribute, the stage's role in ``pre_process``/``post_process``): the real thing, tiny.
Call ``megatron_rrfp.cpu.enable_cpu_reference_schedules()`` before running it on a
CPU-only host.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

__all__ = ["build_gpt_stage", "build_hybrid_stage", "gpt_forward_step", "parallel_sizes", "roles_of", "stage_roles",
           "stage_seed", "synthetic_gpt_batches", "tiny_gpt_config"]


# --------------------------------------------------------------------------- config


def moe_fields(*, num_experts: int | None, expert_parallel: int, topk: int, dispatcher: str,
               aux_loss_coeff: float) -> dict:
    """TransformerConfig fields of a MoE GPT (empty for a dense one: ``num_experts`` None or 0):
    megatron-core's SequentialMLP experts; grouped GEMM off (it needs the grouped_gemm CUDA
    kernels, and the split backward covers SequentialMLP's linears)."""
    if not num_experts:
        return {}
    return dict(num_moe_experts=num_experts, expert_model_parallel_size=expert_parallel, moe_router_topk=topk,
                moe_token_dispatcher_type=dispatcher, moe_aux_loss_coeff=aux_loss_coeff, moe_grouped_gemm=False)


def tiny_gpt_config(**overrides) -> TransformerConfig:
    """A tiny fp32 TransformerConfig that runs on CPU; keyword ``overrides`` win.

    Parallel sizes default to megatron's initialised parallel_state (1 when it is not
    initialised): TransformerBlock splits layers by ``config.pipeline_model_parallel_size``
    but picks its share by parallel_state's rank, so the two must agree.
    ``num_layers`` defaults to 2 per (virtual) stage. Dropout is 0 so results do not
    depend on RNG streams (the CUDA RNG tracker is a no-op on CPU, see cpu/megatron_core.py), and all
    fusions are off (they need CUDA kernels).
    """
    tp, pp, vpp, cp = parallel_sizes()
    defaults = dict(
        num_layers=2 * pp * (vpp or 1),
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,  # dtype of p2p receive buffers; required when PP > 1
        use_cpu_initialization=True,  # init full weights on CPU, then take this TP shard
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        deallocate_pipeline_outputs=True,  # as in Megatron-LM training: exercises custom_backward
    )
    defaults.update(overrides)
    return TransformerConfig(**defaults)


def parallel_sizes() -> tuple[int, int, int | None, int]:
    """(tp, pp, vpp, cp) of megatron's parallel_state, or sizes 1 if not initialised."""
    if not parallel_state.model_parallel_is_initialized():
        return 1, 1, None, 1
    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_virtual_pipeline_model_parallel_world_size(),
            parallel_state.get_context_parallel_world_size())


def stage_roles(pre_process, post_process, vp_stage) -> tuple[bool, bool]:
    """Default roles from parallel_state; with interleaving only the first (last) model
    chunk of the first (last) rank embeds (has the head)."""
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                             vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                             vp_stage=vp_stage)
    return pre_process, post_process


def stage_seed(seed: int, pp_rank: int, vp_stage: int | None) -> int:
    # Distinct per (pp rank, model chunk), equal across TP and DP ranks: with
    # use_cpu_initialization every TP rank draws the *full* weight and keeps its shard.
    return seed + 1_000 * pp_rank + 100_000 * (vp_stage or 0)


# --------------------------------------------------------------------------- GPT


def build_gpt_stage(config: TransformerConfig, *, vocab_size: int, seq_length: int, seed: int,
                    pre_process: bool | None = None, post_process: bool | None = None,
                    vp_stage: int | None = None) -> GPTModel:
    """This rank's GPTModel stage (one model chunk when interleaving: pass ``vp_stage``).

    Initialisation is a function of (seed, pp rank, vp_stage) only: the CPU generator is
    seeded around construction (model_parallel_cuda_manual_seed needs CUDA) and restored
    afterwards. So stages differ from the same layers of a PP=1 model; to compare with
    one, copy its weights in with ``pp1_parameter_names``. Embeddings and output layer
    are untied, so PP>1 needs no embedding-group all-reduce.
    """
    pre_process, post_process = stage_roles(pre_process, post_process, vp_stage)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stage_seed(seed, pp_rank, vp_stage))
        return GPTModel(config=config, transformer_layer_spec=_layer_spec(config, vp_stage, pp_rank),
                        vocab_size=vocab_size, max_sequence_length=seq_length,
                        pre_process=pre_process, post_process=post_process,
                        share_embeddings_and_output_weights=False, vp_stage=vp_stage)


class SequenceParallelTorchNorm:
    """torch's LayerNorm / RMSNorm with ``sequence_parallel=True`` on its parameters, so
    finalize_model_grads all-reduces their gradients over TP. megatron-core's torch norm
    refuses sequence parallelism (it is apex's / TE's job on GPUs); the CPU models use this."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm


def _layer_spec(config: TransformerConfig, vp_stage, pp_rank):
    """The local spec (with experts for MoE); with sequence parallelism and megatron's torch norm (no apex / TE),
    its norms replaced by ``SequenceParallelTorchNorm``."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm)
    if not config.sequence_parallel or getattr(gpt_layer_specs, "LNImpl", None) is not WrappedTorchNorm:
        return spec
    norms = {name: SequenceParallelTorchNorm for name in ("input_layernorm", "pre_mlp_layernorm")
             if getattr(spec.submodules, name, None) is WrappedTorchNorm}
    layer = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **norms))
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * count, layer_norm=SequenceParallelTorchNorm)


def build_hybrid_stage(config: TransformerConfig, *, hybrid_layer_pattern: str, vocab_size: int, seq_length: int,
                       seed: int, pre_process: bool | None = None, post_process: bool | None = None,
                       vp_stage: int | None = None):
    """This rank's HybridModel stage (megatron-core >= 0.18) with the local stack spec
    (mcore/hybrid_spec.py); the pattern's '|' segments pick its layers (segment
    vp_stage x PP + pp rank). Initialised, embedded and fed like ``build_gpt_stage``
    (learned absolute positions, untied output layer), so ``gpt_forward_step`` drives it."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from ..mcore.hybrid_spec import hybrid_stack_spec

    pre_process, post_process = stage_roles(pre_process, post_process, vp_stage)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stage_seed(seed, pp_rank, vp_stage))
        return HybridModel(config=config, hybrid_stack_spec=hybrid_stack_spec, vocab_size=vocab_size,
                           max_sequence_length=seq_length, hybrid_layer_pattern=hybrid_layer_pattern,
                           pre_process=pre_process, post_process=post_process,
                           share_embeddings_and_output_weights=False, position_embedding_type="learned_absolute",
                           vp_stage=vp_stage)


def synthetic_gpt_batches(*, seed: int, micro_batch_size: int, seq_length: int,
                          vocab_size: int):
    """Endless deterministic GPT micro-batches, identical on every rank for one seed.

    Each is a dict shaped like Megatron-LM's ``get_batch``: tokens, labels, position_ids
    [b, s] int64; loss_mask [b, s] float; attention_mask [1, 1, s, s] bool, True where
    attention is *blocked* (causal).
    """
    from .data import gpt_batch  # one definition of Megatron-LM's get_batch layout

    generator = torch.Generator().manual_seed(seed)
    while True:
        text = torch.randint(vocab_size, (micro_batch_size, seq_length + 1), generator=generator)
        yield gpt_batch(text.numpy(), torch.device("cpu"))


def gpt_forward_step(data_iterator, model: GPTModel, return_schedule_plan: bool = False):
    """forward_step_func for megatron-core schedules (and our executor) on a GPT stage.

    Data: a stage (model chunk) draws one batch per micro-batch iff it embeds or has the
    head; a middle stage draws nothing and passes attention_mask=None (the causal mask is
    then built inside attention), like Megatron-LM's get_batch. Every stage's iterator
    must yield micro-batches in the same order.
    Loss: the 3-tuple form (summed loss, token count, report); the schedule divides by
    the token count and the number of micro-batches.
    ``return_schedule_plan``: megatron-core's combined-1F1B step (``overlap_moe_expert_parallel_comm``)
    asks for the model's schedule plan in place of its output, as Megatron-LM's pretrain_gpt.py builds it.
    """
    pre_process, post_process = roles_of(model)
    batch = next(data_iterator) if (pre_process or post_process) else None
    if return_schedule_plan:
        if batch is None:
            return model.build_schedule_plan(None, None, None), partial(_gpt_loss, None)
        plan = model.build_schedule_plan(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                                         labels=batch["labels"] if post_process else None)
        return plan, partial(_gpt_loss, batch["loss_mask"])
    if batch is None:
        output = model(None, None, None)
        return output, partial(_gpt_loss, None)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"] if post_process else None)
    return output, partial(_gpt_loss, batch["loss_mask"])


def roles_of(model) -> tuple[bool, bool]:
    """(pre_process, post_process) of a stage, through DDP / Float16Module wrappers."""
    from megatron.core.utils import get_attr_wrapped_model

    return get_attr_wrapped_model(model, "pre_process"), get_attr_wrapped_model(model, "post_process")


def _gpt_loss(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)  # per-token cross entropy [b*s]
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}
