"""A LLaVA-style vision-language model as megatron-core pipeline stages.

    stage 0:      images -> ViT (patch conv + TransformerBlock) -> merge -> projector ┐
                  tokens -> GPT embedding ----------------------------------------- splice
                  -> decoder layers [0, L/pp)                                   -> [s, b, h]
    stage k:      decoder layers [k L/pp, (k+1) L/pp)                           -> [s, b, h]
    last stage:   decoder layers, final norm, output head, per-token loss

The transformer pieces are megatron-core's own: ``TransformerBlock`` with the ViT local
layer spec (attention switched to bidirectional), ``MultimodalProjector`` and ``GPTModel``
(local spec); only the patch convolution and position embedding are plain torch.
megatron-core's ``LLaVAModel``/``CLIPViTModel`` are not used: on a host without
Transformer Engine they cannot be built (see "Quirks" below).

Sequence layout (the pipeline contract): each sample's decoder sequence has a FIXED
length ``spec.seq_length``. Sample j's ``n_j`` images occupy its first
``n_j * spec.tokens_per_image`` positions, its text fills the rest. So every stage
boundary carries [seq_length, micro_batch, hidden] and megatron-core's 1F1B needs no
``variable_seq_lengths``, while the encoder work on stage 0 is proportional to
``sum_j n_j`` and varies from one micro-batch to the next: the multimodal imbalance a
readiness-first executor absorbs.

Tiny run on CPU (one process per stage, gloo)::

    megatron-rrfp train --cpu --nproc 2 --pipeline-model-parallel-size 2 --model multimodal \
        --pipeline-schedule rrfp --train-iters 5

Quirks of megatron-core 0.16.1's multimodal pieces without Transformer Engine / CUDA:
  - ``CLIPViTModel(model_subtype="clip")`` builds its pre-norm with ``torch.nn.LayerNorm``
    through ``build_module(..., config=...)``: TypeError (also on GPU hosts without TE).
    The other subtypes call ``torch.arange(...).cuda()`` in ``__init__``: no CPU build.
    ``LLaVAModel`` builds a ``CLIPViTModel``, so it inherits both.
  - ``get_vit_layer_with_local_spec()`` uses a *causal* attention mask while the TE spec
    uses ``no_mask``; we switch the local spec to ``no_mask`` (a ViT sees all patches).
  - ``MultimodalProjector`` with the local MLP submodules works as is.
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock

from ...mcore import compat
from .. import models

__all__ = [
    "MultimodalSpec", "MultimodalStage", "VisionEncoder", "build_multimodal_stage", "image_counts",
    "multimodal_config", "multimodal_forward_step", "synthetic_multimodal_batches",
]


# --------------------------------------------------------------------------- spec


@dataclass(frozen=True, kw_only=True, slots=True)
class MultimodalSpec:
    """Shapes of the vision side and of the decoder sequence (the language model's sizes
    live in the TransformerConfig, see ``multimodal_config``)."""

    vision_num_layers: int = 2
    """ViT transformer layers, all on the first pipeline stage."""
    vision_hidden_size: int = 32
    """ViT width (CLIP ViT-L/14: 1024)."""
    vision_num_attention_heads: int = 4
    """ViT attention heads (ViT-L: 16); must divide by the tensor-parallel size."""
    vision_ffn_hidden_size: int = 64
    """ViT MLP width (ViT-L: 4096)."""
    image_size: int = 16
    """Square image side in pixels (CLIP-336: 336)."""
    patch_size: int = 4
    """Square patch side in pixels; ``image_size`` must be a multiple. Patches per image:
    ``(image_size // patch_size) ** 2`` (CLIP-336/14: 576)."""
    channels: int = 3
    """Image channels."""
    tokens_per_image: int = 4
    """Decoder positions per image. Must divide the patch count; groups of
    ``patches // tokens_per_image`` consecutive (row-major) patch features are
    concatenated before the projector, a 1-D pixel shuffle. Equal to the patch count:
    no merging (LLaVA-1.5)."""
    max_images: int = 3
    """Cap on images per sample; the images tensor is padded to it."""
    vocab_size: int = 64
    """Text vocabulary of the decoder."""
    seq_length: int = 16
    """Decoder sequence length, images included: the [s, b, h] shape between stages.
    At least ``max_images * tokens_per_image + 1`` so every sample keeps some text."""

    def __post_init__(self):
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} is not a multiple of patch_size={self.patch_size}")
        if self.tokens_per_image < 1 or self.patches_per_image % self.tokens_per_image:
            raise ValueError(f"tokens_per_image={self.tokens_per_image} must divide the "
                             f"{self.patches_per_image} patches per image")
        if self.max_images * self.tokens_per_image >= self.seq_length:
            raise ValueError(f"max_images * tokens_per_image = {self.max_images} * {self.tokens_per_image} "
                             f"leaves no text in seq_length={self.seq_length}")

    @property
    def patches_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def patches_per_token(self) -> int:
        return self.patches_per_image // self.tokens_per_image


