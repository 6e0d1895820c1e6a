"""Verification tools, not benchmarks: the GPU self-check (``selfcheck.py``, run by
``scripts/gpu_selfcheck.py``; its one-GPU pipeline ``selfcheck_loopback.py`` and its
Megatron equivalence step ``selfcheck_gpt.py``) and the single-queue device
(``queue_device.py``: one FIFO per rank), on which the self-check's loopback step runs the
transport without a GPU (tests/helpers/emulated_pipeline.py runs whole jobs on it)."""
