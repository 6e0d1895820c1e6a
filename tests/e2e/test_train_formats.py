"""``megatron-rrfp train`` with a Megatron user's data and checkpoints: an indexed dataset
(written by megatron-core's own builder) read through GPTDataset, ``--bf16``, and
``--ckpt-format torch_dist`` (megatron-core dist_checkpointing), on CPU with 2 ranks.

Three launches: an uninterrupted run saving at iterations 3 and 6; a run stopped by SIGUSR1
(``--exit-signal-handler --exit-signal SIGUSR1``: it saves and exits 0, as a SLURM job does
before its time limit); and a resume from that checkpoint, which must continue exactly like
the uninterrupted run. Every launch is a process of its own with a timeout (forked after
torch's import: helpers/cli_fork.py), but the one through torch's launcher (a real subprocess).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from helpers import cli_fork

LAUNCH_TIMEOUT_S = 180
LOSS_LINE = re.compile(r"^ \[[^\]]+\] iteration\s+(\d+)/\s*\d+ \|.* lm loss: (\S+) \|", re.MULTILINE)


def flags(prefix: str, ckpt: str) -> list[str]:
    return ["--cpu", "--nproc", "2", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "rrfp",
            "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--vocab-size", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "0.01",
            "--min-lr", "0.001", "--lr-warmup-iters", "0", "--train-iters", "6", "--log-interval", "1",
            "--data-path", prefix, "--bf16", "--ckpt-format", "torch_dist", "--save", ckpt, "--save-interval", "3"]


def run(*args: str, on_line=None) -> tuple[int, str]:
    """``megatron-rrfp train ARGS`` (forked after torch's import: helpers/cli_fork.py);
    ``on_line(line, command)`` sees each output line as it arrives."""
    command = cli_fork.start(["train", *args], env={**os.environ, "PYTHONWARNINGS": "ignore"}, merge_stderr=True)
    lines: list[str] = []

    def seen(line: str) -> None:
        lines.append(line)
        if on_line is not None:
            on_line(line, command)

    reader = command.follow(seen)
    try:
        command.wait(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail("still running after the timeout:\n" + "".join(lines)[-6000:])
    finally:
        command.close()  # kills the launcher if still running; its ranks die with it
        reader.join(10)
    return command.poll(), "".join(lines)


def losses(output: str) -> dict[int, float]:
    return {int(i): float(loss) for i, loss in LOSS_LINE.findall(output)}


def ranks_of(launcher_pid: int) -> list[int]:
    """The rank processes the launcher started (its children)."""
    import psutil

    return [child.pid for child in psutil.Process(launcher_pid).children()]


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S + 60)
def test_indexed_data_bf16_and_torch_dist_checkpoints_resume_exactly(tmp_path):
    from megatron_rrfp.train.data import synthetic_tokens, write_indexed_dataset

    prefix = write_indexed_dataset(str(tmp_path / "data" / "text_document"),
                                   [synthetic_tokens(i, 40 + i % 7, vocab_size=64, seed=9) for i in range(120)])

    code, uninterrupted = run(*flags(prefix, str(tmp_path / "full")))
    assert code == 0, uninterrupted[-6000:]
    expected = losses(uninterrupted)
    assert sorted(expected) == [1, 2, 3, 4, 5, 6] and all(np.isfinite(list(expected.values())))
    assert expected[6] < expected[1], expected
    assert "schedule rrfp, bf16, cpu/gloo" in uninterrupted
    # megatron-core 0.19 keeps the common state inside the torch_dist checkpoint (common.pt is its legacy form)
    from megatron_rrfp.mcore.compat import MEGATRON_CORE_VERSION

    layout = {"metadata.json", ".metadata"} | ({"common.pt"} if MEGATRON_CORE_VERSION.release < (0, 19) else set())
    assert layout <= set(os.listdir(tmp_path / "full" / "iter_0000003"))

    signalled = []

    def stop_after_iteration_2(line, command):  # SIGUSR1 to one rank, as SLURM's --signal would
        if re.search(r"\] iteration\s+2/", line) and not signalled:
            signalled.append(True)
            os.kill(ranks_of(command.pid)[0], signal.SIGUSR1)

    ckpt = str(tmp_path / "stopped")
    code, stopped = run(*flags(prefix, ckpt), "--exit-signal-handler", "--exit-signal", "SIGUSR1",
                        on_line=stop_after_iteration_2)
    assert code == 0, stopped[-6000:]  # a clean exit: the job can be requeued
    found = re.search(r"exiting after iteration (\d) on SIGUSR1", stopped)
    assert found, stopped[-6000:]
    last = int(found.group(1))
    assert 2 <= last < 6 and sorted(losses(stopped)) == list(range(1, last + 1))
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == str(last)

    code, resumed = run(*flags(prefix, ckpt), "--load", ckpt)
    assert code == 0, resumed[-6000:]
    assert f"at iteration {last} ({8 * last} samples consumed)" in resumed
    continued = losses(resumed)
    assert sorted(continued) == list(range(last + 1, 7))
    for i, loss in {**losses(stopped), **continued}.items():
        assert loss == pytest.approx(expected[i], rel=1e-6), (i, loss, expected[i])


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S)
def test_data_path_without_one_sample_is_refused_on_every_rank_before_any_collective(tmp_path):
    """Unchecked, megatron-core's GPTDataset loops forever on rank 0 over zero tokens while
    rank 1 waits at its barrier (until the gloo timeout)."""
    import time

    from megatron_rrfp.train.data import write_indexed_dataset

    def refusal(prefix: str, tokens: int) -> str:
        return f"--data-path {prefix!r} holds {tokens} tokens; one sample of --seq-length 32 needs 33"

    empty = write_indexed_dataset(str(tmp_path / "empty"), [[]])  # one document of zero tokens
    start = time.monotonic()
    code, output = run(*flags(empty, str(tmp_path / "ckpt")))  # the launching process refuses: no rank starts
    assert code == 2 and output.count(refusal(empty, 0)) == 1, output[-4000:]
    assert time.monotonic() - start < 60, output[-4000:]
    # each rank refuses too when started by a launcher that did not check (torchrun, srun):
    # fewer tokens than one sample
    short = write_indexed_dataset(str(tmp_path / "short"), [list(range(20))])
    argv = flags(short, str(tmp_path / "ckpt"))
    at = argv.index("--nproc")
    script = ("import sys; from megatron_rrfp.launch.torchrun import run_module; sys.exit(run_module(2, "
              f"'megatron_rrfp.train', {argv[:at] + argv[at + 2:]!r}, env={{'CUDA_VISIBLE_DEVICES': ''}}))")
    start = time.monotonic()
    ranks = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S,
                           env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert ranks.returncode == 2 and ranks.stderr.count(refusal(short, 20)) == 2, ranks.stderr[-4000:]
    assert time.monotonic() - start < 90, ranks.stderr[-4000:]
