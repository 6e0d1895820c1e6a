"""``train --cpu --nproc N``'s launcher (launch/forked.py): ranks forked from one process keep
what torch's launcher gives its ranks — torchrun's environment and one rendezvous, every
rank stopped when one fails, a signal to the launcher passed on, nothing left behind.

Each case runs the launcher in a subprocess (as ``megatron-rrfp train`` does) over three
ranks of ``helpers/rank_probe.py``, which join a gloo process group through env://.
``tests/e2e/test_train_failures.py`` covers the same launcher under ``train`` (a rank
SIGKILLed mid-iteration).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = ("import sys; sys.path.insert(0, {tests!r})\n"
            "from megatron_rrfp.launch.forked import run_module_forked\n"
            "sys.exit(run_module_forked(3, 'helpers.rank_probe', [{action!r}], env={{'OMP_NUM_THREADS': '1'}},"
            " preload=('torch.distributed',)))\n")


def start(action: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LAUNCHER.format(tests=TESTS, action=action)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def outputs(proc: subprocess.Popen, timeout: float = 60) -> tuple[str, str]:
    """The launcher's stdout and stderr once it exits; killed after ``timeout``."""
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()  # its ranks die with it (PR_SET_PDEATHSIG)
            proc.communicate()


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, list[dict], str]:
    out, err = outputs(proc, timeout)
    probes = sorted((json.loads(line) for line in out.splitlines() if line.startswith("{")), key=lambda p: p["rank"])
    return proc.returncode, probes, err


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(90)
def test_ranks_see_torchruns_environment_and_join_one_rendezvous():
    code, probes, err = finish(start("exit"))
    assert code == 0, err
    assert [p["rank"] for p in probes] == [0, 1, 2]
    for p in probes:
        assert p["world"] == 3 and p["argv"] == ["exit"]
        assert p["env"] == {"RANK": str(p["rank"]), "LOCAL_RANK": str(p["rank"]), "WORLD_SIZE": "3",
                            "LOCAL_WORLD_SIZE": "3", "OMP_NUM_THREADS": "1"}
    assert len(set(probes[0]["pids"])) == 3  # three processes, one process group


@pytest.mark.timeout(90)
def test_a_failed_rank_stops_the_others_at_once_and_its_status_is_the_jobs():
    started = time.monotonic()
    code, probes, err = finish(start("fail-rank-1"))
    assert code == 3, err
    assert time.monotonic() - started < 30  # the others were stopped, not waited for (they sleep 120 s)
    assert re.search(r"megatron-rrfp: rank 1 \(pid \d+\) exited with code 3", err), err
    assert "megatron-rrfp: the launcher stopped ranks 0, 2 (SIGTERM) after that" in err, err
    assert not any(alive(pid) for pid in probes[0]["pids"])


@pytest.mark.timeout(90)
def test_a_signal_to_the_launcher_reaches_every_rank_and_sets_the_exit_status():
    proc = start("wait")
    lines = []
    while len(lines) < 3:  # every rank has joined and printed
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        lines.append(json.loads(line))
    proc.send_signal(signal.SIGTERM)
    code, _, err = finish(proc, timeout=30)
    assert code == 128 + signal.SIGTERM, err
    assert not any(alive(pid) for pid in lines[0]["pids"])


@pytest.mark.timeout(90)
def test_lines_from_ranks_writing_at_once_stay_whole_under_unbuffered_python():
    """The ranks share the launcher's stdout; with PYTHONUNBUFFERED (python -u, common in batch
    scripts) print() writes a line's text and its newline separately, and a line from another
    rank could land in between (an iteration line of train joined to rank 0's buffer-limit line
    failed a CI run's log parsing). print_line writes each line whole."""
    proc = start("lines", env={"PYTHONUNBUFFERED": "1"})
    out, err = outputs(proc)
    assert proc.returncode == 0, err
    written = [line for line in out.splitlines() if not line.startswith("{")]
    broken = [line for line in written if not re.fullmatch(r"rank [012] line \d+ x{300}", line)]
    assert not broken, broken[:3]
    per_rank = {rank: [int(line.split()[3]) for line in written if line.startswith(f"rank {rank} ")]
                for rank in range(3)}
    assert all(lines == list(range(3000)) for lines in per_rank.values()), {r: len(v) for r, v in per_rank.items()}
