"""Shared test set-up. Tests live in ``unit/`` (no processes, seconds), ``distributed/`` (real
multi-process gloo ranks) and ``e2e/`` (Megatron-LM, SLURM, the CLI as a user runs it).
``tests/`` is on sys.path (this conftest's folder), so tests import their helpers as
``helpers.<module>``; spawned ranks inherit that path.

The suite runs on two pytest-xdist workers (``-n 2 --dist loadfile``, pyproject's addopts):
most of its time is fresh interpreters importing torch and megatron-core, during which one
test at a time left one core of the 2-core CI machine idle. ``--dist loadfile`` runs every
file on one worker, in the file's own order, so what a module-scoped fixture launched is
launched once and one localhost SLURM (tests/e2e/test_slurm.py) runs at a time; ports are the
OS's choice (the launcher's TCPStore, torchrun's ``--standalone``), and each test stops only
the processes it started. ``-n 0`` runs everything in this process (needed for ``-s``).
"""
from __future__ import annotations

# The folders, in the order their files are handed out: end-to-end runs (Megatron-LM, SLURM, the
# CLI) take longest, then the multi-process tests, then the in-process ones, so that neither worker
# is left alone with a long file at the end. Each file keeps its own order.
FOLDERS = ("e2e", "distributed", "unit")


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        parts = item.nodeid.split("/")
        return FOLDERS.index(parts[1]) if len(parts) > 2 and parts[1] in FOLDERS else len(FOLDERS)

    items[:] = sorted(items, key=rank)  # stable
