"""Where the bench's time goes (bench/breakdown.py) and the simulator's measured host-cost
option (sim.variability.with_host_cost): pure functions, no ranks launched. The end-to-end
figures come from tests/e2e/test_bench_sweep.py's real run."""
from __future__ import annotations

import pytest


def _record(executor=None, **kinds):
    names = ("count", "device", "overrun", "host", "host_cpu")
    return {"by_kind": {k: dict(zip(names, v)) for k, v in kinds.items()}, "other_threads_cpu_s": 0.05,
            "rank_wall_s": 1.0, "busy_s": 0.9, "executor": executor}


def test_a_measured_host_cost_lengthens_the_critical_path_by_its_tasks():
    from megatron_rrfp.policy.topology import Topology
    from megatron_rrfp.sim.simulator import policy, simulate
    from megatron_rrfp.sim.variability import Variability, sample_realization, with_host_cost

    topology = Topology(2, 1)
    realization = sample_realization(Variability(f0=1.0), topology, 1, seed=0)
    base = simulate(policy("1f1b-strict"), topology, 1, realization).makespan
    costs = [{"F": 0.25, "B": 0.5, "W": 0.0}, {"F": 0.125, "B": 1.0, "W": 0.0}]
    slow = simulate(policy("1f1b-strict"), topology, 1, with_host_cost(realization, costs)).makespan
    # one microbatch: F on stage 0, F on 1, B on 1, B on 0 in a chain
    assert base == pytest.approx(6.0)
    assert slow == pytest.approx(6.0 + 0.25 + 0.125 + 1.0 + 0.5)
    assert realization.host_cost is None  # the draw itself is unchanged


def test_megatrons_tasks_are_their_spans_and_rrfps_split_into_executor_and_loop():
    from megatron_rrfp.bench.breakdown import iteration_breakdown

    megatron = iteration_breakdown(_record(F=(4, 0.2, 0.01, 0.05, 0.04), B=(4, 0.4, 0.01, 0.11, 0.1)))
    assert megatron["task_s"] == 0.9 and megatron["executor_s"] == 0.0 and megatron["tasks"] == 8
    assert megatron["host_cost"]["F"] == pytest.approx((0.01 + 0.05) / 4)
    executor = {"compute_s": 0.95, "wait_s": 0.1, "backpressure_s": 0.02, "agree_s": 0.01, "flush_s": 0.0,
                "wall_s": 1.1}
    rrfp = iteration_breakdown(_record(executor, F=(4, 0.2, 0.01, 0.05, 0.04), B=(4, 0.2, 0.0, 0.06, 0.05),
                                       W=(4, 0.2, 0.0, 0.06, 0.05)))
    assert rrfp["executor_s"] == pytest.approx(0.95 - 0.6 - 0.01 - 0.17)
    assert rrfp["runtime_s"] == pytest.approx(1.1 - 0.95 - 0.12 - 0.01)
    assert rrfp["wait_s"] == pytest.approx(0.12)
    per_task = (rrfp["executor_s"] + rrfp["runtime_s"]) / 12
    assert rrfp["host_cost"]["W"] == pytest.approx(0.06 / 4 + per_task)