def multimodal_config(**overrides) -> TransformerConfig:
    """The decoder's TransformerConfig: ``models.tiny_gpt_config`` (fp32, CPU init, no
    dropout or fusions, 2 decoder layers per stage); keyword ``overrides`` win. The
    schedules read this config (p2p dtype, hidden size), so it is the stage's config;
    the ViT's is derived from it and the spec."""
    return models.tiny_gpt_config(**overrides)


def _vision_config(config: TransformerConfig, spec: MultimodalSpec) -> TransformerConfig:
    """The ViT's config: the decoder's numerics and TP, the spec's sizes, no pipelining
    (TransformerBlock would otherwise build only this rank's share of the layers), no
    context or sequence parallelism. A copy: the decoder's config is never mutated."""
    changes = dict(
        num_layers=spec.vision_num_layers, hidden_size=spec.vision_hidden_size,
        num_attention_heads=spec.vision_num_attention_heads, ffn_hidden_size=spec.vision_ffn_hidden_size,
        # Derived in __post_init__ from the sizes above; replace() would copy the decoder's.
        kv_channels=None, num_query_groups=None, init_method=None, output_layer_init_method=None,
        pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
        pipeline_model_parallel_layout=None, context_parallel_size=1, sequence_parallel=False,
        tp_comm_overlap=False)
    known = {f.name for f in dataclasses.fields(config)}  # fields come and go between releases
    return dataclasses.replace(config, **{k: v for k, v in changes.items() if k in known})


# --------------------------------------------------------------------------- modules


