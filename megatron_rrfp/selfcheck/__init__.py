"""The GPU self-check: what to run first on a GPU host (``scripts/gpu_selfcheck.py``, whose
steps and flags ``cli.py`` lists). Not used by training.

``runner.py`` runs the steps on every rank, never waiting on a failed one; each concern's steps
sit in their own module: ``device.py`` (versions, queue serialization, one CUDA context),
``loopback.py`` (a two-stage pipeline in one process, and a stage's memory), ``stress.py`` (the
NCCL rounds transport under random delays), ``equivalence.py`` (RRFP against Megatron's own
schedules; the comparison the test suite runs too), ``te.py`` (Transformer Engine's split).
``host_channel.py``: host channels with random latency between threads, which the loopback
pipeline runs its transport over. The single-queue stand-in device that checks the transports
for deadlocks without a GPU is test code (tests/helpers/queue_device.py).
"""
