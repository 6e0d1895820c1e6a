"""The repository's own SLURM script, submitted to a real (one-node, localhost) SLURM, and
stopped twice on the way, as clusters stop jobs.

Needs root: scripts/slurm/localhost_slurm.sh installs slurm + munge if missing (apt) and
starts munged, slurmctld and slurmd; the test stops what that script started whatever
happens. One job (scripts/slurm/pretrain_gpt_rrfp.sbatch, CPU mode, 2 tasks = 2 pipeline
stages over gloo, rrfp) is submitted once and then:

1. gets SIGUSR1 (``scancel --signal=USR1``, what ``#SBATCH --signal=USR1@120`` sends before
   the time limit): its ranks save a checkpoint and exit 0, and the script requeues the job;
2. resumes from that checkpoint, and is requeued by ``scontrol requeue`` mid-run (SIGTERM,
   then SIGKILL after KillWait): rank 0 records the disruption in the goodput ledger;
3. resumes from its latest checkpoint, in the same directory ($RRFP_OUT/<job name>) and the
   same ledger, and finishes.

The ledger then holds one job: three sessions, one disruption, every iteration kept once.
With ``MEGATRON_LM`` (a Megatron-LM tree of the installed megatron-core's minor, as for
tests/e2e/test_megatron_lm_e2e.py), the same SLURM then runs scripts/slurm/pretrain_multimodal_rrfp.sbatch
on Megatron-LM's own pretrain_vlm.py (LLaVA, CPU mode, 2 pipeline stages, rrfp) to the end.
Every step is bounded by a timeout.
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from helpers.megatron_lm import copy_tree, release

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "scripts" / "slurm" / "localhost_slurm.sh"
SBATCH = REPO / "scripts" / "slurm" / "pretrain_gpt_rrfp.sbatch"
MULTIMODAL_SBATCH = REPO / "scripts" / "slurm" / "pretrain_multimodal_rrfp.sbatch"
START_TIMEOUT_S = 420  # includes apt-get update + install on a fresh machine
PHASE_TIMEOUT_S = 180  # one run of the job: start-up (python, torch, megatron-core) and a few iterations
TRAIN_ITERS, SAVE_INTERVAL = 80, 4  # after SIGTERM a rank trains on for its 2 s grace (train/signals.py): with 40
# a fast host (~15 iterations/s) finished the run inside it, a clean end rather than the disruption asserted below
JOB_NAME = "rrfp-ci-requeue"
ENDED_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


@pytest.fixture(scope="module")
def localhost_slurm():  # one localhost SLURM for the module's jobs: starting it is the slow part
    if os.geteuid() != 0:
        pytest.skip("needs root: starting a localhost SLURM (munged, slurmctld, slurmd) and installing it if missing")
    if shutil.which("apt-get") is None and shutil.which("slurmctld") is None:
        pytest.skip("slurm is not installed and there is no apt-get to install it")
    # One localhost SLURM per machine: a second suite running at the same time (the other CI leg, a
    # developer's run) would start and stop the same daemons and its jobs would hold the 2-CPU node.
    with open(os.path.join(tempfile.gettempdir(), "rrfp-localhost-slurm.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            started = subprocess.run(["bash", str(CLUSTER), "start"], capture_output=True, text=True,
                                     timeout=START_TIMEOUT_S)
            assert started.returncode == 0, f"localhost SLURM did not start:\n{started.stdout}\n{started.stderr}"
            yield
        finally:
            subprocess.run(["bash", str(CLUSTER), "stop"], capture_output=True, text=True, timeout=90)


class Job:
    def __init__(self, job_id: str, log: Path) -> None:
        self.id, self.log = job_id, log

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_for(self, pattern: str, *, after: int = 0, timeout: float = PHASE_TIMEOUT_S) -> re.Match:
        """The first match of ``pattern`` in the job's output past offset ``after``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.compile(pattern, re.MULTILINE).search(self.text(), after)
            if found:
                return found
            time.sleep(0.2)
        pytest.fail(f"{pattern!r} not in the job's output after {timeout} s:\n{self.text()[-6000:]}\n"
                    + _scontrol(self.id))

    def wait_until_ended(self, timeout: float = PHASE_TIMEOUT_S) -> str:
        """The job's final state as scontrol shows it, as soon as it has one (not MinJobAge later,
        when it leaves the queue; COMPLETING, the epilog, is not final yet)."""
        deadline, last = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            shown = _scontrol(self.id)
            state = re.search(r"JobState=(\w+)", shown)
            if state is None:  # already left the queue: its last state seen
                return last
            if state.group(1) in ENDED_STATES:
                return shown
            last = shown
            time.sleep(0.2)
        pytest.fail(f"job {self.id} not ended after {timeout} s:\n{last}\n{self.text()[-4000:]}")

    def start_now_when_requeued(self, timeout: float = 60) -> None:
        """SLURM holds a requeued job back for two minutes (EligibleTime); make it eligible now."""
        deadline = time.monotonic() + timeout
        while "JobState=PENDING" not in _scontrol(self.id):
            if time.monotonic() > deadline:
                pytest.fail(f"job {self.id} not pending again after {timeout} s:\n{_scontrol(self.id)}")
            time.sleep(0.2)
        # slurmd revokes the old run's credential with a whole-second stamp: a restart within
        # that second is "Killing non-startable batch job: Job credential revoked"
        time.sleep(2)
        _run("scontrol", "update", f"JobId={self.id}", "StartTime=now")


