"""``megatron-rrfp train`` end to end on CPU (gloo, 2 local ranks = 2 pipeline stages).

Three short trainings share one layout and seed: rrfp (saving at iteration 3), 1f1b, and
rrfp resumed from the iteration-3 checkpoint. Their logged losses must agree: the
schedule changes the order, never the math, and a checkpoint holds all the state.
Every launch runs in its own subprocess with a timeout; ``--nproc`` children die with
their parent, so a killed launch leaves nothing behind.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

TINY = ["--cpu", "--nproc", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "64", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--lr", "0.01", "--min-lr", "0.001", "--lr-warmup-iters", "0",
        "--train-iters", "6", "--log-interval", "1"]
LOSS_LINE = re.compile(r"iteration\s+(\d+)/(\d+) \| schedule (\S+) \| lm loss (\S+) \|.*"
                       r"iteration time ([\d.]+) ms \| tokens/s ([\d.]+) \| peak activations ([\d.]+) MB \| "
                       r"in flight (\d+)")
LAUNCH_TIMEOUT_S = 150


def train(*flags: str, timeout: float = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``megatron-rrfp train FLAGS`` (through the console script's module)."""
    return subprocess.run([sys.executable, "-m", "megatron_rrfp.cli", "train", *flags], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONWARNINGS": "ignore"})


def memory(result: subprocess.CompletedProcess) -> dict[int, tuple[float, int]]:
    """Logged (peak activation MB, peak forwards in flight), max over ranks, per iteration."""
    return {int(m.group(1)): (float(m.group(7)), int(m.group(8))) for m in LOSS_LINE.finditer(result.stdout)}


def losses(result: subprocess.CompletedProcess) -> dict[int, float]:
    assert result.returncode == 0, \
        f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr[-4000:]}"
    found = {int(m.group(1)): float(m.group(4)) for m in LOSS_LINE.finditer(result.stdout)}
    assert found, f"no loss lines in:\n{result.stdout}"
    return found


@pytest.fixture(scope="module")
def rrfp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("rrfp")
    result = train(*TINY, "--pipeline-schedule", "rrfp", "--save", str(out / "ckpt"), "--save-interval", "3",
                   "--rrfp-trace-dir", str(out / "trace"))
    return out, result


@pytest.mark.timeout(200)
def test_rrfp_trains_logs_and_writes_the_last_iteration_trace(rrfp_run):
    out, result = rrfp_run
    found = losses(result)
    assert sorted(found) == [1, 2, 3, 4, 5, 6]
    assert found[6] < found[1] - 0.05, found  # learnable synthetic data: the loss falls
    assert all(m.group(3) == "rrfp" and float(m.group(6)) > 0 for m in LOSS_LINE.finditer(result.stdout))
    assert sorted(os.listdir(out / "ckpt")) == ["iter_0000003", "iter_0000006", "latest_checkpointed_iteration.txt"]
    merged = json.loads((out / "trace" / "trace.json").read_text())["traceEvents"]
    tasks = {(e["pid"], e["name"]) for e in merged if e.get("ph") == "X" and e["cat"] in ("F", "B")}
    assert tasks == {(rank, f"0{kind}{mb}") for rank in (0, 1) for kind in "FB" for mb in range(4)}, tasks
    assert (out / "trace" / "rank00001.json").exists()
    # the default limit, 1x: never more forwards in flight than Megatron's PP = 2
    logged = memory(result)
    assert all(mb > 0 and n <= 2 for mb, n in logged.values()) and logged[1][1] == 2, logged


@pytest.mark.timeout(200)
def test_megatron_1f1b_gives_the_same_losses(rrfp_run):
    reference = losses(rrfp_run[1])
    megatron = train(*TINY, "--pipeline-schedule", "1f1b")
    ours = losses(megatron)
    assert ours.keys() == reference.keys()
    assert all(abs(ours[i] - reference[i]) <= 1e-5 for i in ours), (ours, reference)
    # Megatron's memory is measured too; at 1x (iteration 1) RRFP holds the same forwards
    megatron_memory, rrfp_memory = memory(megatron), memory(rrfp_run[1])
    assert all(n == 2 for _, n in megatron_memory.values()), megatron_memory
    assert megatron_memory[1][0] <= rrfp_memory[1][0] <= 1.1 * megatron_memory[1][0] + 0.01, \
        (megatron_memory, rrfp_memory)


