"""The benchmark table of docs/benchmark.md in one command: every configuration, Megatron's schedule
against RRFP's default, measured, simulated, simulated with the measured per-task host cost,
where the time goes, and memory beside every speed figure.

    python scripts/bench_suite.py --preset all --f0-ms 50,200 --out rrfp-out/suite

Presets: ``split`` (j0, dense PP4, TP2xPP2 with and without SP, MoE EP2xPP2 — RRFP's
summed task time per rank over Megatron's busy time, target <= 1.02) and ``table`` (the
production configurations plus dense PP4 / PP8, interleaved PP4 x 2 chunks and multimodal
PP4 — measured within 10% of the simulator, or the gap named, and never below 0.99x).
Schedules alternate iteration by iteration (``--interleave``), each configuration runs
under ``flock`` on ``--lock`` (other benchmarks on the host wait), and the load average
before and after each configuration is recorded beside its row.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import time
from contextlib import contextmanager
from dataclasses import replace

from megatron_rrfp.bench.run import BenchConfig, run_bench
from megatron_rrfp.sim.variability import Variability

_MOE = dict(num_experts=4, expert_parallel=2, moe_topk=2)
_IMAGES = dict(images_per_sample=1.0, encoder_time_per_image=0.5, image_token_share=0.6)
# name -> (BenchConfig fields, variability in the 'table' preset); the 'split' preset runs its configs at j0
CONFIGS = {
    "dense-pp4": (dict(pipeline_size=4, num_microbatches=16), "j3"),
    "tp2pp2-sp": (dict(pipeline_size=2, tensor_parallel=2, sequence_parallel=True, num_microbatches=8), "j3"),
    "tp2pp2": (dict(pipeline_size=2, tensor_parallel=2, num_microbatches=16), "j3"),
    "moe-ep2pp2": (dict(pipeline_size=2, data_parallel=2, num_microbatches=8, workload=Variability(**_MOE)), "j3"),
    "dense-pp8": (dict(pipeline_size=8, num_microbatches=32), "j3"),
    "pp4x2-interleaved": (dict(pipeline_size=4, num_chunks=2, num_microbatches=16), "j3"),
    "multimodal-pp4": (dict(model="multimodal", pipeline_size=4, num_microbatches=16,
                            workload=Variability(**_IMAGES)), "j0"),
}
PRESETS = {
    "split": [("dense-pp4", "j0"), ("tp2pp2-sp", "j0"), ("tp2pp2", "j0"), ("moe-ep2pp2", "j0")],
    "table": [(name, level) for name, (_, level) in CONFIGS.items()],
}
PRESETS["all"] = PRESETS["split"] + PRESETS["table"]
SCHEDULES = ("megatron-1f1b", "rrfp-default")


@contextmanager
def measuring(lock_path: str | None):
    """Hold ``flock(lock_path)`` (exclusive) while measuring; no lock when None."""
    if not lock_path:
        yield
        return
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def row(name: str, report: dict, load: tuple) -> dict:
    """One configuration's figures (RRFP's default against Megatron's schedule)."""
    runs = {r["schedule"]: r for r in report["runs"]}
    mg, rr = runs["megatron-1f1b"], runs["rrfp-default"]
    b = rr.get("task_breakdown") or {}
    c = report["config"]
    return {
        "config": name, "variability": c["variability"], "f0_ms": c["f0_ms"], "load_before_after": load,
        "megatron_s": mg["iteration_time_s"]["median"], "rrfp_s": rr["iteration_time_s"]["median"],
        "speedup": rr["speedup_vs_megatron_1f1b"], "simulated_speedup": rr["simulated_speedup"],
        "simulated_speedup_with_host_cost": rr["simulated_speedup_with_host_cost"],
        "gap_explanation": rr["gap_explanation"],
        "task_time_vs_megatron": (b.get("task_time_vs_megatron") or {}).get("median"),
        "task_time_vs_megatron_max": (b.get("task_time_vs_megatron") or {}).get("max"),
        "task_cpu_vs_megatron": (b.get("task_cpu_vs_megatron") or {}).get("median"),
        "host_cpu_vs_megatron": (b.get("host_cpu_vs_megatron") or {}).get("median"),
        "host_ms_per_task": {"megatron": (mg.get("task_breakdown") or {}).get("host_ms_per_task"),
                             "rrfp": b.get("host_ms_per_task")},
        "breakdown_median_s": {s: {k: v["median"] for k, v in (runs[s].get("task_breakdown") or {}).items()
                                   if isinstance(v, dict)} for s in SCHEDULES},
        "activation_mb": {s: runs[s]["peak_activation_bytes"]["max_over_ranks"] / 1e6 for s in SCHEDULES},
        "activation_vs_megatron": rr["activation_memory_vs_megatron_1f1b"],
        "in_flight": {s: runs[s]["peak_in_flight"]["max_over_ranks"] for s in SCHEDULES},
        "bubble": {s: runs[s]["bubble_fraction"] for s in SCHEDULES},
    }


