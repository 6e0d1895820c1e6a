"""Measured benchmarks on real megatron-core models: Megatron's own schedules and RRFP on
the same seeded run-time variability (``emulation.py``, applied through ``around_schedules.py`` from
outside the runtime), with the simulator's prediction beside (``run.py``); `megatron-rrfp
bench` / `demo` (``cli.py``); `megatron-rrfp compare` of two runs (``compare.py``)."""
