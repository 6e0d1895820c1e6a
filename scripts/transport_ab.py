#!/usr/bin/env python
"""The CPU transports side by side: ``threads`` against ``rounds`` over gloo, in interleaved pairs.

    python scripts/transport_ab.py demo  [--pairs 5] [--out DIR] [-- DEMO_ARGS]
    python scripts/transport_ab.py bench [--pairs 5] [--out DIR] -- --pp 8 -m 32 --variability j3 \\
        --iterations 5 --schedules megatron-1f1b,rrfp-strict,rrfp-default
    python scripts/transport_ab.py tests [--pairs 5] [--out DIR] -- tests/distributed/test_executor.py ...

Each pair runs the same command with ``threads`` then ``rounds`` (a slow spell of a shared host
falls on both halves of a pair, not on one transport). ``demo`` / ``bench`` pass
``--rrfp-transport`` and print, per schedule and transport, the median over runs of each
run's median iteration, its speedup over Megatron's 1F1B in the same run, peak activation MB,
the executor's and runtime's seconds per iteration and rank, and the per-pair ratio
rounds / threads. ``tests`` runs pytest with the transport forced from outside the package:
a ``sitecustomize`` (written to a temporary folder put first on ``PYTHONPATH``, so the fork
server's ranks load it too) wraps ``megatron_rrfp.mcore.session.resolve_transport`` so that a
CPU run's ``auto`` — and, for rounds, an explicit ``threads`` — resolves to the forced
transport, as if it were the CPU default; it prints each half's wall time and pytest's last line.
Figures and the reading of them: docs/design/transport-choice.md.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

TRANSPORTS = ("threads", "rounds")
FORCE = '''
import importlib.abc, importlib.machinery, os, sys
_FORCED = os.environ["RRFP_AB_TRANSPORT"]
class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "megatron_rrfp.mcore.session":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            original = module.resolve_transport
            def resolve_transport(transport, device):
                if device.type != "cuda" and (transport == "auto" or (transport, _FORCED) == ("threads", "rounds")):
                    transport = _FORCED
                return original(transport, device)
            module.resolve_transport = resolve_transport
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, _Finder())
'''


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("demo", "bench", "tests"))
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--out", default="rrfp-out/transport-ab")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args, rest = parser.parse_args(argv[:split]), argv[split + 1:]  # after --: the command's own arguments
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.what == "tests":
        return _tests(rest, args.pairs, out)
    for pair in range(1, args.pairs + 1):
        for transport in TRANSPORTS:
            run_dir = out / f"{args.what}-{transport}-{pair}"
            cmd = [sys.executable, "-m", "megatron_rrfp", args.what, *rest, "--rrfp-transport", transport,
                   "--out", str(run_dir)]
            seconds, rc = _run(cmd, run_dir.with_suffix(".log"), os.environ)
            print(f"pair {pair} {transport}: rc {rc}, {seconds:.0f} s", flush=True)
    _summarise(out, args.what)
    return 0


def _run(cmd: list[str], log: pathlib.Path, env) -> tuple[float, int]:
    start = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    return time.monotonic() - start, rc


def _spread(values: list[float], digits: int = 3) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def _median(breakdown: dict, key: str) -> float:
    value = breakdown.get(key, 0.0)
    return value["median"] if isinstance(value, dict) else value


def _summarise(out: pathlib.Path, what: str) -> None:
    rows: dict[tuple[str, str], dict[int, dict]] = {}
    for path in sorted(out.glob(f"{what}-*-*/bench.json")):
        _, transport, pair = path.parent.name.rsplit("-", 2)
        for run in json.loads(path.read_text())["runs"]:
            tasks = run["task_breakdown"] or {}
            rows.setdefault((run["schedule"], transport), {})[int(pair)] = {
                "time": run["iteration_time_s"]["median"], "speedup": run["speedup_vs_megatron_1f1b"],
                "act": run["peak_activation_bytes"]["max_over_ranks"] / 2**20,
                "runtime": _median(tasks, "executor_s") + _median(tasks, "runtime_s"), "wait": _median(tasks, "wait_s")}
    print("schedule, transport, runs: median [min-max] over runs of iteration s | speedup vs 1F1B | act MB | "
          "executor+runtime s/it | wait s/it")
    for (schedule, transport), runs in sorted(rows.items()):
        col = {k: [r[k] for r in runs.values()] for k in ("time", "speedup", "act", "runtime", "wait")}
        print(f"{schedule:14} {transport:8} {len(runs)}  {_spread(col['time'])} | {_spread(col['speedup'])} | "
              f"{_spread(col['act'], 2)} | {_spread(col['runtime'])} | {_spread(col['wait'])}")
    for schedule in sorted({s for s, _ in rows if s != "megatron-1f1b"}):
        threads, rounds = rows.get((schedule, "threads"), {}), rows.get((schedule, "rounds"), {})
        ratios = [rounds[p]["time"] / threads[p]["time"] for p in sorted(threads) if p in rounds]
        if ratios:
            print(f"{schedule}: rounds / threads iteration time per pair {' '.join(f'{r:.3f}' for r in ratios)}"
                  f" (median {statistics.median(ratios):.3f})")


def _tests(pytest_args: list[str], pairs: int, out: pathlib.Path) -> int:
    force = pathlib.Path(tempfile.mkdtemp(prefix="transport-ab-"))
    (force / "sitecustomize.py").write_text(FORCE)
    walls: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
    for pair in range(1, pairs + 1):
        for transport in TRANSPORTS:
            path = os.pathsep.join(p for p in (str(force), os.environ.get("PYTHONPATH", "")) if p)
            env = dict(os.environ, RRFP_AB_TRANSPORT=transport, PYTHONPATH=path)
            log = out / f"tests-{transport}-{pair}.log"
            seconds, rc = _run([sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:cacheprovider",
                                *pytest_args], log, env)
            walls[transport].append(seconds)
            last = log.read_text().strip().splitlines()[-1:] or [""]
            print(f"pair {pair} {transport}: rc {rc}, {seconds:.0f} s: {last[0]}", flush=True)
    for transport, values in walls.items():
        print(f"{transport}: wall s {_spread(values, 0)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
