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
