"""The repository's own SLURM script, submitted to a real (one-node, localhost) SLURM.

Needs root: scripts/slurm/localhost_slurm.sh installs slurm + munge if missing (apt) and
starts munged, slurmctld and slurmd; the test stops them again (by PID file) whatever
happens. Then ``sbatch --wait`` runs scripts/slurm/pretrain_gpt_rrfp.sbatch in CPU mode
with 2 tasks (2 pipeline stages over gloo) and the job's output must show a tiny GPT
trained with the rrfp schedule. Every step is bounded by a timeout.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "scripts" / "slurm" / "localhost_slurm.sh"
SBATCH = REPO / "scripts" / "slurm" / "pretrain_gpt_rrfp.sbatch"
START_TIMEOUT_S = 420  # includes apt-get update + install on a fresh machine
JOB_TIMEOUT_S = 300
LOSS_LINE = re.compile(r"iteration\s+(\d+)/6 \| schedule rrfp \| lm loss (\S+) \|")


@pytest.fixture
def localhost_slurm():
    if os.geteuid() != 0:
        pytest.skip("needs root: starting a localhost SLURM (munged, slurmctld, slurmd) and installing it if missing")
    if shutil.which("apt-get") is None and shutil.which("slurmctld") is None:
        pytest.skip("slurm is not installed and there is no apt-get to install it")
    try:
        started = subprocess.run(["bash", str(CLUSTER), "start"], capture_output=True, text=True,
                                 timeout=START_TIMEOUT_S)
        assert started.returncode == 0, f"localhost SLURM did not start:\n{started.stdout}\n{started.stderr}"
        yield
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop"], capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(START_TIMEOUT_S + JOB_TIMEOUT_S + 90)
def test_gpt_sbatch_trains_with_rrfp_on_two_cpu_tasks(localhost_slurm, tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "RRFP_CPU": "1", "RRFP_REPO": str(REPO), "RRFP_OUT": str(out), "PYTHONWARNINGS": "ignore"}
    job = subprocess.run(
        ["sbatch", "--wait", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--cpus-per-task=1",
         "--gpus-per-node=0", f"--time={JOB_TIMEOUT_S // 60 + 1}", f"--output={tmp_path}/slurm-%j.out",
         "--export=ALL", str(SBATCH)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    logs = "\n".join(p.read_text(errors="replace") for p in sorted(tmp_path.glob("slurm-*.out")))
    assert job.returncode == 0, f"sbatch exit {job.returncode}\n{job.stdout}\n{job.stderr}\njob output:\n{logs}"
    assert "mode=cpu/gloo" in logs and "world=2" in logs
    assert "TP 1 x PP 2 x DP 1" in logs and "schedule rrfp" in logs
    losses = {int(i): float(loss) for i, loss in LOSS_LINE.findall(logs)}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6], logs
    assert losses[6] < losses[1], losses
    assert (out / "checkpoints" / "iter_0000006" / "rank_00001.pt").exists()
    assert (out / "traces" / "trace.json").exists()
