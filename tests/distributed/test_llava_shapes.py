"""LLaVA's shapes (Megatron-LM's pretrain_vlm.py) in `simulate` and `bench`: image tokens from
--img-h/--img-w/--patch-dim, the ViT's cost on stage 0, and bad input refused by name."""
from __future__ import annotations

import pytest

from megatron_rrfp.cli import main
from megatron_rrfp.sim.llava import image_tokens, llava_shape


def test_image_tokens_are_clips_patches_plus_the_class_token():
    assert image_tokens(336, 336, 14) == 577  # LLaVA-1.5's CLIP ViT-L/14-336
    assert image_tokens(28, 42, 14) == 7
    with pytest.raises(ValueError, match="--patch-dim 14"):
        image_tokens(30, 28, 14)


def test_the_encoder_weighs_on_stage_0_more_with_more_stages_and_fewer_text_tokens():
    sizes = dict(img_h=336, img_w=336, patch_dim=14, hidden_size=4096, encoder_num_layers=24, decoder_num_layers=32)
    pp4 = llava_shape(seq_length=2048, pipeline_size=4, **sizes)
    assert pp4.decoder_seq_length == 2048 + 577
    assert 0 < pp4.encoder_share < llava_shape(seq_length=2048, pipeline_size=8, **sizes).encoder_share
    assert pp4.encoder_share < llava_shape(seq_length=512, pipeline_size=4, **sizes).encoder_share
    assert llava_shape(seq_length=2048, pipeline_size=4, **{**sizes, "encoder_num_layers": 0}).encoder_share > 0


def test_simulate_takes_llavas_shape_and_puts_the_encoder_on_stage_0(capsys):
    assert main(["simulate", "--pp", "4", "-m", "8", "--seeds", "1", "--policies", "default,1f1b",
                 "--img-h", "336", "--patch-dim", "14"]) == 0
    out = capsys.readouterr().out
    assert "LLaVA: 577 image tokens per sample, decoder sequence 2625" in out and "stage 0 x1.63" in out


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--img-h", "30", "--patch-dim", "14"], "--patch-dim 14"),
    (["simulate", "--img-h", "28", "--straggler-stage", "1"], "--straggler-stage"),
    (["simulate", "--img-w", "28"], "--img-w needs --img-h"),
    (["bench", "--model", "gpt", "--img-h", "28", "--seq-length", "64"], "--model multimodal"),
    (["bench", "--model", "multimodal", "--img-h", "28", "--patch-dim", "14", "--seq-length", "4"],
     "leaves no text"),
])
def test_bad_llava_shapes_are_refused_naming_the_flag(argv, message, capsys):
    assert main(argv) != 0
    captured = capsys.readouterr()
    assert message in captured.out + captured.err


def shims_probe() -> bool:
    """On one launched rank (a process of its own: the shims are process-wide)."""
    import torch
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rrfp.cpu import megatron_lm as cpu_training

    assert cpu_training.enable_cpu_training()
    cpu_training._clip_grads_on_cpu()  # what enable_cpu_training adds where megatron.training is present
    cpu_training._vit_norm_without_te()
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True,
                               layernorm_epsilon=1e-3)
    vit = CLIPViTModel(config, get_vit_layer_with_local_spec(), img_h=28, img_w=28, patch_dim=14)
    assert type(vit.ln_pre) is torch.nn.LayerNorm and vit.ln_pre.eps == 1e-3, vit.ln_pre
    assert vit(torch.randn(2, 3, 28, 28)).shape == (2, 5, 8)  # 4 patches + the class token
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    assert optimizer.clip_grad_by_total_norm_fp32 is clip_grads.clip_grad_by_total_norm_fp32  # rebound by name
    optimizer.clip_grad_by_total_norm_fp32(params, 1.0, 4.0)
    assert all(torch.allclose(p.grad, torch.full_like(p, 2.0 / (4.0 + 1e-6))) for p in params)
    assert not any(hasattr(p, "decoupled_grad") for p in params)
    return True


@pytest.mark.timeout(600)
def test_the_cpu_launchers_shims_build_llavas_vit_and_clip_cpu_grads():
    """Without TE, CLIPViTModel's default ln_pre (torch.nn.LayerNorm) is called with config=;
    megatron-core's clipping asserts CUDA grads."""
    from megatron_rrfp.launch.function import launch

    assert launch(shims_probe, world_size=1, timeout=540) == [True]  # ~8 s of CPU; the wall is the host's load
