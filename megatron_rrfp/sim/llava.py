"""LLaVA's shapes (Megatron-LM's pretrain_vlm.py, megatron-core's LLaVAModel) as a workload.

pretrain_vlm.py puts the CLIP ViT and its MLP projection on the first pipeline stage and
splices every sample's image tokens into the decoder's sequence; its ViT is a copy of the
decoder's TransformerConfig (same hidden size), ``--encoder-num-layers`` deep. One image per
sample, so the encoder is a fixed extra cost on stage 0, not a varying one: it enters the
duration model as stage 0's factor (``straggler_stage=0``; F, B and W alike), from
Megatron's per-layer FLOP count ``24 s h^2 + 4 s^2 h`` (attention with an MLP of 4h).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..checks import Bound, integer
from ..options import option


def image_tokens(img_h: int, img_w: int, patch_dim: int, class_token: bool = True) -> int:
    """Image tokens per sample: CLIP's patches plus its class token (get_num_image_embeddings
    with --disable-vision-class-token unset)."""
    for name, value in (("--img-h", img_h), ("--img-w", img_w), ("--patch-dim", patch_dim)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if img_h % patch_dim or img_w % patch_dim:
        raise ValueError(f"--img-h {img_h} and --img-w {img_w} must be multiples of --patch-dim {patch_dim}")
    return (img_h // patch_dim) * (img_w // patch_dim) + int(class_token)


def _layer_flops(tokens: int, hidden: int) -> float:
    return 24.0 * tokens * hidden ** 2 + 4.0 * tokens ** 2 * hidden


@dataclass(frozen=True, slots=True)
class LlavaShape:
    """One LLaVA layout: image tokens, decoder sequence, and stage 0's cost factor."""

    image_tokens: int
    decoder_seq_length: int
    """Text plus image tokens: the [s, b, h] activation every stage passes on."""
    encoder_share: float
    """ViT + projection FLOPs / one decoder stage's FLOPs (per microbatch)."""

    @property
    def stage0_factor(self) -> float:
        return 1.0 + self.encoder_share


def llava_shape(*, img_h: int, img_w: int, patch_dim: int, seq_length: int, hidden_size: int,
                encoder_num_layers: int, decoder_num_layers: int, pipeline_size: int) -> LlavaShape:
    """Stage 0's extra work for the ViT (``encoder_num_layers`` layers on the image tokens)
    and the projection (an MLP h -> 4h -> h on them), over one stage's share of the decoder
    (``decoder_num_layers / pipeline_size`` layers on ``seq_length`` text + image tokens)."""
    for name, value in (("--seq-length", seq_length), ("--hidden-size", hidden_size),
                        ("--decoder-num-layers", decoder_num_layers),
                        ("--pipeline-model-parallel-size", pipeline_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not isinstance(encoder_num_layers, int) or encoder_num_layers < 0:
        raise ValueError(f"--encoder-num-layers must be an integer >= 0, got {encoder_num_layers!r}")
    if decoder_num_layers < pipeline_size:
        raise ValueError(f"--decoder-num-layers {decoder_num_layers} must be >= --pipeline-model-parallel-size "
                         f"{pipeline_size} (every stage holds decoder layers)")
    tokens = image_tokens(img_h, img_w, patch_dim)
    decoder_seq = seq_length + tokens
    encoder = encoder_num_layers * _layer_flops(tokens, hidden_size) + 16.0 * tokens * hidden_size ** 2
    stage = decoder_num_layers / pipeline_size * _layer_flops(decoder_seq, hidden_size)
    return LlavaShape(tokens, decoder_seq, encoder / stage)


BOUNDS: dict[str, Bound] = {
    "--img-h": integer(1, 1 << 16, optional=True), "--img-w": integer(1, 1 << 16, optional=True),
    "--patch-dim": integer(1, 1 << 16), "--encoder-num-layers": integer(0, 1 << 12),
    "--decoder-num-layers": integer(1, 1 << 12), "--seq-length": integer(1, 1 << 24),
    "--hidden-size": integer(1, 1 << 20),
}
"""Accepted ranges of the LLaVA flags (``simulate`` has all; ``bench`` its own --seq-length
and --hidden-size)."""
MODEL_SIZE_FLAGS = ("--seq-length", "--hidden-size")


@dataclass(kw_only=True, slots=True)
class LlavaOptions:
    """--img-h/--img-w/--patch-dim (Megatron-LM's names) and the layer counts they are weighed
    with, as flags of ``simulate`` and ``bench`` (each has its own --seq-length and --hidden-size)."""

    img_h: Optional[int] = option(None, "LLaVA (pretrain_vlm.py): image height; with --img-w and --patch-dim sets "
                                  "the image tokens per sample and stage 0's encoder cost", bound=BOUNDS["--img-h"])
    img_w: Optional[int] = option(None, "LLaVA: image width (default: --img-h)", bound=BOUNDS["--img-w"])
    patch_dim: int = option(14, "LLaVA: ViT patch side", bound=BOUNDS["--patch-dim"])
    encoder_num_layers: int = option(24, "LLaVA: ViT layers on stage 0, as CLIP ViT-L",
                                     bound=BOUNDS["--encoder-num-layers"])
    decoder_num_layers: int = option(32, "LLaVA: decoder layers over all stages", bound=BOUNDS["--decoder-num-layers"])

    def shape(self, *, pipeline_size: int, seq_length: int, hidden_size: int, straggler_stage: Optional[int],
              decoder_seq_length: Optional[int] = None) -> Optional[LlavaShape]:
        """The LLaVA shape the flags describe, or None without --img-h. ``decoder_seq_length``
        (the bench's --seq-length, images included) replaces ``seq_length`` (text only). A
        --straggler-stage would overwrite stage 0's factor, so the two are refused together."""
        if self.img_h is None:
            if self.img_w is not None:
                raise ValueError("--img-w needs --img-h (LLaVA's image shape)")
            return None
        if straggler_stage is not None:
            raise ValueError("--img-h (LLaVA: the encoder's cost on stage 0) and --straggler-stage both set stage "
                             "factors; give one")
        img_w = self.img_w if self.img_w is not None else self.img_h
        text = seq_length
        if decoder_seq_length is not None:
            text = decoder_seq_length - image_tokens(self.img_h, img_w, self.patch_dim)
            if text < 1:
                raise ValueError(f"--seq-length {decoder_seq_length} leaves no text beside the "
                                 f"{decoder_seq_length - text} image tokens of --img-h/--img-w/--patch-dim")
        return llava_shape(img_h=self.img_h, img_w=img_w, patch_dim=self.patch_dim, seq_length=text,
                           hidden_size=hidden_size, encoder_num_layers=self.encoder_num_layers,
                           decoder_num_layers=self.decoder_num_layers, pipeline_size=pipeline_size)
