"""Where each rank's time goes, per schedule, and what the simulator predicts once it knows.

Per rank and measured iteration (``bench_rank`` records the raw figures; the emulator's
``TaskTally`` sees every task of Megatron's schedules and of RRFP's executor alike):

* ``device_s``: emulated device time (the modeled sleep; identical draws for every schedule);
* ``overrun_s``: how much longer those sleeps took than modeled (a loaded host waking late);
* ``host_s`` / ``host_cpu_s``: wall / CPU time of the real computation inside the tasks
  (megatron-core's code and its TP / EP collectives): the split's own cost shows here;
* ``task_s``: the summed task time — RRFP: the executor's per-task time (``compute_s``),
  Megatron: its F / B spans; ``executor_s`` = ``task_s`` minus the three above: what the
  executor adds around each task (profiler range, sends, waiting on a received tensor);
* ``runtime_s``: RRFP's loop between tasks (arbiter decisions, draining the inbox, the
  transport's bookkeeping) = wall - compute - wait - backpressure - agree - flush;
* ``agree_s``, ``wait_s`` (bubble, incl. backpressure), ``flush_s``: the executor's own;
* ``threads_cpu_s``: CPU seconds of the rank's other threads (transport, gloo, delivery)
  during the call — on a 2-core host they compete with the compute thread.
* ``dp_wait_s``: emulated DP communication the schedule left exposed (``comm_emulation.py``:
  waiting in ``finish_grad_sync`` for reductions, in a chunk's first forward for its all-gather,
  and a step's all-gathers without overlap).

Host noise is separated three ways: device time dominates the tasks (tiny models), the
CPU-time ratio (``device + host_cpu``) is not inflated by preemption, and ``--interleave``
alternates the schedules so a slow spell of the host falls on both.
"""
from __future__ import annotations

import statistics
from typing import Optional

KINDS = ("F", "B", "W")
METRICS = ("device_s", "overrun_s", "host_s", "host_cpu_s", "task_s", "executor_s", "runtime_s", "agree_s",
           "wait_s", "flush_s", "threads_cpu_s", "tasks", "dp_wait_s")


def iteration_breakdown(record: dict) -> dict:
    """One rank's iteration (``bench_rank``'s ``tasks`` entry) as the metrics above, plus
    ``host_cost``: per kind, the seconds a task of that kind spent beyond its device time."""
    kinds = record["by_kind"]

    def total(field: str) -> float:
        return sum(k[field] for k in kinds.values())

    device, overrun, host, host_cpu = total("device"), total("overrun"), total("host"), total("host_cpu")
    count = total("count")
    executor = record.get("executor")
    out = {"device_s": device, "overrun_s": overrun, "host_s": host, "host_cpu_s": host_cpu,
           "threads_cpu_s": record["other_threads_cpu_s"], "tasks": count, "dp_wait_s": record.get("dp_wait_s", 0.0)}
    if executor is None:  # Megatron's own schedule: its tasks are the hooked spans
        out.update(task_s=record["busy_s"], executor_s=0.0, runtime_s=0.0, agree_s=0.0, wait_s=0.0, flush_s=0.0)
        per_task_runtime = 0.0
    else:
        task = executor["compute_s"]
        runtime = executor["wall_s"] - task - executor["wait_s"] - executor["backpressure_s"] \
            - executor["agree_s"] - executor["flush_s"]
        out.update(task_s=task, executor_s=task - device - overrun - host, runtime_s=max(0.0, runtime),
                   agree_s=executor["agree_s"], wait_s=executor["wait_s"] + executor["backpressure_s"],
                   flush_s=executor["flush_s"])
        # what the executor adds per task, spread evenly over the kinds (it does not depend on them)
        per_task_runtime = (out["executor_s"] + out["runtime_s"]) / count if count else 0.0
    out["host_cost"] = {kind: (k["overrun"] + k["host"]) / k["count"] + per_task_runtime
                        for kind, k in kinds.items() if k["count"]}
    return out


def rank_breakdown(records: list[dict]) -> Optional[dict]:
    """Median over the measured iterations of each metric (and of each kind's host cost)."""
    if not records:
        return None
    rows = [iteration_breakdown(r) for r in records]
    out = {name: statistics.median(row[name] for row in rows) for name in METRICS}
    kinds = sorted({k for row in rows for k in row["host_cost"]})
    out["host_cost"] = {k: statistics.median(row["host_cost"][k] for row in rows if k in row["host_cost"])
                        for k in kinds}
    return out


def stage_host_costs(per_rank: list[dict], key: str, num_stages: int) -> Optional[list]:
    """Per pipeline stage, {kind: seconds}: the median over that stage's ranks of the host
    cost per task of schedule ``key`` — the measured option ``sim.variability.with_host_cost`` takes."""
    by_stage: dict[int, list[dict]] = {}
    for r in per_rank:
        rank = rank_breakdown(r["runs"][key].get("tasks") or [])
        if rank is None:
            return None
        by_stage.setdefault(r["stage"], []).append(rank["host_cost"])
    return [{k: statistics.median(c.get(k, 0.0) for c in by_stage.get(stage, [{}])) for k in KINDS}
            for stage in range(num_stages)]