def _scontrol(job_id: str) -> str:
    return subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30).stdout


def _run(*command: str) -> None:
    done = subprocess.run(list(command), capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"{command}: {done.stdout}{done.stderr}"


def _submit(script: Path, name: str, tmp_path: Path, env: dict) -> Job:
    """One CPU-mode job of 2 tasks on the localhost node, its output in tmp_path."""
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--job-name={name}", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2",
         "--cpus-per-task=1", "--gpus-per-node=0", "--time=30", f"--output={tmp_path}/slurm-%j.out",
         "--export=ALL", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    return Job(job_id, tmp_path / f"slurm-{job_id}.out")


@pytest.mark.timeout(START_TIMEOUT_S + 4 * PHASE_TIMEOUT_S + 120)
def test_a_requeued_job_resumes_from_its_checkpoint_and_continues_its_ledger(localhost_slurm, tmp_path):
    from megatron_rrfp.goodput import goodput_report

    out = tmp_path / "out"
    env = {**os.environ, "RRFP_CPU": "1", "RRFP_REPO": str(REPO), "RRFP_OUT": str(out), "PYTHONWARNINGS": "ignore",
           "TRAIN_ITERS": str(TRAIN_ITERS), "SAVE_INTERVAL": str(SAVE_INTERVAL), "PYTHON": sys.executable}
    env.pop("MEGATRON_LM", None)  # the project's own driver (the suite may run with MEGATRON_LM set)
    job = _submit(SBATCH, JOB_NAME, tmp_path, env)
    try:
        # 1. SIGUSR1 (as --signal=USR1@120 sends it): save, exit 0, the script requeues the job
        first = job.wait_for(rf"saved checkpoint at iteration {SAVE_INTERVAL} ")
        _run("scancel", "--signal=USR1", job.id)
        stopped = job.wait_for(r"^rrfp: stopped after iteration (\d+) of \d+ \(checkpoint saved\); requeueing",
                               after=first.end())
        clean_stop = int(stopped.group(1))
        assert SAVE_INTERVAL <= clean_stop < TRAIN_ITERS
        job.start_now_when_requeued()
        # 2. the requeued job resumes there; then scontrol requeue kills it mid-run
        resumed = job.wait_for(rf"resumed from \S+ at iteration {clean_stop} ", after=stopped.end())
        saved = job.wait_for(r"saved checkpoint at iteration (\d+) ", after=resumed.end())
        _run("scontrol", "requeue", job.id)
        job.start_now_when_requeued()
        # 3. it resumes from its latest checkpoint and finishes
        again = job.wait_for(r"resumed from \S+ at iteration (\d+) ", after=saved.end())
        assert int(again.group(1)) >= int(saved.group(1))
        job.wait_for(r"^rrfp: done; checkpoints, ledger", after=again.end())
        final = job.wait_until_ended()
    finally:
        subprocess.run(["scancel", job.id], capture_output=True, timeout=30)  # only if something above failed
    log = job.text()
    assert "JobState=COMPLETED" in final and "ExitCode=0:0" in final, final
    assert log.count("mode=cpu/gloo") == 3 and "TP 1 x PP 2 x DP 1" in log and "schedule rrfp" in log
    assert re.search(r"rank \d: SIGUSR1: saving a checkpoint after this iteration", log), log[-4000:]
    assert re.search(r"rank \d: SIGTERM \(the launcher or scheduler is stopping the job\)", log), log[-4000:]

    job_dir = out / JOB_NAME  # one directory for all three runs, outside the checkout
    assert (job_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(TRAIN_ITERS)
    assert (job_dir / "traces" / f"rrfp-iter{TRAIN_ITERS}.json").exists()
    assert any((job_dir / "tensorboard").iterdir())
    assert len((job_dir / "job.env").read_text().splitlines()) == 3  # restart=0, 1, 2
    report = goodput_report(str(job_dir / "goodput.db"))
    assert report.sessions == 3 and not report.live
    [disruption] = report.disruptions  # the SIGUSR1 stop was a clean end, not a disruption
    assert disruption.kind == "JobTerminated" and disruption.resumed_from == int(again.group(1))
    assert report.count("kept") == TRAIN_ITERS


def _megatron_lm_tree() -> str | None:
    from megatron_rrfp.mcore.compat import MEGATRON_CORE_VERSION

    for tree in (t for t in os.environ.get("MEGATRON_LM", "").split(os.pathsep) if t):
        if release(tree) == MEGATRON_CORE_VERSION.release[:2] and (Path(tree) / "pretrain_vlm.py").is_file():
            return tree
    return None


@pytest.mark.timeout(START_TIMEOUT_S + 2 * PHASE_TIMEOUT_S + 60)
def test_the_multimodal_script_runs_megatron_lms_pretrain_vlm(request, tmp_path):
    tree = _megatron_lm_tree()
    if tree is None:
        pytest.skip("set MEGATRON_LM to a Megatron-LM tree of the installed megatron-core's minor "
                    "(e.g. /work/mlm/core_v0.16.1)")
    request.getfixturevalue("localhost_slurm")  # after the skip: no SLURM started for nothing
    copy = copy_tree(tree, tmp_path / "mlm")
    out, iters = tmp_path / "out", 2
    env = {**os.environ, "RRFP_CPU": "1", "RRFP_REPO": str(REPO), "RRFP_OUT": str(out), "PYTHONWARNINGS": "ignore",
           "MEGATRON_LM": str(copy), "TRAIN_ITERS": str(iters), "SAVE_INTERVAL": "1000", "PYTHON": sys.executable,
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    env.setdefault("PYENV_VERSION", ".".join(map(str, sys.version_info[:3])))  # python3-config for the helpers
    job = _submit(MULTIMODAL_SBATCH, "rrfp-ci-vlm", tmp_path, env)
    try:
        job.wait_for(r"^rrfp: done; checkpoints, ledger", timeout=2 * PHASE_TIMEOUT_S)
        final = job.wait_until_ended()
    finally:
        subprocess.run(["scancel", job.id], capture_output=True, timeout=30)
    log = job.text()
    assert "JobState=COMPLETED" in final and "ExitCode=0:0" in final, final
    assert f"megatron_lm={copy}" in log and f"{copy}/pretrain_vlm.py" in log, log[-4000:]
    assert "megatron-rrfp: pipeline schedule rrfp" in log, log[-4000:]
    assert re.findall(r"iteration\s+(\d+)/\s*\d+ \|[^\n]*? lm loss: ", log) == [str(i) for i in range(1, iters + 1)]
    assert (out / "rrfp-ci-vlm" / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(iters)
