"""Task times measured on a device drive the simulator: ``scripts/measure_task_times.py`` on
CPU at tiny sizes writes a file, ``simulate --task-times`` replays it, and the replayed
durations are the file's."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_rrfp.cli import main as cli_main
from megatron_rrfp.policy.actions import Kind, Task
from megatron_rrfp.policy.topology import Topology
from megatron_rrfp.sim import Variability, lower_bound, policy, sample_realization, simulate
from megatron_rrfp.sim.measured import FORMAT, load_task_times

REPO = Path(__file__).resolve().parents[2]
MICROBATCHES = 5
TINY = ["--device", "cpu", "--microbatches", str(MICROBATCHES), "--warmup", "1", "--hidden-size", "32",
        "--num-layers", "1", "--seq-length", "32", "--img-h", "8", "--patch-dim", "4", "--num-experts", "4"]


@pytest.fixture(scope="module")
def measured_file(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("task_times") / "task_times.json"
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "measure_task_times.py"), *TINY, "--out", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def test_script_on_cpu_writes_every_workload(measured_file):
    from megatron_rrfp.mcore import compat

    data = json.loads(measured_file.read_text())
    assert data["format"] == FORMAT and data["units"] == "ms"
    meta = data["metadata"]
    assert meta["device"] == "cpu" and meta["megatron_core"] == str(compat.MEGATRON_CORE_VERSION)
    assert meta["sizes"]["hidden_size"] == 32 and meta["dtype"] == "float32"
    roles = {(name, role): record for name, w in data["workloads"].items() for role, record in w["stages"].items()}
    assert set(roles) == {("gpt", "middle"), ("moe", "middle"), ("multimodal", "first"), ("multimodal", "middle"),
                          ("seqlen", "middle")}
    for where, record in roles.items():
        for kind in ("F", "B", "I", "W"):
            assert len(record[kind]) == MICROBATCHES and all(t > 0 for t in record[kind]), (where, kind)
        assert len(record[record["covariate"]]) == MICROBATCHES
        assert record["peak_activation_mib"]["unsplit"] > 0, where
    lengths = roles["seqlen", "middle"]["tokens"]
    assert all(4 <= n <= 32 for n in lengths) and len(set(lengths)) > 1  # log-uniform in [seq / 8, seq]
    assert all(0 <= n <= 4 for n in roles["multimodal", "first"]["images"])
    assert all(x >= 1.0 for x in roles["moe", "middle"]["expert_imbalance"])  # the router's real loads


@pytest.mark.parametrize("workload", ["seqlen", "multimodal"])
def test_simulate_replays_the_cpu_file(measured_file, workload, capsys):
    rc = cli_main(["simulate", "--pp", "4", "-m", "8", "--seeds", "2", "--task-times", str(measured_file),
                   "--task-times-workload", workload])
    out = capsys.readouterr().out
    assert rc == 0
    assert f"workload {workload} (" in out and "1 f0 = " in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()}
    assert {"1f1b-strict", "bfw", "zbh1"} <= set(rows)
    if workload == "multimodal":
        assert "first stage (5 microbatches)" in out


def write_times(path: Path, stages: dict, name: str = "gpt") -> str:
    path.write_text(json.dumps({"format": FORMAT, "version": 1, "units": "ms", "metadata": {"device": "test"},
                                "workloads": {name: {"description": "written by the test", "stages": stages}}}))
    return str(path)


def constant(f, b, i, w, n=3, covariate="tokens", values=None, shared=True) -> dict:
    return {"F": [f] * n, "B": [b] * n, "I": [i] * n, "W": [w] * n, "covariate": covariate,
            covariate: values or [64] * n, "shared_across_stages": shared}


@pytest.mark.parametrize("chunks", [1, 2])
def test_constant_times_give_the_j0_makespans(tmp_path, chunks):
    # F = 2 ms is f0; B = 2 f0 and I = W = B / 2: exactly the j0 model's durations
    path = write_times(tmp_path / "constant.json", {"middle": constant(2.0, 4.0, 2.0, 2.0)})
    topology, m = Topology(4, chunks), 8
    measured = sample_realization(Variability(task_times=path), topology, m, seed=3)
    model = sample_realization(Variability(), topology, m, seed=3)
    for name in ("1f1b-strict", "zbh1-strict", "bf", "bfw", "zbh1"):
        got = simulate(policy(name), topology, m, measured).makespan
        assert got == pytest.approx(simulate(policy(name), topology, m, model).makespan, rel=1e-12), name
    for split in (False, True):
        assert lower_bound(measured, topology, m, split) == pytest.approx(lower_bound(model, topology, m, split))


def test_replayed_durations_are_the_files(tmp_path):
    forward = [1.0, 3.0, 5.0]  # median 3 ms = f0
    middle = {"F": forward, "B": forward, "I": [0.5 * f for f in forward], "W": [0.25 * f for f in forward],
              "covariate": "tokens", "tokens": [64] * 3, "shared_across_stages": True}
    path = write_times(tmp_path / "times.json", {"middle": middle})
    topology, m = Topology(4), 16
    r = sample_realization(Variability(task_times=path), topology, m, seed=0)
    drawn = np.asarray(r.forward)
    assert set(np.round(drawn.ravel(), 12)) == {round(f / 3, 12) for f in forward}  # every value from the file
    for s in range(4):
        for j in range(m):
            f = r.duration(s, Task(Kind.F, j), split_backward=False)
            assert r.duration(s, Task(Kind.B, j), split_backward=False) == pytest.approx(f)
            assert r.duration(s, Task(Kind.B, j), split_backward=True) == pytest.approx(0.5 * f)  # I, not B / 2
            assert r.duration(s, Task(Kind.W, j), split_backward=True) == pytest.approx(0.25 * f)
    assert not all(len(set(drawn[:, 0, j])) == 1 for j in range(m))  # constant covariate: stages draw apart


def test_data_covariate_is_common_to_the_stages(tmp_path):
    lengths = [100, 200, 400, 800]
    seqlen = {"F": [n / 100 for n in lengths], "B": [n / 50 for n in lengths], "I": [n / 100 for n in lengths],
              "W": [n / 100 for n in lengths], "covariate": "tokens", "tokens": lengths, "shared_across_stages": True}
    first = {**constant(10.0, 20.0, 10.0, 10.0, n=2, covariate="images", values=[1, 3]), "F": [6.0, 14.0]}
    path = write_times(tmp_path / "seqlen.json", {"middle": seqlen, "first": first}, name="vlm")
    r = np.asarray(sample_realization(Variability(task_times=path, task_times_workload="vlm"), Topology(4), 12,
                                      seed=1).forward)
    f0 = float(np.median([n / 100 for n in lengths]))  # the middle stage's median F
    assert set(np.round(r[0, 0] * f0, 9)) <= {6.0, 14.0}  # stage 0: the first stage's times
    assert all(len(set(r[1:, 0, j])) == 1 for j in range(12))  # one length per microbatch on every stage
    assert len(set(r[1, 0])) > 1


@pytest.mark.parametrize("content, flags, expected", [
    (None, [], "--task-times {path}: cannot read it"),
    ("{not json", [], "--task-times {path}: not JSON"),
    (json.dumps({"format": "other"}), [], "--task-times {path}: not a task-times file"),
    ("NEGATIVE", [], "--task-times {path}: gpt/middle: F must be a non-empty list of finite times >= 0"),
    ("GOOD", ["--task-times-workload", "moe"], "--task-times-workload moe: not in --task-times {path}"),
    ("GOOD", ["--sigma-compute", "0.3"], "--task-times replaces the compute model: drop --sigma-compute"),
    ("GOOD", ["--reference"], "--task-times replaces the compute model: drop --sigma-compute"),
])
def test_bad_task_times_is_one_line_naming_the_flag(tmp_path, capsys, content, flags, expected):
    path = tmp_path / "times.json"
    if content == "GOOD":
        write_times(path, {"middle": constant(2.0, 4.0, 2.0, 2.0)})
    elif content == "NEGATIVE":
        write_times(path, {"middle": constant(-1.0, 4.0, 2.0, 2.0)})
    elif content is not None:
        path.write_text(content)
    rc = cli_main(["simulate", "--pp", "2", "-m", "4", "--seeds", "1", "--task-times", str(path), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert expected.format(path=path) in err[0]


def test_the_file_loads_without_torch(measured_file):
    code = (f"import sys; from megatron_rrfp.sim.measured import load_task_times; "
            f"load_task_times({str(measured_file)!r}, 'moe'); "
            "assert 'torch' not in sys.modules, 'the simulator must not import torch'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert load_task_times(str(measured_file), "moe").middle.covariate == "expert_imbalance"
