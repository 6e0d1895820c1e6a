"""Shared test set-up. ``tests/`` is on sys.path (pytest's rootdir conftest), so tests
import their helpers as ``helpers.<module>``; spawned ranks inherit that path.

The suite runs on two pytest-xdist workers (``-n 2 --dist loadfile``, pyproject's addopts):
most of its time is fresh interpreters importing torch and megatron-core, during which one
test at a time left one core of the 2-core CI machine idle. ``--dist loadfile`` runs every
file on one worker, in the file's own order, so what a module-scoped fixture launched is
launched once and one localhost SLURM (tests/test_slurm.py) runs at a time; ports are the
OS's choice (the launcher's TCPStore, torchrun's ``--standalone``), and each test stops only
the processes it started. ``-n 0`` runs everything in this process (needed for ``-s``).
"""
from __future__ import annotations

import os

# Handed out first (slowest first, from `--durations` on both legs), so that neither worker
# is left alone with one of them at the end; the other files follow in collection order.
SLOW_FILES = ("test_executor.py", "test_transport_emulated.py", "test_slurm.py", "test_policy.py",
              "test_train_formats.py", "test_moe.py", "test_integration.py", "test_harness.py", "test_train.py",
              "test_forked_ranks.py", "test_llava_shapes.py", "test_bench_sweep.py", "test_memory_bytes.py",
              "test_interleaved.py", "test_hybrid.py", "test_dp_overlap.py")


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        name = os.path.basename(item.nodeid.partition("::")[0])
        return SLOW_FILES.index(name) if name in SLOW_FILES else len(SLOW_FILES)

    items[:] = sorted(items, key=rank)  # stable: each file keeps its own order
