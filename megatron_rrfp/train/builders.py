"""The pieces ``megatron-rrfp train`` assembles, each from megatron-core's own parts.

  build_model       GPTModel (local spec; one per model chunk when interleaving), HybridModel
                    (mcore/hybrid_spec.py) or the multimodal recipe's stage, each wrapped in
                    megatron-core's DistributedDataParallel like Megatron-LM's get_model
  build_optimizer   get_megatron_optimizer(OptimizerConfig) + OptimizerParamScheduler
                    (linear warmup, cosine decay to --min-lr, steps = iterations)
  build_schedule    the forward-backward function: megatron-core's own (1f1b) or
                    forward_backward_rrfp, with the same keyword arguments
  build_data        the micro-batch source (see train/data.py)
  build_recorder    the goodput hooks (--rrfp-goodput-ledger; goodput/recorder.py)

The config hooks are set as Megatron-LM's training loop sets them: ``no_sync_func`` (DDP
no_sync; a list per chunk when interleaving, with ``grad_sync_func`` / ``param_sync_func``
for --overlap-grad-reduce / --overlap-param-gather), ``finalize_model_grads_func`` (DDP
finish + embedding/layernorm all-reduces) and ``grad_scale_func`` (the optimizer's loss scale).
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from . import hybrid, models
from .recipes import multimodal

_SPEC_FIELDS = ("vision_num_layers", "vision_hidden_size", "vision_num_attention_heads", "image_size", "patch_size",
                "tokens_per_image", "max_images")  # TrainConfig fields named as MultimodalSpec's; None = recipe default


def multimodal_spec(cfg):
    overrides = {"vocab_size": cfg.vocab_size, "seq_length": cfg.seq_length}
    overrides.update({name: getattr(cfg, name) for name in _SPEC_FIELDS if getattr(cfg, name) is not None})
    if cfg.vision_hidden_size is not None:
        overrides["vision_ffn_hidden_size"] = 4 * cfg.vision_hidden_size
    return multimodal.MultimodalSpec(**overrides)


def transformer_config(cfg):
    """The decoder's TransformerConfig: the repo's tiny CPU-safe defaults (fp32, no
    dropout, no fused kernels, CPU initialisation) with the run's sizes."""
    num_layers = hybrid.pattern_layers(cfg.hybrid_layer_pattern) if cfg.model == "hybrid" else cfg.num_layers
    sizes = dict(num_layers=num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                 ffn_hidden_size=cfg.ffn_hidden_size or 4 * cfg.hidden_size)
    if cfg.model == "multimodal":
        return multimodal.multimodal_config(**sizes)
    if cfg.bf16:  # Megatron-LM's --bf16: bf16 weights and p2p, fp32 main weights in the optimizer
        sizes.update(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    if getattr(cfg, "sequence_parallel", False):
        sizes.update(sequence_parallel=True)
    config = models.tiny_gpt_config(**sizes, **moe_options(cfg))
    if getattr(cfg, "overlap_moe_expert_parallel_comm", False):
        # set after the config is built: its bf16/fp16 assertion (validated by train for GPUs) would refuse CPU fp32
        config.overlap_moe_expert_parallel_comm = True
        config.delay_wgrad_compute = bool(getattr(cfg, "delay_wgrad_compute", False))
    return config


def moe_options(c) -> dict:
    """TransformerConfig fields for ``train``'s MoE flags (empty for a dense model)."""
    return models.moe_fields(num_experts=c.num_experts, expert_parallel=c.expert_model_parallel_size,
                             topk=c.moe_router_topk, dispatcher=c.moe_token_dispatcher_type,
                             aux_loss_coeff=c.moe_aux_loss_coeff)


def build_model(cfg, device: torch.device) -> list:
    """This rank's model chunks on ``device`` (one, or --virtual-pipeline-model-parallel-size),
    each wrapped in megatron-core DDP as Megatron-LM's get_model wraps them (bucketing only in
    chunk 0); the shared config hooked as Megatron-LM's training loop hooks it."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    config = transformer_config(cfg)
    vpp = getattr(cfg, "virtual_pipeline_model_parallel_size", None)
    if vpp is not None:  # Megatron-LM's defaults with interleaving (batched p2p is wrong at PP=2 anyway)
        config.overlap_p2p_comm, config.batch_p2p_comm = True, False
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = _build_stage(cfg, config, vp_stage=None if vpp is None else vp_stage)
        stage.to(device)  # weights are drawn on CPU (deterministic for any device), then moved
        if cfg.bf16:
            from megatron.core.transformer.module import Float16Module

            stage = Float16Module(config, stage)  # bf16 inputs in, fp32 logits out, as Megatron-LM wraps it
        # bf16: gradients accumulate and all-reduce in fp32 (Megatron-LM's default with --bf16)
        chunks.append(DistributedDataParallel(config, DistributedDataParallelConfig(**ddp_options(cfg)), stage,
                                              disable_bucketing=vp_stage > 0))
    config.finalize_model_grads_func = finalize_model_grads
    if vpp is None:  # no grad_sync_func: every pipeline rank reduces during its backward
        config.no_sync_func = chunks[0].no_sync
        return chunks
    # Megatron-LM's train(): per-chunk no_sync; start_grad_sync with --overlap-grad-reduce (align_grad_reduce);
    # start_param_sync with --overlap-param-gather (align_param_gather: on with interleaving)
    config.no_sync_func = [chunk.no_sync for chunk in chunks]
    if cfg.overlap_grad_reduce:
        config.grad_sync_func = [chunk.start_grad_sync for chunk in chunks]
    if cfg.overlap_param_gather:
        config.param_sync_func = [chunk.start_param_sync for chunk in chunks]
    return chunks


def _build_stage(cfg, config, *, vp_stage):
    if cfg.model == "multimodal":
        return multimodal.build_multimodal_stage(config, multimodal_spec(cfg), seed=cfg.seed)
    if cfg.model == "hybrid":
        return models.build_hybrid_stage(config, hybrid_layer_pattern=cfg.hybrid_layer_pattern,
                                         vocab_size=cfg.vocab_size, seq_length=cfg.seq_length, seed=cfg.seed)
    return models.build_gpt_stage(config, vocab_size=cfg.vocab_size, seq_length=cfg.seq_length, seed=cfg.seed,
                                  vp_stage=vp_stage)


def ddp_options(cfg) -> dict:
    """DistributedDataParallelConfig of the run: the production flags (Megatron-LM's names)."""
    overlap_param_gather = getattr(cfg, "overlap_param_gather", False)
    return dict(use_distributed_optimizer=getattr(cfg, "use_distributed_optimizer", False),
                overlap_grad_reduce=getattr(cfg, "overlap_grad_reduce", False),
                overlap_param_gather=overlap_param_gather,
                align_param_gather=overlap_param_gather and getattr(cfg, "virtual_pipeline_model_parallel_size", None)
                is not None, grad_reduce_in_fp32=cfg.bf16)


def forward_step_func(cfg) -> Callable:
    return multimodal.multimodal_forward_step if cfg.model == "multimodal" else models.gpt_forward_step


def build_optimizer(cfg, chunks: list, timers=None):
    """(optimizer, scheduler): megatron-core's Adam (torch's when TE/apex are absent); with
    --bf16 its mixed-precision optimizer (fp32 main weights); ``timers``: Megatron's."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from ..cpu import cpu_tensor_types_named_as_cuda, enable_cpu_optimizer

    if cfg.cpu:
        enable_cpu_optimizer()
    with cpu_tensor_types_named_as_cuda():  # bf16 on CPU: see there
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
                            adam_beta1=0.9, adam_beta2=0.95, clip_grad=cfg.clip_grad, bf16=cfg.bf16, fp16=False,
                            use_distributed_optimizer=getattr(cfg, "use_distributed_optimizer", False),
                            timers=timers),
            chunks)
    chunks[0].config.grad_scale_func = optimizer.scale_loss
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.min_lr, lr_warmup_steps=cfg.lr_warmup_iters,
        lr_decay_steps=cfg.train_iters, lr_decay_style="cosine", start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay, wd_incr_steps=cfg.train_iters, wd_incr_style="constant")
    return optimizer, scheduler


def build_schedule(cfg) -> Callable:
    """forward_backward_func(**megatron's schedule keywords) -> per-microbatch loss dicts."""
    if cfg.pipeline_schedule == "rrfp":
        from ..mcore.schedule import forward_backward_rrfp
        from ..megatron_lm.flags import rrfp_config_from_args

        return functools.partial(forward_backward_rrfp, rrfp_config=rrfp_config_from_args(cfg))
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()


def build_data(cfg, *, dp_rank: int, dp_size: int, device: torch.device):
    from . import data

    common = dict(micro_batch_size=cfg.micro_batch_size, dp_rank=dp_rank, dp_size=dp_size, device=device)
    if cfg.model == "multimodal":
        return multimodal.MultimodalStream(multimodal_spec(cfg), seed=cfg.seed, images_per_sample=cfg.images_per_sample,
                                     **common)
    if cfg.data_path:
        from megatron.core import parallel_state as ps

        reads = ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage()  # middle stages read no data
        return data.IndexedTokens(cfg.data_path, vocab_size=cfg.vocab_size, seq_length=cfg.seq_length,
                                  num_samples=cfg.train_iters * cfg.global_batch_size, seed=cfg.seed, build=reads,
                                  cache_dir=cfg.data_cache_path, **common)
    return data.SyntheticTokens(vocab_size=cfg.vocab_size, seed=cfg.seed, seq_length=cfg.seq_length, **common)


def build_recorder(cfg, dp: int, *, since_wall: float):
    """The goodput hooks (megatron_rrfp.goodput.recorder): no-ops on every rank without
    --rrfp-goodput-ledger; with it rank 0 writes, and the time since ``since_wall`` (the
    process start) counts as startup.

    Another live job writing the same ledger fails every rank here with a ValueError, before
    training (collective: the ranks agree on it, so none waits for a peer that left). Any other ledger problem only
    warns (LedgerWarning); the recorder then still joins the per-iteration gathers."""
    import torch.distributed as dist

    from ..goodput.recorder import open_recorder
    from ..goodput.schema import LedgerBusyError

    try:
        recorder = open_recorder(cfg.rrfp_goodput_ledger, rank=dist.get_rank(), world=dist.get_world_size(),
                                 job=f"megatron-rrfp train {cfg.model}", since_wall=since_wall)
    except LedgerBusyError as exc:  # every rank: a user error (exit 2), not a crash
        raise ValueError(str(exc)) from None
    recorder.job_start(pp=cfg.pipeline_model_parallel_size, tp=cfg.tensor_model_parallel_size, dp=dp,
                       schedule=cfg.pipeline_schedule, model=cfg.model, train_iters=cfg.train_iters,
                       tokens_per_iteration=cfg.global_batch_size * cfg.seq_length)
    return recorder


# --------------------------------------------------------------------------- CPU optimizer
#
