"""`megatron-rrfp bench --buffer-limit 1x,2x` end to end through the real CLI and launcher
(two gloo ranks, a real megatron-core GPTModel): the new schedules run, fixed orders once,
readiness-first ones once per limit, the trade-off section and picture are written, and at
1x no RRFP schedule holds more forwards in flight than Megatron's own. It runs as a shell
user runs it (a subprocess, so a fresh fork server), which also checks the command's
output: megatron-core's dependency warnings (Apex / Transformer Engine missing, its
deprecation notes) replaced by one line, said before the progress bar."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCHEDULES = ("megatron-1f1b", "rrfp-strict", "rrfp-default", "rrfp-zbh1", "rrfp-zbh1-strict")
FIXED = {"megatron-1f1b", "rrfp-strict", "rrfp-zbh1-strict"}
LIMITS = ("1x", "2x")
RUN_KEYS = {"schedule", "buffer_limit_spec", "iteration_time_s", "speedup_vs_megatron_1f1b", "bubble_fraction",
            "peak_activation_bytes", "peak_in_flight", "buffer_limit", "simulated_speedup"}


@pytest.mark.timeout(300)
def test_bench_sweeps_buffer_limits_end_to_end(tmp_path):
    from megatron_rrfp.quiet import note

    out = tmp_path / "bench"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    result = subprocess.run([sys.executable, "-m", "megatron_rrfp", "bench", "--pp", "2", "-m", "4", "--iterations",
                             "1", "--warmup", "0", "--f0-ms", "2", "--buffer-limit", ",".join(LIMITS), "--schedules",
                             ",".join(SCHEDULES), "--out", str(out), "--timeout", "240", "--interleave"],
                            capture_output=True, text=True, timeout=280, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    table, err = result.stdout, result.stderr
    for noise in ("not installed. Falling back", "Warning:", "IS DEPRECATED", "No CUDA runtime"):
        assert noise not in err, err[-4000:]
    line = note()  # None where Apex and Transformer Engine are both installed
    if line is not None:
        assert err.count(line) == 1 and err.index(line) < err.find("benchmark iterations"), err[-4000:]
    report = json.loads((out / "bench.json").read_text())
    runs = report["runs"]
    assert all(RUN_KEYS <= set(run) for run in runs), [sorted(run) for run in runs]

    seen = [(run["schedule"], run["buffer_limit_spec"]) for run in runs]
    expected = [(s, None) if s in FIXED else (s, limit) for s in SCHEDULES for limit in
                ((None,) if s in FIXED else LIMITS)]
    assert seen == expected
    assert all((run["buffer_limit"] is None) == (run["schedule"] in FIXED) for run in runs)
    assert all(run["buffer_limit"]["spec"] == run["buffer_limit_spec"] for run in runs if run["buffer_limit"])

    megatron = runs[0]
    assert megatron["schedule"] == "megatron-1f1b" and megatron["speedup_vs_megatron_1f1b"] == pytest.approx(1.0)
    megatron_in_flight = megatron["peak_in_flight"]["max_over_ranks"]
    assert megatron_in_flight >= 1
    for run in runs:
        if run["buffer_limit_spec"] == "1x":  # equal memory: never more forwards held than Megatron
            assert run["peak_in_flight"]["max_over_ranks"] <= megatron_in_flight, run
        assert run["peak_activation_bytes"]["max_over_ranks"] > 0, run

    # where the time goes: every schedule sleeps the same draw (a split B and its W share B's time)
    devices = [run["task_breakdown"]["device_s"]["median"] for run in runs]
    assert max(devices) == pytest.approx(min(devices), rel=1e-9), devices
    for run in runs:
        b = run["task_breakdown"]
        assert b["task_s"]["min"] >= b["device_s"]["min"] > 0 and b["host_cpu_s"]["median"] > 0, b
        assert b["task_time_vs_megatron"]["median"] > 0 and run["simulated_speedup_with_host_cost"] > 0, run
        assert run["gap_explanation"]
    assert "--breakdown: where all the time goes" in table and "ms/task" not in table  # one plain line
    from megatron_rrfp.bench.table import format_table

    assert "ms/task" in format_table(report, breakdown=True)  # the whole breakdown, asked for

    tradeoff = report["tradeoff"]
    assert set(tradeoff["curve"]) == set(SCHEDULES)
    assert all(len(points) == (1 if name in FIXED else len(LIMITS)) for name, points in tradeoff["curve"].items())
    assert tradeoff["megatron_peak_in_flight"] == megatron_in_flight
    assert [p["buffer_limit_spec"] for p in tradeoff["curve"]["rrfp-default"]] == list(LIMITS)
    assert (out / "tradeoff.png").stat().st_size > 0 and (out / "timeline.png").exists()
    assert (out / "trace-rrfp-default@2x.json").exists() and (out / "trace-rrfp-zbh1-strict.json").exists()
    assert "rrfp-default@2x" in table and "rrfp-zbh1-strict" in table and "tradeoff.png" in table


def test_a_limit_list_with_auto_is_accepted_before_any_rank_starts():
    """'auto' is measured at run time; the layout check runs it at 1x, where it starts."""
    from megatron_rrfp.bench.run import BenchConfig

    config = BenchConfig(pipeline_size=2, num_microbatches=4, buffer_limit=["1x", "auto"],
                         schedules=("megatron-1f1b", "rrfp-default"))
    config.validate()  # raised "buffer limit 'auto' ... this caller has no measure" before
    assert [run.key for run in config.runs()] == ["megatron-1f1b", "rrfp-default@1x", "rrfp-default@auto"]
