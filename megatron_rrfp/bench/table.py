"""The `bench` / `demo` results table: time, speedup, bubble and memory per schedule (per
schedule and buffer limit when `--buffer-limit` is a list)."""

from __future__ import annotations

import statistics


def format_table(report: dict, *, breakdown: bool = False) -> str:
    """The results table; ``breakdown`` adds where each schedule's time went (else one line)."""
    c = report["config"]
    sweep = "tradeoff" in report
    labels = [f"{r['schedule']}@{r['buffer_limit_spec']}" if sweep and r.get("buffer_limit_spec") else r["schedule"]
              for r in report["runs"]]
    width = max([15, *(len(label) + 2 for label in labels)])
    chunks = f" chunks={c['num_chunks']} (interleaved)" if c["num_chunks"] > 1 else ""
    optimal = all("over_optimum" in r for r in report["runs"])
    lines = [f"{c['model']} PP={c['pipeline_size']}{chunks} TP={c['tensor_parallel']} DP={c['data_parallel']} "
             f"M={c['num_microbatches']} variability={c['variability']} f0={c['f0_ms']} ms "
             f"(median of {c['iterations']} iterations after {c['warmup']} warm-up)",
             f"{'schedule':<{width}}{'median s':>10}{'p90 s':>9}{'speedup':>9}{'bubble':>8}{'tokens/s':>10}"
             f"{'act MB':>9}{'vs 1F1B':>8}{'in flight':>10}{'sim s':>8}{'sim speedup':>12}"
             + (f"{'/opt':>6}" if optimal else "") + f"{'/LB':>6}"]
    limits, specs = [], []
    for label, r in zip(labels, report["runs"]):
        t = r["iteration_time_s"]
        ratio = r["activation_memory_vs_megatron_1f1b"]
        lines.append(f"{label:<{width}}{t['median']:>10.3f}{t['p90']:>9.3f}{r['speedup_vs_megatron_1f1b']:>8.2f}x"
                     f"{100 * r['bubble_fraction']:>7.1f}%{r['tokens_per_s']:>10.0f}"
                     f"{r['peak_activation_bytes']['max_over_ranks'] / 1e6:>9.2f}"
                     + (f"{ratio:>7.2f}x" if ratio is not None else f"{'-':>8}")
                     + f"{r['peak_in_flight']['max_over_ranks']:>10}"
                     f"{r['simulated_iteration_time_s']:>8.3f}{r['simulated_speedup']:>11.2f}x"
                     + (f"{r['over_optimum']:>6.2f}" if optimal else "")
                     + f"{r.get('over_lower_bound', float('nan')):>6.2f}")
        if r["buffer_limit"] is not None:
            specs.append(r["buffer_limit"]["spec"])
            limits.append(f"{label} {r['buffer_limit']['per_stage']}")
    lines.append(f"act MB: peak activation memory of the schedule call, max over ranks ({report['activation_measure']}"
                 "); in flight: peak (microbatch, chunk) forwards held, max over ranks; /LB: median time over the "
                 "lower bound of the emulated device times (sim/bounds.py: at the run's buffer limit, with its "
                 "message latency)")
    lines.append(format_optimum_note(report["runs"]) if optimal else
                 "/LB overstates the room left where the bound is loose (interleaving with jitter: docs/simulator.md"
                 "); --optimal: the clairvoyant optimum instead (small layouts, pip install megatron-rrfp[optimal])")
    if limits:
        lines.append(f"buffer limit {', '.join(dict.fromkeys(specs))}, resolved per stage: " + "; ".join(limits))
    if sweep:
        lines.append("fixed orders (megatron-1f1b, *-strict) ran once: a buffer limit does not change their order")
    dp = [(label, r) for label, r in zip(labels, report["runs"]) if "simulated_iteration_time_s_with_dp_comm" in r]
    if dp:  # emulated DP communication (bench/comm_emulation.py): what stayed exposed, and the simulator's view
        lines.append("DP communication: " + "; ".join(
            f"{label} sim+dp {r['simulated_iteration_time_s_with_dp_comm']:.3f} s, exposed "
            f"{(r.get('task_breakdown') or {}).get('dp_wait_s', {}).get('median', float('nan')):.3f} s/rank"
            + (f" (DP epoch rule: {r['dp_epoch_variant']}{_trial(r.get('dp_epoch_trial'))})"
               if r.get("dp_epoch_variant") else "")
            for label, r in dp))
    lines.extend(format_breakdown(report, labels, width) if breakdown else summarize_breakdown(report, labels))
    return "\n".join(lines)