def markdown(rows: list[dict]) -> str:
    def f(x, spec=".3f", suffix=""):
        return "—" if x is None else f"{x:{spec}}{suffix}"

    lines = ["| config | var | f0 ms | Megatron s | rrfp default s | speedup | sim | sim + host cost | tasks / Megatron"
             " busy (wall; cpu) | host ms/task (Mg; rrfp) | act MB (Mg; rrfp; ratio) | in flight | load | sim gap |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['variability']} | {r['f0_ms']:g} | {r['megatron_s']:.3f} | {r['rrfp_s']:.3f} | "
            f"**{r['speedup']:.3f}x** | {r['simulated_speedup']:.3f}x | {f(r['simulated_speedup_with_host_cost'])}x | "
            f"{f(r['task_time_vs_megatron'])}; {f(r['task_cpu_vs_megatron'])} | "
            f"{f(r['host_ms_per_task']['megatron'], '.2f')}; {f(r['host_ms_per_task']['rrfp'], '.2f')} | "
            f"{r['activation_mb']['megatron-1f1b']:.2f}; {r['activation_mb']['rrfp-default']:.2f}; "
            f"{f(r['activation_vs_megatron'], '.2f')}x | {r['in_flight']['megatron-1f1b']} / "
            f"{r['in_flight']['rrfp-default']} | {r['load_before_after'][0]:.1f} → {r['load_before_after'][1]:.1f} | "
            f"{r['gap_explanation']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/bench_suite.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="all")
    p.add_argument("--only", default="", help="comma list of configuration names (default: the preset's)")
    p.add_argument("--f0-ms", default="50,200", help="comma list of emulated forward times (default %(default)s)")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--lock", default="/tmp/rrfp-measure.lock", help="flock file held while measuring ('' none)")
    p.add_argument("--out", default="rrfp-out/suite")
    args = p.parse_args(argv)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = only - set(CONFIGS)
    if unknown:
        p.error(f"--only: unknown {sorted(unknown)}; choose from {', '.join(CONFIGS)}")
    f0s = [float(x) for x in args.f0_ms.split(",") if x.strip()]
    os.makedirs(args.out, exist_ok=True)
    rows: list[dict] = []
    failed: list[str] = []
    for f0 in f0s:
        for name, level in PRESETS[args.preset]:
            if only and name not in only:
                continue
            fields, _ = CONFIGS[name]
            out = os.path.join(args.out, f"{name}-{level}-f0{f0:g}")
            config = replace(BenchConfig(**fields), variability=level, f0_ms=f0, schedules=list(SCHEDULES),
                             iterations=args.iterations, warmup=args.warmup, interleave=True, out_dir=out)
            with measuring(args.lock):
                before = os.getloadavg()[0]
                started = time.time()
                try:
                    report = run_bench(config, progress=False)
                except Exception as exc:  # one failed configuration does not cost the rest of the table
                    failed.append(f"{name} ({level}, f0 {f0:g} ms): {type(exc).__name__}: {str(exc)[:2000]}")
                    print(f"FAILED {failed[-1]}", flush=True)
                    continue
                load = (before, os.getloadavg()[0])
            rows.append(row(name, report, load))
            rows[-1]["seconds"] = time.time() - started
            print(markdown(rows[-1:]).split("\n")[-1], flush=True)
            with open(os.path.join(args.out, "suite.json"), "w", encoding="utf-8") as handle:
                json.dump(rows, handle, indent=2)
    table = markdown(rows)
    with open(os.path.join(args.out, "suite.md"), "w", encoding="utf-8") as handle:
        handle.write(table + "\n")
    print(table)
    for line in failed:
        print(f"FAILED {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
