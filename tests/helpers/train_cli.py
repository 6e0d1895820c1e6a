"""``megatron-rrfp train`` as the tests run it (a fork of the fork server, helpers/cli_fork.py),
the tiny layout they share, and what they read back from its log (Megatron-LM's training_log line)."""
from __future__ import annotations

import os
import re
import subprocess

from helpers import cli_fork

TINY = ["--cpu", "--nproc", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "64", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--lr", "0.01", "--min-lr", "0.001", "--lr-warmup-iters", "0",
        "--train-iters", "6", "--log-interval", "1"]
# Megatron-LM's training_log line (train/metrics.py)
LOSS_LINE = re.compile(r"^ \[[\d\- :.]+\] iteration\s+(\d+)/\s*(\d+) \| consumed samples:\s+(\d+) \| "
                       r"elapsed time per iteration \(ms\): ([\d.]+) \| tokens per second: ([\d.]+) \| "
                       r"learning rate: (\S+) \| global batch size:\s+8 \| lm loss: (\S+) \| loss scale: 1.0 \| "
                       r"grad norm: ([\d.]+) \| peak memory \(MB\): ([\d.]+) \| peak activations \(MB\): ([\d.]+) \| "
                       r"forwards in flight: (\d+) \| number of skipped iterations:\s+0 \| "
                       r"number of nan iterations:\s+0 \|$", re.MULTILINE)
LAUNCH_TIMEOUT_S = 150


def train(*flags: str, timeout: float = LAUNCH_TIMEOUT_S, env: dict | None = None) -> subprocess.CompletedProcess:
    """``megatron-rrfp train FLAGS`` in its own process, forked after torch's import
    (helpers/cli_fork.py; the start-up itself is tested by a real subprocess below)."""
    return cli_fork.run(["train", *flags], timeout=timeout,
                        env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})})


def memory(result: subprocess.CompletedProcess) -> dict[int, tuple[float, int]]:
    """Logged (peak activation MB, peak forwards in flight), max over ranks, per iteration."""
    return {int(m.group(1)): (float(m.group(10)), int(m.group(11))) for m in LOSS_LINE.finditer(result.stdout)}


def losses(result: subprocess.CompletedProcess) -> dict[int, float]:
    assert result.returncode == 0, \
        f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr[-4000:]}"
    found = {int(m.group(1)): float(m.group(7)) for m in LOSS_LINE.finditer(result.stdout)}
    assert found, f"no loss lines in:\n{result.stdout}"
    return found