def _trial(figures) -> str:
    """The epoch rule's measured trial in a few words (mcore/epoch_tuning.py), or nothing."""
    if not figures:
        return ""
    return (f"; kept after a trial of {figures['calls_each']} calls each: {figures['rule']} "
            f"{figures['rule_s']:.3f} s, {figures['fallback']} {figures['fallback_s']:.3f} s, "
            f"standard error {figures['error_s']:.3f} s")


def format_optimum_note(runs: list[dict]) -> str:
    """One line under the table: what /opt divides by, and how much of it the solver proved."""
    solves = [(p, t) for r in runs for p, t in zip(r["optimum"]["proven_per_iteration"],
                                                  r["optimum"]["seconds_per_iteration"])]
    limit = runs[0]["optimum"]["time_limit_s"]
    bound = statistics.median(r["optimum"]["solver_bound_over_lower_bound"] for r in runs)
    return (f"/opt: median time over the median clairvoyant optimum of the same emulated times (sim/optimal.py, "
            f"CP-SAT: the best order with the run's split, memory and latency), proven on {sum(p for p, _ in solves)} "
            f"of {len(solves)} (run, iteration)s (else the best order found in {limit:g} s, so /opt is at most the "
            f"true ratio, and the solver proved the optimum at least {bound:.3f} x the bound, median); solver "
            f"{max(t for _, t in solves):.1f} s at most")


def summarize_breakdown(report: dict, labels: list[str]) -> list[str]:
    """One plain line: how long each schedule's ranks waited for ready work, and what its runtime
    itself took (executor, arbitration loop, agreement) per iteration."""
    parts = []
    for label, r in zip(labels, report["runs"]):
        b = r.get("task_breakdown")
        if b:
            own = sum(b[name]["median"] for name in ("executor_s", "runtime_s", "agree_s"))
            parts.append(f"{label} waited {b['wait_s']['median']:.3f} s, its runtime took {own:.3f} s")
    if not parts:
        return []
    return ["per iteration and rank (median): " + "; ".join(parts) + " (--breakdown: where all the time goes)"]


def format_breakdown(report: dict, labels: list[str], width: int) -> list[str]:
    """Where the time goes (bench/breakdown.py), per rank (median over ranks, seconds per
    iteration), the summed task time against Megatron's, and what explains the sim gap."""
    if not any(r.get("task_breakdown") for r in report["runs"]):
        return []
    lines = ["where the time goes (s per iteration, median over ranks): device = emulated, host = real compute "
             "wall (cpu), executor = around each task, loop = arbiter/inbox between tasks",
             f"{'schedule':<{width}}{'device':>8}{'host':>7}{'(cpu)':>7}{'overrun':>8}{'executor':>9}{'loop':>7}"
             f"{'agree':>7}{'wait':>7}{'threads':>8}{'ms/task':>8}{'tasks/Mg':>9}{'(cpu)':>7}  sim gap"]
    for label, r in zip(labels, report["runs"]):
        b = r.get("task_breakdown")
        if not b:
            continue
        ratio, cpu = b.get("task_time_vs_megatron"), b.get("task_cpu_vs_megatron")
        lines.append(f"{label:<{width}}" + "".join(f"{b[name]['median']:>{w}.3f}" for name, w in (
            ("device_s", 8), ("host_s", 7), ("host_cpu_s", 7), ("overrun_s", 8), ("executor_s", 9), ("runtime_s", 7),
            ("agree_s", 7), ("wait_s", 7), ("threads_cpu_s", 8)))
            + f"{b['host_ms_per_task']:>8.2f}"
            + (f"{ratio['median']:>8.3f}x{cpu['median']:>6.3f}x" if ratio else f"{'-':>9}{'-':>7}")
            + f"  {r.get('gap_explanation', '')}")
    return lines
