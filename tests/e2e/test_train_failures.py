"""Failures of ``megatron-rrfp train`` on CPU: 2 local ranks = 2 pipeline stages, rrfp,
``--rrfp-timeout 5``, with the goodput ledger on.

* a rank SIGKILLed mid-iteration: the other rank stops with a diagnosis naming its dead
  peer, the command exits non-zero within a bound, the ledger records the disruption;
* a run killed at iteration 5 and resumed from its iteration-4 checkpoint: the goodput
  report shows the lost work and the recovery time, and the final loss is the
  uninterrupted run's;
* a ledger in a read-only directory: a warning, and training completes (that launch, of 8
  uninterrupted iterations, is also the run the restart must end like).

A rank is killed by a fault-injection hook this test installs from outside the package
(``helpers/fault_site/sitecustomize.py`` on the job's PYTHONPATH). Every launch is a
process started here (forked after torch's import: helpers/cli_fork.py), with a timeout;
``--nproc`` runs the launcher (launch/forked.py) in that process and its ranks die with it, so
killing the launcher (ours) leaves nothing behind.
Ledger write failures mid-write and corrupt / missing ledgers are covered by
tests/e2e/test_goodput.py.

    python -m pytest tests/e2e/test_train_failures.py -v
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from helpers import cli_fork
from megatron_rrfp.goodput import goodput_report

RRFP_TIMEOUT_S = 5.0
TINY = ["--cpu", "--nproc", "2", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "rrfp",
        "--rrfp-timeout", str(RRFP_TIMEOUT_S), "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
        "4", "--seq-length", "32", "--vocab-size", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--lr", "0.01", "--min-lr", "0.001", "--lr-warmup-iters", "0", "--train-iters", "8", "--log-interval", "1"]
LOSS_LINE = re.compile(r"\] iteration\s+(\d+)/\s*(\d+) \|.* lm loss: (\S+) \|")  # Megatron-LM's log line
LAUNCH_TIMEOUT_S = 120
FAULT_SITE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers", "fault_site")
# From the kill to the command's exit: the survivor notices (a dead peer at once through
# the transport, a silent one after --rrfp-timeout), reports, and exits. The launcher
# (launch/forked.py, as torch.distributed.run) SIGTERMs it as soon as it sees the dead rank; the survivor's
# handler lets it finish its report (train/signals.py) and exit with its own status; the
# launcher would SIGKILL it only 30 s later.
EXIT_BOUND_S = RRFP_TIMEOUT_S + 4.0


@dataclass
class Launch:
    returncode: int
    lines: list  # (monotonic time the line arrived, line), stdout and stderr interleaved
    ended: float

    @property
    def output(self) -> str:
        return "".join(line for _, line in self.lines)

    def time_of(self, text: str) -> float:
        found = [t for t, line in self.lines if text in line]
        assert found, f"{text!r} not in the output:\n{self.output[-6000:]}"
        return found[0]

    def losses(self) -> dict[int, float]:
        return {int(m.group(1)): float(m.group(3)) for m in LOSS_LINE.finditer(self.output)}


def launch(*flags: str, kill_rank: int | None = None, kill_at: int | None = None,
           timeout: float = LAUNCH_TIMEOUT_S) -> Launch:
    """``megatron-rrfp train FLAGS``, optionally SIGKILLing rank ``kill_rank`` in iteration
    ``kill_at``; its output is read line by line with arrival times (forked after torch's
    import, helpers/cli_fork.py, which imports the hook's ``sitecustomize`` as start-up would)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONWARNINGS", "RRFP_FAULT_KILL_RANK", "RRFP_FAULT_KILL_AT_ITER")}  # default warnings
    if kill_rank is not None:
        env.update(RRFP_FAULT_KILL_RANK=str(kill_rank), RRFP_FAULT_KILL_AT_ITER=str(kill_at),
                   PYTHONPATH=os.pathsep.join(filter(None, [FAULT_SITE, env.get("PYTHONPATH")])))
    command = cli_fork.start(["train", *flags], env=env, merge_stderr=True)
    lines: list = []
    reader = command.follow(lambda line: lines.append((time.monotonic(), line)))
    try:
        command.wait(timeout=timeout)
        ended = time.monotonic()
    except subprocess.TimeoutExpired:
        pytest.fail(f"`megatron-rrfp train` still running after {timeout} s:\n"
                    + "".join(line for _, line in lines)[-6000:])
    finally:
        command.close()  # kills the launcher if still running; its ranks die with it (PR_SET_PDEATHSIG)
        reader.join(10)
    return Launch(command.poll(), lines, ended)


def assert_killed_rank_1_and_rank_0_left_on_its_own(run: Launch, iteration: int) -> float:
    """The launch's exit status and launcher lines; returns seconds from the kill to the exit."""
    out = run.output
    killed_at = run.time_of(f"fault injection: SIGKILL rank 1 in iteration {iteration}")
    assert run.returncode == 128 + 9, out[-6000:]  # the first failure's status, shell-style
    assert re.search(r"megatron-rrfp: rank 1 \(pid \d+\) was killed by SIGKILL", out), out[-6000:]
    # the launcher SIGTERMed rank 0, which still reported its own failure and left with code 1
    assert re.search(r"megatron-rrfp: rank 0 \(pid \d+\) exited with code 1", out), out[-6000:]
    assert "Unable to shutdown process" not in out, out[-6000:]  # the launcher had to SIGKILL nobody
    return run.ended - killed_at


DIAGNOSIS = re.compile(r"PipelineStallError: rank 0 \(pipeline stage 0\): transport failed: "
                       r"rank 0: (recv from|send to) rank 1 failed")


def assert_records_the_dead_peer(kind: str, message: str) -> None:
    """Rank 0's ledger record of rank 1's death. It is a PipelineStallError when rank 0 found its
    dead peer before the launcher's SIGTERM reached it (the launcher polls every 0.1 s; rank 0
    usually sees the closed socket first); on a loaded host the SIGTERM can come first, and then
    the driver names it as the cause (what a cancelled job needs: a peer whose grace ended first
    is not the cause) and keeps the diagnosis in the message. Either way the diagnosis is there."""
    if kind == "JobTerminated":
        assert "stopped by SIGTERM; while stopping: PipelineStallError: " in message, message
        message = message.split("while stopping: ", 1)[1]
    else:
        assert kind == "PipelineStallError", (kind, message)
        message = "PipelineStallError: " + message
    assert DIAGNOSIS.search(message), message


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_a_rank_killed_mid_iteration_stops_the_job_with_a_diagnosis_and_a_ledger_record(tmp_path):
    ledger = tmp_path / "goodput.db"
    run = launch(*TINY, "--rrfp-goodput-ledger", str(ledger), kill_rank=1, kill_at=4)
    seconds = assert_killed_rank_1_and_rank_0_left_on_its_own(run, 4)
    assert seconds < EXIT_BOUND_S, f"the job took {seconds:.1f} s to exit after the kill"
    assert DIAGNOSIS.search(run.output), run.output[-6000:]
    assert "peers (stage -> rank): {0: 0, 1: 1}" in run.output  # the state dump
    assert sorted(run.losses()) == [1, 2, 3]

    report = goodput_report(str(ledger))
    assert not report.live and report.sessions == 1
    [disruption] = report.disruptions
    assert (disruption.rank, disruption.inferred) == (0, False)
    assert_records_the_dead_peer(disruption.kind, disruption.message)
    # Iteration 4 was cut short; 1-3 completed, but with no checkpoint and no restart they are lost too.
    assert (report.count("kept"), report.count("wasted"), report.count("incomplete")) == (0, 3, 1)
    assert report.badput["wasted_progress"] > 0
    print(f"kill -> exit {seconds:.2f} s; disruption: {disruption.message.splitlines()[0]}")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """TINY's 8 iterations, never stopped: the losses a restart must reproduce. Its ledger is
    in a read-only directory where one can be mounted (root), so the same launch shows that a
    ledger which cannot be written only warns (a ledger never changes the math).
    Returns (launch, the read-only directory, why there is none or None, its listing after the run)."""
    directory = tmp_path_factory.mktemp("uninterrupted") / "read-only"
    with read_only_tmpfs(directory) as why_not:
        run = launch(*TINY, *(() if why_not else ("--rrfp-goodput-ledger", str(directory / "goodput.db"))))
        listing = None if why_not else os.listdir(directory)
    return run, directory, why_not, listing


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S + 60)
def test_restart_from_the_last_checkpoint_accounts_lost_work_and_ends_like_an_uninterrupted_run(tmp_path,
                                                                                                 uninterrupted):
    checkpoints, ledger, figures = tmp_path / "ckpt", tmp_path / "goodput.db", tmp_path / "goodput.json"
    saving = ["--save", str(checkpoints), "--save-interval", "2", "--rrfp-goodput-ledger", str(ledger)]

    killed = launch(*TINY, *saving, kill_rank=1, kill_at=5)
    assert_killed_rank_1_and_rank_0_left_on_its_own(killed, 5)
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "4"

    resumed = launch(*TINY, *saving, "--load", str(checkpoints))  # the same ledger path
    assert resumed.returncode == 0, resumed.output[-6000:]
    assert re.search(r"resumed from \S+ at iteration 4\b", resumed.output), resumed.output[-6000:]
    assert f"goodput ledger: {ledger}" in resumed.output

    reference = uninterrupted[0]
    assert reference.returncode == 0, reference.output[-6000:]
    expected, continued = reference.losses(), resumed.losses()
    assert sorted(expected) == list(range(1, 9)) and sorted(continued) == [5, 6, 7, 8]
    assert all(abs(continued[i] - expected[i]) <= 1e-5 for i in continued), (continued, expected)
    assert all(abs(killed.losses()[i] - expected[i]) <= 1e-5 for i in (1, 2, 3, 4))

    command = subprocess.run([sys.executable, "-m", "megatron_rrfp.cli", "goodput", str(ledger), "--json",
                              str(figures)], capture_output=True, text=True, timeout=60)
    assert command.returncode == 0, command.stderr
    report = json.loads(figures.read_text())
    excerpt = {key: report[key] for key in ("wall_s", "productive_s", "goodput", "badput_s", "iterations",
                                            "sessions", "checkpoint_saves")}
    excerpt["disruptions"] = [{k: d[k] for k in ("kind", "rank", "inferred", "resumed_from", "time_to_resume_s",
                                                 "wasted_iterations", "wasted_s")} for d in report["disruptions"]]
    print("goodput --json excerpt:", json.dumps(excerpt, indent=1))
    assert report["badput_s"]["wasted_progress"] > 0  # iteration 5, cut short, was redone
    assert report["badput_s"]["recovery"] > 0  # from the failure to the restarted process's iteration 5
    assert report["categories_sum_s"] == pytest.approx(report["wall_s"], rel=1e-9)
    assert report["sessions"] == 2 and not report["live"]
    assert (report["iterations"]["kept"], report["iterations"]["incomplete"]) == (8, 1)
    [disruption] = report["disruptions"]
    assert disruption["resumed_from"] == 4
    assert_records_the_dead_peer(disruption["kind"], disruption["message"])
    assert disruption["time_to_resume_s"] > 0 and disruption["wasted_s"] > 0
    assert report["checkpoint_saves"] == 4  # 2 and 4 before the kill, 6 and 8 after the restart


