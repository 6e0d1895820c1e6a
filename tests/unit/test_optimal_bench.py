"""bench --optimal: each run's clairvoyant optimum on the iterations' emulated times (sim/optimal.py),
printed beside /LB; refused in one line before any rank starts where it cannot be computed. Without it,
bench and simulate say in one line that /LB can overstate the room left."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from megatron_rrfp.bench.run import BenchConfig, summarize
from megatron_rrfp.bench.table import format_table

needs_solver = pytest.mark.skipif(importlib.util.find_spec("ortools") is None,
                                  reason="pip install megatron-rrfp[optimal]")


def _records(schedules: dict[str, float]) -> list[dict]:
    """Two ranks' records as bench_rank writes them (walls in seconds, RRFP at limit 2)."""
    def rank(r: int) -> dict:
        runs = {}
        for name, wall in schedules.items():
            runs[name] = {"spans": [], "activation_measure": "saved-tensors", "peak_in_flight": 2,
                          "buffer_limit": None if name == "megatron-1f1b" else 2, "walls": [wall, wall],
                          "busy": [wall, wall], "breakdown": None, "tasks": None, "peak_activation_bytes": 1_000_000}
        return {"rank": r, "stage": r, "world_size": 2, "runs": runs}

    return [rank(0), rank(1)]


@needs_solver
def test_bench_optimal_prints_the_optimum_beside_the_bound():
    walls = {"megatron-1f1b": 0.5, "rrfp-strict": 0.5, "rrfp-default": 0.45}
    config = BenchConfig(pipeline_size=2, num_microbatches=4, schedules=tuple(walls), iterations=2, warmup=0,
                         variability="j3", f0_ms=10.0, optimal=True, optimal_time_limit_s=20.0)
    report = summarize(config, _records(walls))
    for run in report["runs"]:
        optimum = run["optimum"]
        assert len(optimum["makespan_per_iteration"]) == 2 and all(optimum["proven_per_iteration"])
        # never below the bound the /LB column divides by, so /opt never claims more room than /LB
        assert 0 < optimum["lower_bound_over_optimal"] <= 1 + 1e-9
        assert optimum["solver_bound_over_lower_bound"] >= 1.0  # what the solver proved, never below the bound
        assert run["over_optimum"] <= run["over_lower_bound"] * (1 + 1e-9)
        # the optimum of what the run may do is no slower than what its policy does on the same times
        assert optimum["makespan_median"] <= run["simulated_iteration_time_s"] * (1 + 1e-3)
    megatron, strict, default = report["runs"]
    assert not megatron["optimum"]["split_backward"] and default["optimum"]["split_backward"]
    assert megatron["optimum"]["caps"] == [2, 1]  # 1F1B's own peak per stage (PP 2)
    # Megatron's own p2p is not delayed by the bench: its optimum sees no latency, RRFP's strict 1F1B does
    assert megatron["optimum"]["makespan_median"] <= strict["optimum"]["makespan_median"]
    table = format_table(report)
    header = next(line for line in table.splitlines() if line.startswith("schedule"))
    assert header.split()[-2:] == ["/opt", "/LB"]
    assert "/opt: median time over the median clairvoyant optimum" in table and "proven on 6 of 6" in table
    assert "the solver proved the optimum at least" in table


def test_without_optimal_the_table_says_the_bound_may_overstate_the_room():
    walls = {"megatron-1f1b": 0.5, "rrfp-default": 0.45}
    config = BenchConfig(pipeline_size=2, num_microbatches=4, schedules=tuple(walls), iterations=1, warmup=0,
                         variability="j3", f0_ms=10.0)
    report = summarize(config, _records(walls))
    assert all("over_optimum" not in run for run in report["runs"])
    table = format_table(report)
    assert "/opt" not in table.splitlines()[1] and "--optimal: the clairvoyant optimum instead" in table


@needs_solver
def test_bench_optimal_above_the_size_is_refused_in_one_line():
    config = BenchConfig(pipeline_size=4, num_chunks=4, num_microbatches=32, schedules=("megatron-1f1b",
                         "rrfp-default"), optimal=True)
    with pytest.raises(ValueError, match=r"--optimal: PP 4 x 4 chunks x M 32 is 1536 tasks") as info:
        config.validate()
    assert "\n" not in str(info.value) and "--num-microbatches" in str(info.value)
    with pytest.raises(ValueError, match="--optimal-time-limit"):
        BenchConfig(pipeline_size=2, num_microbatches=4, optimal=True, optimal_time_limit_s=0.0).validate()
    BenchConfig(pipeline_size=2, num_microbatches=4, optimal=True).validate()  # small: accepted


@needs_solver
def test_bench_command_line_refuses_a_large_optimal_before_any_rank_starts(capsys, tmp_path):
    from megatron_rrfp.cli import main

    assert main(["bench", "--optimal", "--optimal-time-limit", "3", "--pipeline-model-parallel-size", "4",
                 "--virtual-pipeline-model-parallel-size", "4", "--num-microbatches", "32",
                 "--out", str(tmp_path / "out")]) != 0
    err = capsys.readouterr().err.strip()
    assert "--optimal: PP 4 x 4 chunks x M 32" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()  # refused before the output folder or any rank


def test_bench_optimal_without_the_solver_names_the_extra():
    code = ("import sys; sys.modules['ortools'] = None\n"
            "from megatron_rrfp.bench.run import BenchConfig\n"
            "BenchConfig(pipeline_size=2, num_microbatches=4, optimal=True).validate()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1].endswith("--optimal needs OR-Tools' CP-SAT solver: pip install "
                                                          "megatron-rrfp[optimal]")


def test_simulate_without_optimal_points_to_it_where_the_layout_allows(capsys):
    from megatron_rrfp.cli import main

    note = "/LB can overstate the room left"
    assert main(["simulate", "--pp", "2", "-m", "4", "--chunks", "2", "--reference", "--seeds", "1",
                 "--policies", "default"]) == 0
    assert note in capsys.readouterr().out.splitlines()[-1]
    assert main(["simulate", "--pp", "8", "-m", "64", "--reference", "--seeds", "1", "--policies", "default"]) == 0
    assert note not in capsys.readouterr().out  # above the optimum's size: nothing to point to
