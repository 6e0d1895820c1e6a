"""scripts/device_check.py on a machine without a GPU, in seconds: the JSON and the log it
writes, SKIP reasons for the GPU parts, a part killed at its budget (FAIL with its time, no
process of it left, one that left its own session included), the overall deadline, and the
refusal when a prerequisite is missing. The suite part runs a tiny test file of its own here
(``--suite-args``), never the whole suite; the four runs go side by side."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "device_check.py"
_spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
device_check = sys.modules.setdefault("device_check", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(device_check)  # registered first: its dataclasses look their module up

# Tests that leave a process behind in a session of its own (out of reach of the part's
# process group; it carries the part's tag in its environment), one of them sleeping past the budget.
TESTS = textwrap.dedent('''
    import subprocess, sys, time

    def test_passes():
        assert 1 + 1 == 2

    def test_leaves_a_process_behind():
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)

    def test_sleeps_past_the_budget():
        test_leaves_a_process_behind()
        time.sleep(300)
''')
GPU_REASON = "no CUDA device is visible"
BUDGET_S = 30  # pytest (no torch) reaches the sleeping test well inside it, beside both legs' suites too


def _start(tmp_path: Path, name: str, *args: str, python: str = sys.executable, env=None) -> tuple:
    out = tmp_path / name
    command = [sys.executable, str(SCRIPT), "--out", str(out), *args]
    if python != sys.executable:
        command += ["--python", python]
    return out, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                 env=env)


def _finish(started: tuple, timeout: float = 90) -> tuple:
    out, proc = started
    stdout, stderr = proc.communicate(timeout=timeout)
    report = json.loads((out / "device_check.json").read_text()) if (out / "device_check.json").exists() else None
    return proc.returncode, stdout, stderr, report, out


@pytest.mark.timeout(150)
def test_device_check_on_a_cpu_host(tmp_path):
    if not Path("/proc").is_dir():
        pytest.skip("needs Linux /proc to look for the parts' processes")
    tests = tmp_path / "tiny" / "test_tiny.py"
    tests.parent.mkdir()
    tests.write_text(TESTS)
    bare = tmp_path / "bare"  # an interpreter without torch, megatron-core or pytest
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=60)
    no_wheels = ("--wheels", str(tmp_path / "no-wheels"))  # the repository's own wheels/ stay out of it
    begun = time.monotonic()
    runs = {
        # the GPU parts (SKIP: CUDA hidden from the check, also on a GPU host) and the suite part
        # on the tiny file's first two tests
        "skips": _start(tmp_path, "skips", "--parts", "b,c,d,f,a", "--workers", "0", *no_wheels,
                        "--suite-args", f"{tests}::test_passes {tests}::test_leaves_a_process_behind",
                        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}),
        # a part over its budget: killed, FAIL with its time; everything it started is gone
        "budget": _start(tmp_path, "budget", "--parts", "a", "--budget", f"a={BUDGET_S}", "--workers", "0", *no_wheels,
                         "--suite-args", f"{tests}::test_passes {tests}::test_sleeps_past_the_budget"),
        "deadline": _start(tmp_path, "deadline", "--parts", "a", "--deadline", "0.5", "--workers", "0", *no_wheels),
        "refused": _start(tmp_path, "refused", "--parts", "a,e", *no_wheels, python=str(bare / "bin" / "python")),
    }
    results = {name: _finish(started) for name, started in runs.items()}

    code, stdout, stderr, report, out = results["skips"]
    assert report is not None, stderr
    assert report["schema"] == "rrfp-device-check/1" and report["environment"]["gpus"] == 0
    parts = {p["part"]: p for p in report["parts"]}
    assert [p["part"] for p in report["parts"]] == ["b", "c", "d", "f", "a"]
    for key in "bcdf":
        assert parts[key]["status"] == "SKIP" and parts[key]["commands"] == [], parts[key]
        if key != "f" or (REPO / "scripts" / "measure_task_times.py").exists():
            assert GPU_REASON in parts[key]["detail"], parts[key]
    suite = parts["a"]
    assert suite["status"] == "PASS" and suite["figures"]["counts"] == {"passed": 2}, suite
    assert suite["commands"][0]["left_behind"] >= 1 and "processes left behind" in suite["detail"], suite
    assert any("time.sleep(300)" in line for line in suite["commands"][0]["left_behind_commands"]), suite
    assert not device_check.tagged_processes(suite["tag"]), "the process the test left behind still runs"
    for part in report["parts"]:
        assert set(part) >= {"part", "name", "status", "seconds", "budget_s", "detail", "commands", "figures"}
        assert part["status"] in ("PASS", "FAIL", "SKIP") and part["seconds"] >= 0
    assert report["status"] in ("PASS", "FAIL") and code == (1 if report["status"] == "FAIL" else 0)
    assert "a suite: PASS" in stdout and f"{out / 'device_check.json'}" in stdout
    log = (out / "device_check.log").read_text()
    assert f"[{suite['tag']}] $ {sys.executable} -m pytest" in log
    assert any("PASSED" in line and "test_leaves_a_process_behind" in line for line in log.splitlines())

    code, stdout, stderr, report, out = results["budget"]
    [part] = report["parts"]
    assert code == 1 and report["status"] == "FAIL" and part["status"] == "FAIL", (stdout, stderr)
    assert part["detail"].startswith("killed at its time limit") and part["commands"][0]["timed_out"], part
    assert BUDGET_S <= part["seconds"] <= BUDGET_S + device_check.KILL_GRACE_S + 10, part
    # the sleeping test's own process left its session: found by the part's tag and killed with pytest
    assert part["commands"][0]["killed"] >= 1 and "test_passes PASSED" in (out / "device_check.log").read_text()
    assert not device_check.tagged_processes(part["tag"]), "a process of the killed part survived"
    assert "killed at its time limit" in (out / "device_check.log").read_text()

    code, stdout, stderr, report, out = results["deadline"]
    assert code == 0 and [p["status"] for p in report["parts"]] == ["SKIP"], (stdout, stderr)
    assert "left before the 0.5 s deadline" in report["parts"][0]["detail"], report["parts"][0]

    code, stdout, stderr, report, out = results["refused"]
    assert code == 2 and report["status"] == "REFUSED", (stdout, stderr)
    refused = "\n".join(report["refused"])
    assert "torch is not importable" in refused and "megatron-core is not importable" in refused
    assert "--prepare-wheels" in refused and "needs pytest-xdist" in refused and "need pytest" in refused
    assert all(line.startswith("device_check: refused: ") for line in stdout.splitlines()), stdout
    assert time.monotonic() - begun < 120


def test_device_check_refuses_bad_options_in_one_line(tmp_path):
    for args, words in ((["--parts", "a,z"], "--parts: 'a,z'"), (["--budget", "a=0"], "--budget: 'a=0'"),
                        ([], "--out: no folder given")):
        env = {k: v for k, v in os.environ.items() if k != "OUT"}
        run = subprocess.run([sys.executable, str(SCRIPT), *args, *(["--out", str(tmp_path)] if args else [])],
                             capture_output=True, text=True, timeout=60, env=env)
        assert run.returncode == 2 and words in run.stderr.splitlines()[-1], run.stderr


def test_pytest_counts_read_a_run_killed_midway_and_a_finished_one():
    killed = ("[gw1] [ 10%] PASSED tests/test_a.py::test_x \n[gw0] [ 20%] FAILED tests/test_b.py::test_y \n"
              "[gw0] [ 30%] SKIPPED tests/test_b.py::test_z \n")
    assert device_check.pytest_counts(killed) == ({"passed": 1, "failed": 1, "skipped": 1}, ["tests/test_b.py::test_y"])
    one_process = "tests/test_a.py::test_x PASSED     [ 50%]\ntests/test_a.py::test_w ERROR      [100%]\n"
    assert device_check.pytest_counts(one_process) == ({"passed": 1, "error": 1}, ["tests/test_a.py::test_w"])
    closing = killed + "=========== 1 failed, 400 passed, 9 skipped, 3 deselected in 201.35s (0:03:21) ==========\n"
    assert device_check.pytest_counts(closing)[0] == {"failed": 1, "passed": 400, "skipped": 9, "deselected": 3}
