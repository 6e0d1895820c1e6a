#!/usr/bin/env python
"""Run this first on a GPU host, before training with RRFP:

    torchrun --nproc-per-node 1 scripts/gpu_selfcheck.py      # one GPU: queues, loopback, memory, contexts
    torchrun --nproc-per-node 8 scripts/gpu_selfcheck.py      # + NCCL stress and equivalence with Megatron's 1F1B

Every step prints PASS / FAIL / SKIP with a one-line diagnosis; a hung step prints every
thread's stack and exits. ``--steps a,b`` runs a subset, ``--json PATH`` writes the
results. Without CUDA it says so and exits 0. The steps are described in
``megatron_rrfp/selfcheck/cli.py``.
"""
import sys

from megatron_rrfp.selfcheck.cli import main

if __name__ == "__main__":
    sys.exit(main())
