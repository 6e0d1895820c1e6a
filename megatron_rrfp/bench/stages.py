"""What each benchmark rank builds: its stage (GPT, HybridModel, MoE GPT or the multimodal
recipe, from megatron-core blocks), its data, and megatron-core DDP around it when the
bench's DP flags ask for it. ``config`` is a ``bench.run.BenchConfig``."""
from __future__ import annotations

from ..sim.variability import Variability

__all__ = ["build_stage", "moe_options", "with_ddp"]


def moe_options(workload: Variability) -> dict:
    """The benchmark's MoE GPT (alltoall dispatcher, aux loss); the emulated durations carry
    the modeled expert load (sim/variability.py)."""
    from ..train import models

    return models.moe_fields(num_experts=workload.num_experts, expert_parallel=workload.expert_parallel,
                             topk=workload.moe_topk, dispatcher="alltoall", aux_loss_coeff=0.01)


def build_stage(config):
    from megatron.core import parallel_state

    from ..train import models

    if config.model in ("gpt", "hybrid"):
        # batch_p2p_comm off: Megatron's interleaved schedule computes wrong gradients with it at PP=2
        tconfig = models.tiny_gpt_config(hidden_size=config.hidden_size, batch_p2p_comm=config.num_chunks == 1,
                                         sequence_parallel=config.sequence_parallel,
                                         **moe_options(config.workload))
        if getattr(config, "overlap_moe_expert_parallel_comm", False):  # as train sets them (train/builders.py)
            tconfig.overlap_moe_expert_parallel_comm = True
            tconfig.delay_wgrad_compute = bool(config.delay_wgrad_compute)
        vp_stages = [c if config.num_chunks > 1 else None for c in range(config.num_chunks)]
        if config.model == "gpt":
            chunks = [models.build_gpt_stage(tconfig, vocab_size=128, seq_length=config.seq_length, seed=config.seed,
                                             vp_stage=vp) for vp in vp_stages]
        else:  # as many layers as the GPT stages (tiny_gpt_config: 2 per chunk), as attention + MLP layers
            pattern = "|".join(["*-"] * (config.pipeline_size * config.num_chunks))
            chunks = [models.build_hybrid_stage(tconfig, hybrid_layer_pattern=pattern, vocab_size=128,
                                                seq_length=config.seq_length, seed=config.seed, vp_stage=vp)
                      for vp in vp_stages]

        def data(seed: int):
            seed += 1_000_003 * parallel_state.get_data_parallel_rank()  # each replica its own tokens
            iterators = [models.synthetic_gpt_batches(seed=seed, micro_batch_size=config.micro_batch_size,
                                                      seq_length=config.seq_length, vocab_size=128)
                         for _ in chunks]
            return iterators if len(chunks) > 1 else iterators[0]
        return (chunks if len(chunks) > 1 else chunks[0]), models.gpt_forward_step, data
    from ..train.recipes import multimodal

    spec = multimodal.MultimodalSpec(seq_length=config.seq_length)
    if config.image_size is not None:  # LLaVA's shape: one image per sample, a token per patch
        patches = (config.image_size // config.patch_dim) ** 2
        spec = multimodal.MultimodalSpec(seq_length=config.seq_length, image_size=config.image_size,
                                         patch_size=config.patch_dim, tokens_per_image=patches, max_images=1)
    tconfig = multimodal.multimodal_config(hidden_size=config.hidden_size)
    stage = multimodal.build_multimodal_stage(tconfig, spec, seed=config.seed)

    # LLaVA: a Poisson count far above the cap of 1 gives every sample its image
    mean = 100.0 if config.image_size is not None else max(config.workload.images_per_sample, 1.0)

    def data(seed: int):
        return multimodal.synthetic_multimodal_batches(
            spec, seed=seed, micro_batch_size=config.micro_batch_size, images_per_sample_mean=mean)
    return stage, multimodal.multimodal_forward_step, data


def with_ddp(config, stage):
    """--overlap-grad-reduce / --use-distributed-optimizer: megatron-core DDP around every
    chunk, config hooked as Megatron-LM's training loop hooks it (the same for every schedule)."""
    if not (config.overlap_grad_reduce or config.use_distributed_optimizer):
        return stage
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    chunks = stage if isinstance(stage, list) else [stage]
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=config.overlap_grad_reduce,
                                               use_distributed_optimizer=config.use_distributed_optimizer)
    wrapped = [DistributedDataParallel(chunk.config, ddp_config, chunk) for chunk in chunks]
    tconfig = chunks[0].config
    tconfig.no_sync_func = [w.no_sync for w in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    tconfig.finalize_model_grads_func = finalize_model_grads
    return wrapped if isinstance(stage, list) else wrapped[0]
