"""Megatron-LM's local non-persistent checkpoints with --replication under --pipeline-schedule rrfp.

    MEGATRON_LM=/work/mlm/core_v0.16.1 NVRX_SITE=/path/to/site \
        python -m pytest -n 0 -s tests/e2e/test_local_checkpoints_e2e.py

``MEGATRON_LM``: Megatron-LM trees (``os.pathsep``-separated; the one whose minor is the installed
megatron-core's runs). ``NVRX_SITE``: directories holding nvidia-resiliency-ext (put on the ranks'
PYTHONPATH) when it is not installed (docs/resilience.md). Skipped without either.

pretrain_gpt.py, PP2 x DP2 (4 ranks, CPU), NVRx's local checkpoint manager every 2 iterations with
replicas on the partner two ranks away (``--replication --replication-jump 2``). Rank 1 raises in its
first forward step of iteration 6 (tests/helpers/inprocess_drill.py) and the job fails; rank 1's
local directory is then removed, and a new job with the same flags resumes from the local
checkpoint of iteration 4, rank 1's part retrieved from its replica. Asserted: the losses after the
resume equal an uninterrupted run's (TensorBoard's per-iteration values: Megatron's stdout line
averages a job's first two iterations); the ledger names the local checkpoint and counts one
iteration redone, at most one local interval.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.megatron_lm import COMMON, copy_tree, release, tensorboard_scalars
from megatron_rrfp.mcore import compat

TESTS = Path(__file__).resolve().parents[1]
TREES = [t for t in os.environ.get("MEGATRON_LM", "").split(os.pathsep) if t]
NVRX_SITE = os.environ.get("NVRX_SITE", "")
LOCAL_INTERVAL = 2
FLAGS = ["--num-layers", "2", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "rrfp",
         "--train-iters", "8", "--ckpt-format", "torch_dist", "--num-workers", "0",
         "--save", "ckpt", "--load", "ckpt", "--save-interval", "1000",
         "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", "local",
         "--non-persistent-save-interval", str(LOCAL_INTERVAL), "--replication", "--replication-jump", "2",
         "--rrfp-goodput-ledger", "job.db"]
FAULT_RANK, FAULT_ITERATION = 1, 6
PARTNER = 3  # --replication-jump 2 over 4 ranks: cliques {0, 2} and {1, 3}


def _nvrx_importable() -> bool:
    code = "import nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (NVRX_SITE, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, timeout=120).returncode == 0


def _tree() -> str:
    installed = (compat.MEGATRON_CORE_VERSION.major, compat.MEGATRON_CORE_VERSION.minor)
    for tree in TREES:
        if release(tree) == installed:
            return tree
    pytest.skip(f"no MEGATRON_LM tree of megatron-core {installed[0]}.{installed[1]} (given: {TREES})")


def _launch(tree: Path, cwd: Path, tensorboard: str, fault_iteration: int) -> tuple[int, str]:
    """pretrain_gpt.py on 4 ranks through the drill (rank 1 raises at ``fault_iteration``; 0: never)."""
    cwd.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    version = ".".join(map(str, sys.version_info[:3]))
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TORCH_CPP_LOG_LEVEL": "error",
           "PATH": os.path.dirname(python) + os.pathsep + os.environ.get("PATH", ""),
           "PYENV_VERSION": os.environ.get("PYENV_VERSION", version),
           "PYTHONPATH": os.pathsep.join(p for p in (NVRX_SITE, str(TESTS), os.environ.get("PYTHONPATH")) if p),
           "RRFP_DRILL_RANK": str(FAULT_RANK), "RRFP_DRILL_ITERATION": str(fault_iteration),
           "RRFP_DRILL_KIND": "raise"}
    command = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               "-m", "helpers.inprocess_drill", "--cpu", str(tree / "pretrain_gpt.py"), *COMMON, *FLAGS,
               "--tensorboard-dir", tensorboard]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=cwd, env=env)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.timeout(2400)
@pytest.mark.skipif(not TREES, reason="MEGATRON_LM names no Megatron-LM tree")
def test_a_failed_job_resumes_from_the_newest_local_checkpoint_with_a_wiped_rank_restored_from_its_replica(tmp_path):
    if not _nvrx_importable():
        pytest.skip("nvidia-resiliency-ext is not importable (install the 'resilience' extra or set NVRX_SITE)")
    tree = copy_tree(_tree(), tmp_path)

    reference = tmp_path / "reference"
    code, log = _launch(tree, reference, "tb", 0)
    assert code == 0, log[-8000:]
    expected = tensorboard_scalars(reference / "tb", "lm loss")
    assert sorted(expected) == list(range(1, 9)), (expected, log[-4000:])

    run = tmp_path / "run"
    code, log = _launch(tree, run, "tb1", FAULT_ITERATION)
    assert code != 0, log[-8000:]
    assert f"rrfp-drill: fault raise on rank {FAULT_RANK} at iteration {FAULT_ITERATION}" in log, log[-4000:]
    local = run / "local"
    newest = FAULT_ITERATION - LOCAL_INTERVAL
    for rank in range(4):  # each rank's own part; the replica of rank 1's on rank 3
        assert (local / str(rank) / f"iter_{newest:07d}_{rank}_local.pt").is_file(), sorted(local.rglob("*.pt"))
    assert (local / str(PARTNER) / f"iter_{newest:07d}_{FAULT_RANK}_local.pt").is_file(), sorted(local.rglob("*"))
    assert not (run / "ckpt" / "latest_checkpointed_iteration.txt").exists()  # nothing persistent to fall back to
    shutil.rmtree(local / str(FAULT_RANK))  # the failed rank's node lost its local storage

    code, log = _launch(tree, run, "tb2", 0)
    assert code == 0, log[-8000:]
    # '[ t 1/1, p 1/2 ]'; core_v0.19 adds 'gtp_remat 1/1, '
    assert re.search(rf"successfully loaded checkpoint from ckpt \[ [^\]]*\] at iteration {newest}\b", log), log[-6000:]
    resumed = tensorboard_scalars(run / "tb2", "lm loss")
    assert sorted(resumed) == list(range(newest + 1, 9)), (resumed, log[-4000:])
    print(f"\n{os.path.basename(_tree())}: uninterrupted {[expected[i] for i in range(newest + 1, 9)]}, "
          f"resumed from the local checkpoint of {newest} {[resumed[i] for i in range(newest + 1, 9)]}")
    for it in resumed:
        assert resumed[it] == pytest.approx(expected[it], rel=1e-5), (it, resumed, expected)
    assert (local / str(FAULT_RANK) / f"iter_0000008_{FAULT_RANK}_local.pt").is_file()  # saving there again

    report = subprocess.run([sys.executable, "-m", "megatron_rrfp", "goodput", str(run / "job.db"), "--json",
                             str(tmp_path / "goodput.json")], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    disruptions = json.loads((tmp_path / "goodput.json").read_text())["disruptions"]
    assert len(disruptions) == 1, disruptions
    (disruption,) = disruptions
    assert (disruption["resumed_from"], disruption["checkpoint"]) == (newest, "local"), disruption
    assert disruption["wasted_iterations"] == FAULT_ITERATION - 1 - newest <= LOCAL_INTERVAL, disruption