@pytest.mark.timeout(200)
def test_resuming_at_iteration_3_continues_like_the_uninterrupted_run(rrfp_run):
    out, result = rrfp_run
    uninterrupted = losses(result)
    resumed = train(*TINY, "--pipeline-schedule", "rrfp", "--load", str(out / "ckpt"), "--load-iteration", "3",
                    "--rrfp-buffer-limit", "auto")  # auto changes the order and the memory, never the math
    assert "resumed from" in resumed.stdout and "at iteration 3" in resumed.stdout
    continued = losses(resumed)
    assert sorted(continued) == [4, 5, 6]
    # auto: the first iteration of this process at 1x (2 in flight), then sized to free RAM (capped at M = 4)
    logged = memory(resumed)
    assert logged[4][1] == 2 and all(mb > 0 and 1 <= n <= 4 for mb, n in logged.values()), logged
    assert resumed.stdout.count("megatron-rrfp: buffer limit auto") == 1, resumed.stdout
    assert all(abs(continued[i] - uninterrupted[i]) <= 1e-5 for i in continued), (continued, uninterrupted)


@pytest.mark.timeout(60)
def test_a_bad_flag_exits_nonzero_naming_the_flag():
    result = train(*TINY, "--pipeline-schedule", "rrfp", "--rrfp-buffer-limit", "0", timeout=50)
    assert result.returncode != 0
    assert "--rrfp-buffer-limit" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(60)
def test_impossible_layouts_fail_before_starting_ranks():
    result = train(*TINY, "--pipeline-schedule", "rrfp", "--global-batch-size", "7", timeout=50)
    assert result.returncode == 2 and "--global-batch-size 7" in result.stderr
    result = train("--cpu", "--nproc", "3", "--pipeline-model-parallel-size", "2", timeout=50)
    assert result.returncode == 2 and "world size 3 is not divisible by TP x PP = 1 x 2" in result.stderr


# --------------------------------------------------------------------------- in-process


def test_flags_and_train_config_agree():
    from megatron_rrfp.train.config import TrainConfig, from_args, to_argv
    from megatron_rrfp.train.driver import build_parser

    parser = build_parser()
    assert from_args(parser.parse_args([])) == TrainConfig()
    config = from_args(parser.parse_args(TINY + ["--pipeline-schedule", "rrfp", "--rrfp-strict"]))
    assert from_args(parser.parse_args(to_argv(config, skip=()))) == config
    flags = {a.option_strings[0] for a in parser._actions if a.option_strings}
    assert {"--model", "--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--vocab-size",
            "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--micro-batch-size",
            "--global-batch-size", "--train-iters", "--lr", "--min-lr", "--lr-warmup-iters", "--data-path",
            "--save", "--save-interval", "--load", "--log-interval", "--cpu", "--nproc",
            "--pipeline-schedule", "--rrfp-buffer-limit", "--rrfp-trace-dir"} <= flags


def test_samples_follow_megatrons_sampler_and_token_files_read_back(tmp_path):
    import torch

    from megatron_rrfp.train import data

    def source(dp_rank, **kw):
        return data.SyntheticTokens(vocab_size=64, seed=3, seq_length=8, micro_batch_size=2, dp_rank=dp_rank,
                                    dp_size=2, device=torch.device("cpu"), **kw)

    # micro-batch m of DP rank d holds samples consumed + m * mbs * dp + d * mbs + [0, mbs)
    batch = next(source(1).microbatches(consumed_samples=16, count=2))
    expected = np.stack([data.synthetic_tokens(i, 9, vocab_size=64, seed=3) for i in (18, 19)])
    assert torch.equal(batch["tokens"], torch.from_numpy(expected[:, :-1]))
    assert torch.equal(batch["labels"], torch.from_numpy(expected[:, 1:]))

    tokens = np.arange(1000) % 64
    for name in ("tokens.npy", "tokens.bin"):
        path = data.write_token_file(str(tmp_path / name), tokens)
        src = data.TokenFile(path, vocab_size=64, seq_length=8, micro_batch_size=2, dp_rank=0, dp_size=1,
                             device=torch.device("cpu"))
        first = next(src.microbatches(consumed_samples=5, count=1))
        assert first["tokens"][0].tolist() == list(range(40, 48)) and first["labels"][0].tolist() == list(range(41, 49))
    with pytest.raises(ValueError, match="outside --vocab-size 32"):
        next(data.TokenFile(path, vocab_size=32, seq_length=8, micro_batch_size=1, dp_rank=0, dp_size=1,
                            device=torch.device("cpu")).microbatches(consumed_samples=7, count=1))


def test_rank_comes_from_torchrun_then_slurm_then_defaults_to_one_process():
    from megatron_rrfp.dist.env import detect

    torchrun = detect({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "6000",
                       "SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    assert (torchrun.source, torchrun.rank, torchrun.world_size, torchrun.local_rank) == ("torchrun", 3, 8, 1)
    slurm = detect({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "42",
                    "MASTER_ADDR": "node7"})
    assert (slurm.source, slurm.rank, slurm.world_size, slurm.master_addr, slurm.master_port) == \
        ("slurm", 1, 2, "node7", 20042)
    assert detect({}).source == "single"