def run_breakdown(per_rank: list[dict], key: str, baseline: str = "megatron-1f1b") -> Optional[dict]:
    """``{metric: {min, median, max}}`` over ranks, the per-task host cost in ms (median over
    ranks), and — against ``baseline`` on the same rank — the ratio of the summed task time
    (wall) and of the device + host CPU time (not inflated by preemption)."""
    ranks = [rank_breakdown(r["runs"][key].get("tasks") or []) for r in per_rank]
    bases = [rank_breakdown(r["runs"][baseline].get("tasks") or []) for r in per_rank]
    if any(r is None for r in ranks):
        return None
    out: dict = {name: _spread([r[name] for r in ranks]) for name in METRICS}
    out["host_ms_per_task"] = statistics.median(
        1e3 * (r["task_s"] - r["device_s"] + r["runtime_s"]) / r["tasks"] for r in ranks if r["tasks"])
    if all(b is not None for b in bases):
        out["task_time_vs_megatron"] = _spread([r["task_s"] / b["task_s"] for r, b in zip(ranks, bases)
                                                if b["task_s"]])
        out["task_cpu_vs_megatron"] = _spread([(r["device_s"] + r["host_cpu_s"]) / (b["device_s"] + b["host_cpu_s"])
                                               for r, b in zip(ranks, bases) if b["device_s"] + b["host_cpu_s"]])
        out["host_cpu_vs_megatron"] = _spread([r["host_cpu_s"] / b["host_cpu_s"] for r, b in zip(ranks, bases)
                                               if b["host_cpu_s"]])
    return out


def explain_gap(run: dict, megatron: Optional[dict] = None, within: float = 0.10) -> str:
    """Which measured cost explains the difference between measured and simulated speedup:
    none needed (within ``within`` of it), the per-task host cost (the simulator given it agrees), or —
    when even that does not close it — how far each schedule's wall is above its own
    host-cost-aware prediction (what runs *between* tasks: Megatron's blocking p2p handoffs,
    RRFP's loop, agreement and threads), with RRFP's largest such cost named."""
    if run["schedule"] == "megatron-1f1b":
        return "reference"
    measured, sim = run["speedup_vs_megatron_1f1b"], run["simulated_speedup"]
    gap = measured / sim - 1
    if abs(gap) <= within:
        return f"within {within:.0%} of the simulator ({gap:+.1%})"
    with_host = run.get("simulated_speedup_with_host_cost")
    b = run.get("task_breakdown")
    if with_host and abs(measured / with_host - 1) <= within and b:
        return (f"per-task host cost ({b['host_ms_per_task']:.2f} ms/task; the simulator with it predicts "
                f"{with_host:.2f}x, {measured / with_host - 1:+.1%})")
    if not b:
        return f"{gap:+.1%}, not explained (no breakdown)"
    costs = {"TP agreement": b["agree_s"]["median"], "runtime loop": b["runtime_s"]["median"],
             "other threads' CPU": b["threads_cpu_s"]["median"], "sleep overrun": b["overrun_s"]["median"]}
    name = max(costs, key=costs.get)
    text = f"{gap:+.1%} (with host cost {'-' if not with_host else f'{measured / with_host - 1:+.1%}'})"
    # (wall, host-cost-aware prediction) per schedule: what each spent between its tasks
    walls = {label: (r["iteration_time_s"]["median"], r["simulated_iteration_time_s_with_host_cost"])
             for label, r in (("Megatron", megatron), ("rrfp", run))
             if r and r.get("simulated_iteration_time_s_with_host_cost")}
    over = {label: wall / predicted - 1 for label, (wall, predicted) in walls.items()}
    if len(over) == 2 and abs(over["rrfp"]) <= within < over["Megatron"]:
        # rrfp ran as predicted; Megatron's own handoffs (blocking p2p, waits the simulator does not model) did not
        wall, predicted = walls["Megatron"]
        return (f"{text}; Megatron's time between its tasks: {wall - predicted:.3f} s/iteration "
                f"({over['Megatron']:+.1%}) over its host-cost prediction (its blocking p2p handoffs), "
                f"rrfp {over['rrfp']:+.1%}")
    if over:
        text += "; wall over its host-cost prediction: " + ", ".join(f"{label} {x:+.1%}" for label, x in over.items())
    return text + f"; rrfp's largest cost between tasks: {name} {costs[name]:.3f} s/iteration"


def _spread(values: list[float]) -> dict:
    if not values:
        return {"min": float("nan"), "median": float("nan"), "max": float("nan")}
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


__all__ = ["explain_gap", "iteration_breakdown", "rank_breakdown", "run_breakdown", "stage_host_costs"]