def test_the_table_names_the_cost_that_explains_a_gap():
    from megatron_rrfp.bench.breakdown import explain_gap

    spread = {"median": 0.0}
    b = {"host_ms_per_task": 3.0, "agree_s": {"median": 0.2}, "runtime_s": spread, "threads_cpu_s": spread,
         "overrun_s": spread}
    run = {"schedule": "rrfp-default", "speedup_vs_megatron_1f1b": 0.95, "simulated_speedup": 1.11,
           "simulated_speedup_with_host_cost": 0.97, "task_breakdown": b}
    assert explain_gap(run).startswith("per-task host cost (3.00 ms/task")
    unexplained = {**run, "simulated_speedup_with_host_cost": 1.10, "iteration_time_s": {"median": 1.05},
                   "simulated_iteration_time_s_with_host_cost": 1.0}
    megatron = {"schedule": "megatron-1f1b", "iteration_time_s": {"median": 1.2},
                "simulated_iteration_time_s_with_host_cost": 1.0}
    text = explain_gap({**unexplained, "iteration_time_s": {"median": 1.15}}, megatron)
    assert "TP agreement 0.200" in text and "Megatron +20.0%, rrfp +15.0%" in text, text
    # rrfp ran as its own prediction says: the gap is Megatron's time between its tasks, in seconds
    text = explain_gap(unexplained, megatron)
    assert "Megatron's time between its tasks: 0.200 s/iteration (+20.0%)" in text and "rrfp +5.0%" in text, text
    assert explain_gap({**run, "speedup_vs_megatron_1f1b": 1.08}).startswith("within 10%")


def test_interleaved_runs_alternate_the_schedules():
    from megatron_rrfp.bench.rank import run_order

    assert [(r, i) for r, i in run_order(["a", "b"], 2, True)] == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    assert [(r, i) for r, i in run_order(["a", "b"], 2, False)] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]


def test_summary_with_task_records_feeds_the_suite_row():
    """summarize() on per-rank records as bench_rank writes them: the host-cost simulation
    runs, the ratios are per rank against Megatron, and the suite's row and table carry them."""
    import os
    import runpy

    from megatron_rrfp.bench.run import BenchConfig, summarize

    suite = runpy.run_path(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "scripts", "bench_suite.py"))
    markdown, row = suite["markdown"], suite["row"]

    config = BenchConfig(pipeline_size=2, num_microbatches=4, schedules=("megatron-1f1b", "rrfp-default"),
                         iterations=1, warmup=0, variability="j0", f0_ms=10.0)
    executor = {"compute_s": 0.2, "wait_s": 0.02, "backpressure_s": 0.0, "agree_s": 0.0, "flush_s": 0.0,
                "wall_s": 0.23}

    def rank(r: int) -> dict:
        common = {"spans": [], "activation_measure": "saved-tensors", "buffer_limit": None, "peak_in_flight": 2}
        megatron = _record(F=(4, 0.04, 0.0, 0.01, 0.01), B=(4, 0.08, 0.0, 0.02, 0.02))
        rrfp = _record(executor, F=(4, 0.04, 0.0, 0.012, 0.011), B=(4, 0.04, 0.0, 0.012, 0.011),
                       W=(4, 0.04, 0.0, 0.012, 0.011))
        megatron["busy_s"] = 0.15
        return {"rank": r, "stage": r, "world_size": 2, "runs": {
            "megatron-1f1b": {**common, "walls": [0.25], "busy": [0.3], "breakdown": None, "tasks": [megatron],
                              "peak_activation_bytes": 1_000_000},
            "rrfp-default": {**common, "walls": [0.23], "busy": [0.4], "breakdown": executor, "tasks": [rrfp],
                             "peak_activation_bytes": 1_010_000, "buffer_limit": 2}}}

    report = summarize(config, [rank(0), rank(1)])
    rrfp = report["runs"][1]
    b = rrfp["task_breakdown"]
    assert b["task_time_vs_megatron"]["median"] == pytest.approx(0.2 / 0.15)
    assert b["task_cpu_vs_megatron"]["median"] == pytest.approx((0.12 + 0.033) / (0.12 + 0.03))
    # the host cost lengthens both predictions; Megatron's per-task cost is larger per F
    assert rrfp["simulated_iteration_time_s_with_host_cost"] > rrfp["simulated_iteration_time_s"]
    assert rrfp["host_cost_s_per_task"][0]["F"] == pytest.approx(0.012 / 4 + (0.2 - 0.12 - 0.036) / 12
                                                                 + (0.23 - 0.2 - 0.02) / 12)
    line = markdown([row("dense", report, (1.0, 2.0))])
    assert "1.333; 1.020" in line and "1.01x" in line and rrfp["gap_explanation"] in line
