"""Verification tools, not benchmarks: the GPU self-check (``selfcheck.py``, run by
``scripts/gpu_selfcheck.py``; its one-GPU pipeline ``selfcheck_loopback.py`` and its
Megatron equivalence step ``selfcheck_gpt.py``) and the host channels with random latency
between threads that its loopback step runs the transport over (``host_channel.py``). The
single-queue stand-in device that checks the transports for deadlocks without a GPU is test
code (tests/helpers/queue_device.py, tests/helpers/emulated_pipeline.py)."""
