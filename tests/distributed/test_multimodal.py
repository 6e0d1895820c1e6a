"""The LLaVA-style recipe (megatron_rrfp.train.recipes.multimodal) on CPU.

PP=2: RRFP under random task delays against megatron-core's own 1F1B, same model and
data: per-microbatch losses and every gradient within 1e-5 (relative, fp32), and the
executed order really departed from 1F1B. One process: encoder work follows the number
of images, the data is deterministic, and the fixed [s, b, h] contract holds.
"""
from __future__ import annotations

import pytest

from helpers.equivalence import Case, run_cases
from megatron_rrfp.launch.function import launch

TOL = 1e-5


def _check(results: list[list[dict]]) -> None:
    """results[rank][case]: errors within TOL; at least one rank ran a non-1F1B order
    (the same check as tests/distributed/test_executor.py)."""
    for case_results in zip(*results):
        for r in case_results:
            assert r["loss_rel_err"] <= TOL and r["grad_rel_err"] <= TOL, r
            assert all(abs(a - b) <= TOL * max(1.0, abs(a)) for a, b in zip(r["losses_megatron"], r["losses_rrfp"]))
        assert sum(r["num_losses"] for r in case_results) > 0  # the last stage really reported losses
        assert any(order != r["megatron_order"] for r in case_results for order in r["orders"]), \
            "injected delays should have changed the order somewhere"


@pytest.mark.timeout(300)
def test_pp2_multimodal_rrfp_matches_megatron_1f1b():
    cases = [Case(model="multimodal", iterations=2, num_microbatches=8)]
    results = launch(run_cases, world_size=2, timeout=240, args=(cases,))
    _check(results)
    assert len(results[1][0]["losses_rrfp"]) == 2  # one loss per iteration on the last stage


def _encoder_work(counts_per_batch: list[list[int]]) -> dict:
    """One rank, PP=1: forward+backward of batches with the given image counts; the patch
    tokens the ViT processed for each, the output shapes and whether all params got grads."""
    import torch

    from megatron_rrfp.cpu import enable_cpu_reference_schedules
    from megatron_rrfp.train.recipes import multimodal as mm

    enable_cpu_reference_schedules()
    spec = mm.MultimodalSpec()
    stage = mm.build_multimodal_stage(mm.multimodal_config(), spec, seed=3)
    batches = mm.synthetic_multimodal_batches(spec, seed=7, micro_batch_size=len(counts_per_batch[0]))
    tokens, shapes, all_grads = [], [], []
    for counts in counts_per_batch:
        batch = dict(next(batches), num_images=torch.tensor(counts))
        before = stage.vision.patch_tokens_processed
        stage.zero_grad(set_to_none=True)
        output, loss_func = mm.multimodal_forward_step(iter([batch]), stage)
        loss_func(output)[0].backward()
        tokens.append(stage.vision.patch_tokens_processed - before)
        shapes.append(tuple(output.shape))
        all_grads.append(all(p.grad is not None for p in stage.parameters()))
    return {"tokens": tokens, "shapes": shapes, "all_grads": all_grads,
            "patches_per_image": spec.patches_per_image}


@pytest.mark.timeout(180)
def test_encoder_work_grows_with_images():
    counts = [[0, 0], [1, 0], [1, 1], [3, 2], [3, 3]]
    (result,) = launch(_encoder_work, world_size=1, timeout=120, args=(counts,))
    assert result["tokens"] == [sum(c) * result["patches_per_image"] for c in counts]
    assert result["tokens"] == sorted(result["tokens"]) and result["tokens"][0] == 0
    assert set(result["shapes"]) == {(2, 16)}  # per-token loss [b, s]: same shape whatever the images
    assert all(result["all_grads"])  # text-only batches still touch every encoder parameter


def test_synthetic_batches_are_deterministic_capped_and_laid_out():
    import torch

    from megatron_rrfp.train.recipes import multimodal as mm

    spec = mm.MultimodalSpec(max_images=2, tokens_per_image=4, seq_length=16)
    a = mm.synthetic_multimodal_batches(spec, seed=1, micro_batch_size=4, images_per_sample_mean=1.5)
    b = mm.synthetic_multimodal_batches(spec, seed=1, micro_batch_size=4, images_per_sample_mean=1.5)
    seen = set()
    for _ in range(20):
        x, y = next(a), next(b)
        assert all(torch.equal(x[k], y[k]) for k in x)
        counts = mm.image_counts(x)
        seen.update(counts)
        assert x["images"].shape == (4, 2, 3, 16, 16)
        for j, n in enumerate(counts):
            assert 0 <= n <= spec.max_images
            assert x["loss_mask"][j].tolist() == [0.0] * (n * 4) + [1.0] * (16 - n * 4)
            assert x["images"][j, n:].abs().sum() == 0 and (n == 0 or x["images"][j, :n].abs().sum() > 0)
    assert seen == {0, 1, 2}  # Poisson(1.5) capped at 2 hits every count in 80 samples
    with pytest.raises(ValueError, match="leaves no text"):
        mm.MultimodalSpec(max_images=4, tokens_per_image=4, seq_length=16)
    with pytest.raises(ValueError, match="must divide"):
        mm.MultimodalSpec(tokens_per_image=3)