class VisionEncoder(MegatronModule):
    """A ViT: non-overlapping patch convolution + learned position embedding +
    megatron-core TransformerBlock (local spec, bidirectional) with its final norm.

    ``patch_tokens_processed`` counts the patch tokens that went through the transformer
    (images x patches); its compute grows linearly with it.
    """

    def __init__(self, config: TransformerConfig, spec: MultimodalSpec):
        super().__init__(config=config)
        self.patch_embed = torch.nn.Conv2d(spec.channels, config.hidden_size, kernel_size=spec.patch_size,
                                           stride=spec.patch_size, bias=False, dtype=config.params_dtype)
        self.position_embeddings = torch.nn.Parameter(
            torch.empty(spec.patches_per_image, config.hidden_size, dtype=config.params_dtype))
        config.init_method(self.position_embeddings.data)
        self.transformer = TransformerBlock(config=config, spec=_bidirectional_vit_spec(),
                                            pre_process=True, post_process=True)
        self.patch_tokens_processed = 0

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images [n, C, H, W] -> patch features [patches, n, hidden]."""
        x = self.patch_embed(images.to(self.position_embeddings.dtype))  # [n, h, H/p, W/p]
        x = x.flatten(2).permute(2, 0, 1)  # [patches, n, h], row-major patch order
        x = (x + self.position_embeddings.unsqueeze(1)).contiguous()
        self.patch_tokens_processed += x.shape[0] * x.shape[1]
        return self.transformer(x, attention_mask=None)


def _bidirectional_vit_spec():
    spec = copy.deepcopy(get_vit_layer_with_local_spec())
    spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.no_mask
    return spec


class MultimodalStage(MegatronModule):
    """One pipeline stage of the VLM (one model chunk with interleaving).

    The first stage owns ``vision`` and ``projector`` and splices image tokens into the
    embedded text; every stage owns its share of the GPT decoder in ``language_model``.
    Inputs / outputs are megatron-core's: ``set_input_tensor(list)``, [s, b, h] between
    stages, per-token loss [b, s] (with labels) on the last.
    """

    def __init__(self, config: TransformerConfig, spec: MultimodalSpec, *, pre_process: bool,
                 post_process: bool, vp_stage: int | None = None):
        super().__init__(config=config)
        self.model_type = ModelType.encoder_or_decoder  # read by the schedules
        self.spec = spec
        self.pre_process = pre_process
        self.post_process = post_process
        self.share_embeddings_and_output_weights = False  # read by finalize_model_grads
        self.vision = self.projector = None
        if pre_process:
            vision_config = _vision_config(config, spec)
            self.vision = VisionEncoder(vision_config, spec)
            mlp = compat.mlp_submodules(get_gpt_layer_local_spec().submodules.mlp)
            self.projector = MultimodalProjector(config, mlp, "mlp",
                                                 spec.vision_hidden_size * spec.patches_per_token)
        self.language_model = GPTModel(
            config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=spec.vocab_size,
            max_sequence_length=spec.seq_length, pre_process=pre_process, post_process=post_process,
            share_embeddings_and_output_weights=False, vp_stage=vp_stage)

    def set_input_tensor(self, input_tensor) -> None:
        if not isinstance(input_tensor, list):
            input_tensor = [input_tensor]
        self.language_model.set_input_tensor(input_tensor)

    def shared_embedding_or_output_weight(self):
        return self.language_model.shared_embedding_or_output_weight()

    def forward(self, images=None, num_images=None, tokens=None, position_ids=None, attention_mask=None,
                labels=None) -> torch.Tensor:
        """First stage: images [b, max_images, C, H, W], num_images [b], tokens and
        position_ids [b, s]. Last stage: labels [b, s] (loss [b, s] out; logits without).
        attention_mask [1, 1, s, s] (True = blocked) or None (causal)."""
        decoder_input = self._embed(images, num_images, tokens, position_ids) if self.pre_process else None
        return self.language_model(None, None, attention_mask, decoder_input=decoder_input, labels=labels)

    def _embed(self, images, num_images, tokens, position_ids) -> torch.Tensor:
        text = self.language_model.embedding(input_ids=tokens, position_ids=position_ids)  # [s, b, h]
        device, seq = tokens.device, tokens.shape[1]
        num_images = num_images.to(device=device, dtype=torch.long)
        present = torch.arange(images.shape[1], device=device) < num_images.unsqueeze(1)  # [b, max_images]
        if not bool(present.any()):  # a host sync (.any() -> bool), once per micro-batch
            # Text-only micro-batch: no encoder work. The 0 * sum keeps every encoder
            # parameter in the graph so DDP's gradient hooks fire the same way each time.
            touch = sum(p.sum() for p in (*self.vision.parameters(), *self.projector.parameters()))
            return text + 0.0 * touch
        features = self.vision(images[present])  # [patches, n, hv], n = sum(num_images)
        _, n, width = features.shape
        # Concatenate groups of patches_per_token consecutive patches: [tokens, n, hv * k].
        merged = features.view(self.spec.tokens_per_image, self.spec.patches_per_token, n, width)
        merged = merged.permute(0, 2, 1, 3).reshape(self.spec.tokens_per_image, n, -1)
        image_tokens = self.projector(merged)  # [tokens, n, h]
        # Sample j's images fill its first num_images[j] * tokens_per_image positions,
        # in order; boolean indexing walks [b, s] row-major, i.e. sample by sample.
        is_image = torch.arange(seq, device=device) < (num_images * self.spec.tokens_per_image).unsqueeze(1)
        combined = text.transpose(0, 1).clone()  # [b, s, h]
        combined[is_image] = image_tokens.transpose(0, 1).reshape(-1, image_tokens.shape[-1])
        return combined.transpose(0, 1).contiguous()


def build_multimodal_stage(config: TransformerConfig, spec: MultimodalSpec, *, seed: int,
                           pre_process: bool | None = None, post_process: bool | None = None,
                           vp_stage: int | None = None) -> MultimodalStage:
    """This rank's stage: the ViT and projector iff it embeds (first stage, first model
    chunk), ``config.num_layers`` decoder layers split by megatron-core over the stages.

    Initialisation is a function of (seed, pp rank, vp_stage) only, as in
    ``models.build_gpt_stage``: the CPU generator is seeded around construction and
    restored afterwards; TP ranks draw full weights and keep their shard.
    """
    if config.context_parallel_size > 1 or config.sequence_parallel:
        # Image tokens are spliced into the whole [s, b, h] on stage 0; sharding it needs
        # LLaVAModel-style re-scattering this recipe does not do (and megatron-core's local
        # norm refuses sequence_parallel without apex anyway).
        raise ValueError(f"multimodal recipe: context_parallel_size={config.context_parallel_size}, "
                         f"sequence_parallel={config.sequence_parallel}: only CP=1 without sequence "
                         "parallelism is supported")
    pre_process, post_process = models.stage_roles(pre_process, post_process, vp_stage)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(models.stage_seed(seed, pp_rank, vp_stage))
        return MultimodalStage(config, spec, pre_process=pre_process, post_process=post_process,
                               vp_stage=vp_stage)


# --------------------------------------------------------------------------- data


def synthetic_multimodal_batches(spec: MultimodalSpec, *, seed: int, micro_batch_size: int,
                                 images_per_sample_mean: float = 1.0):
    """Endless deterministic VLM micro-batches, identical on every rank for one seed.

    Images per sample ~ Poisson(images_per_sample_mean), capped at ``spec.max_images``.
    Each batch is a dict:
      images         [b, max_images, C, H, W] float; slots past a sample's count are 0
      num_images     [b] int64
      tokens         [b, s] int64; image positions hold 0 (replaced by image tokens)
      labels         [b, s] int64, the next token
      loss_mask      [b, s] float; 0 on image positions (as LLaVA), 1 on text
      position_ids   [b, s] int64, 0..s-1 (images count as positions)
      attention_mask [1, 1, s, s] bool, True where blocked (causal over images and text)
    """
    if images_per_sample_mean < 0:
        raise ValueError(f"images_per_sample_mean={images_per_sample_mean} must be >= 0")
    generator = torch.Generator().manual_seed(seed)
    b, s = micro_batch_size, spec.seq_length
    blocked = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
    positions = torch.arange(s)
    image_shape = (b, spec.max_images, spec.channels, spec.image_size, spec.image_size)
    while True:
        rate = torch.full((b,), float(images_per_sample_mean))
        counts = torch.poisson(rate, generator=generator).clamp(max=spec.max_images).to(torch.int64)
        images = torch.randn(image_shape, generator=generator)
        images[torch.arange(spec.max_images) >= counts.unsqueeze(1)] = 0.0
        text = torch.randint(spec.vocab_size, (b, s + 1), generator=generator)
        is_image = positions < (counts * spec.tokens_per_image).unsqueeze(1)
        tokens = text[:, :-1].masked_fill(is_image, 0)
        yield {
            "images": images,
            "num_images": counts,
            "tokens": tokens,
            "labels": text[:, 1:].contiguous(),
            "loss_mask": (~is_image).float(),
            "position_ids": positions.expand(b, -1).clone(),
            "attention_mask": blocked.clone(),
        }


def image_counts(batch: dict) -> list[int]:
    """Images per sample of a ``synthetic_multimodal_batches`` micro-batch."""
    return [int(n) for n in batch["num_images"]]


def multimodal_forward_step(data_iterator, model: MultimodalStage):
    """forward_step_func for megatron-core schedules (and our executor) on a VLM stage.

    Like ``models.gpt_forward_step``: a stage draws one batch per micro-batch iff it
    embeds or has the head (first and last), a middle stage draws nothing and passes
    attention_mask=None; loss in the 3-tuple form (summed loss, token count, report).
    """
    pre_process, post_process = models.roles_of(model)
    batch = next(data_iterator) if (pre_process or post_process) else None
    if batch is None:
        return model(), partial(models._gpt_loss, None)
    inputs = {}
    if pre_process:
        inputs = {key: batch[key] for key in ("images", "num_images", "tokens", "position_ids")}
    output = model(**inputs, attention_mask=batch["attention_mask"],
                   labels=batch["labels"] if post_process else None)
    return output, partial(models._gpt_loss, batch["loss_mask"])


class MultimodalStream:
    """A sequential multimodal stream for this DP rank (seeded by seed and DP rank);
    ``microbatches`` fast-forwards (or restarts) to the requested position."""

    def __init__(self, spec, *, seed: int, micro_batch_size: int, images_per_sample: float, dp_rank: int,
                 dp_size: int, device: torch.device) -> None:
        self.spec, self.seed, self.micro_batch_size = spec, seed + 7919 * dp_rank, micro_batch_size
        self.images_per_sample, self.dp_size, self.device = images_per_sample, dp_size, device
        self._stream, self._position = None, 0  # position: micro-batches drawn from _stream

    def microbatches(self, consumed_samples: int, count: int) -> Iterator[dict]:
        target = consumed_samples // (self.micro_batch_size * self.dp_size)
        if self._stream is None or self._position > target:
            self._stream = synthetic_multimodal_batches(self.spec, seed=self.seed,
                                                        micro_batch_size=self.micro_batch_size,
                                                        images_per_sample_mean=self.images_per_sample)
            self._position = 0
        for _ in range(target - self._position):  # resume: skip what earlier runs consumed
            next(self._stream)
        self._position = target
        for _ in range(count):
            self._position += 1
            yield {key: value.to(self.device) for key, value in next(self._stream).items()}