@contextlib.contextmanager
def read_only_tmpfs(directory):
    """Mount a read-only tmpfs at ``directory`` (unmounted on exit); yields why not, or None.
    chmod would not do: root writes into a 0555 directory."""
    os.makedirs(directory, exist_ok=True)
    if os.geteuid() != 0:
        yield "mounting a read-only tmpfs needs root"
        return
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(directory)], check=True,
                       capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        yield f"cannot mount a read-only tmpfs here: {getattr(exc, 'stderr', None) or exc}"
        return
    try:
        yield None
    finally:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True, timeout=30)


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_a_ledger_in_a_read_only_directory_warns_and_training_completes(uninterrupted):
    run, directory, why_not, listing = uninterrupted  # its ledger was in a read-only directory
    if why_not:
        pytest.skip(why_not)
    assert listing == []
    assert run.returncode == 0, run.output[-6000:]
    assert sorted(run.losses()) == list(range(1, 9))
    assert re.search(r"LedgerWarning: goodput ledger \S+: cannot create the lock file \(.*Read-only file system.*\); "
                     r"training continues", run.output), run.output[-6000:]
    assert "goodput ledger " + str(directory / "goodput.db") + ": not written" in run.output


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_a_ledger_another_live_job_writes_fails_every_rank_before_training(tmp_path):
    from megatron_rrfp.goodput import LedgerWriter

    ledger = tmp_path / "goodput.db"
    other_job = LedgerWriter(str(ledger), job="another job")  # holds the job lock, as a live job would
    try:
        run = launch(*TINY, "--rrfp-goodput-ledger", str(ledger))
    finally:
        other_job.close()
    assert run.returncode == 2, run.output[-6000:]
    assert f"megatron-rrfp train: error: goodput ledger {ledger} is already being written by pid {os.getpid()}" \
        in run.output, run.output[-6000:]
    assert "megatron-rrfp train: error: rank 0 cannot write --rrfp-goodput-ledger" in run.output  # rank 1 left too
    assert "still running" not in run.output and "Traceback" not in run.output
    assert not run.losses()


def test_train_help_documents_the_goodput_ledger():
    from megatron_rrfp.train.driver import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "--rrfp-goodput-ledger PATH" in text
    assert "Pass the same path when resuming with --load" in text
    assert "megatron-rrfp goodput run/goodput.db" in text  # the commands in the description


def test_a_ledger_writer_that_cannot_start_only_warns_and_still_joins_the_gathers(monkeypatch):
    import torch.distributed as dist

    from megatron_rrfp.goodput import LedgerWarning
    from megatron_rrfp.goodput import recorder as goodput_recorder
    from megatron_rrfp.train import builders
    from megatron_rrfp.train.config import TrainConfig, check_layout

    def broken_writer(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(goodput_recorder, "LedgerWriter", broken_writer)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.warns(LedgerWarning, match="No space left on device.*training continues"):
            config = TrainConfig(rrfp_goodput_ledger="unused.db")
            recorder = builders.build_recorder(config, check_layout(config, 1), since_wall=0.0)  # DP-sized defaults
    finally:
        dist.destroy_process_group()
    assert recorder.enabled and recorder.writer is None  # every hook runs (and gathers), nothing is written
