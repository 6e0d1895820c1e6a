"""Model recipes built from megatron-core blocks, runnable tiny on CPU and sized up on GPUs.

  multimodal.py  LLaVA-style VLM: ViT + projector on the first pipeline stage, GPT decoder
                 over all stages; fixed [s, b, h] between stages, variable encoder work.

Names load lazily: importing this package does not import megatron-core.
"""
_LAZY = {name: "multimodal" for name in (
    "MultimodalSpec", "MultimodalStage", "VisionEncoder", "build_multimodal_stage", "image_counts",
    "multimodal_config", "multimodal_forward_step", "synthetic_multimodal_batches")}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'megatron_rrfp.recipes' has no attribute {name!r}")


__all__ = sorted(_LAZY)
