"""Verification tools, not benchmarks: the GPU self-check (``selfcheck.py``, run by
``scripts/gpu_selfcheck.py``; its one-GPU pipeline ``selfcheck_loopback.py`` and its
Megatron equivalence step ``selfcheck_gpt.py``) and the single-queue device emulation
that checks the transports for deadlocks without a GPU (``queue_device.py``: one FIFO per
rank; ``emulated_pipeline.py``: the real executor, agreement and transport on it)."""
