"""Goodput with injected failures: Megatron-LM's pretrain_gpt.py under rrfp on CPU, three recovery recipes.

    python scripts/resilience_table.py --megatron-lm /work/mlm/core_v0.16.1 \
        --nvrx-site /path/to/nvrx-site --out rrfp-out/resilience [--scenarios ref,a,b,c]

PP2 x DP2 (4 ranks, gloo; ``--dp 1``: PP2 alone), ``--train-iters`` iterations; rank 1 raises in its
first forward step of each ``--faults`` iteration (tests/helpers/inprocess_drill.py, once per job):

  ref  uninterrupted (no fault), the loss curve the others are compared with
  a    persistent checkpoints every ``--persistent-interval``; after a failure the whole job is
       launched again (a relaunch, as a scheduler's requeue would)
  b    local checkpoints (NVRx, ``--replication``) every ``--local-interval``; torchrun restarts the
       workers (``--max-restarts``: in-job)
  c    the same local checkpoints; NVRx's in-process restart (``--inprocess-restart``)

Each scenario's goodput, iterations redone and time to resume per failure come from its goodput ledger
(``megatron-rrfp goodput --json``); the per-iteration losses from TensorBoard (the last value written for
each iteration). Prints one row per scenario and writes ``table.json`` under ``--out``. Test code
(the drill) around the shipped launcher; the Megatron-LM tree is copied under ``--out`` first.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from helpers.megatron_lm import COMMON, copy_tree, tensorboard_scalars  # noqa: E402

SCENARIOS = ("ref", "a", "b", "c")


def _local(interval: int, dp: int) -> list[str]:
    """NVRx's local checkpoints every ``interval``; replicas in cliques of two ranks ``dp`` apart (rank r's
    part also on rank r + dp: another pipeline stage, as another node would hold it)."""
    return ["--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", "local",
            "--non-persistent-save-interval", str(interval), "--replication", "--replication-jump", str(dp)]


def scenario_flags(name: str, opts) -> tuple[list[str], int]:
    """(pretrain_gpt.py flags beyond the common ones, torchrun --max-restarts) of one scenario."""
    if name == "ref":
        return ["--save-interval", "100000"], 0
    if name == "a":
        return ["--save-interval", str(opts.persistent_interval)], 0
    if name == "b":
        return ["--save-interval", "100000", *_local(opts.local_interval, opts.dp)], len(opts.faults)
    return ["--save-interval", "100000", *_local(opts.local_interval, opts.dp),
            "--inprocess-restart", "--inprocess-granularity", "rank"], 0


def launch(opts, tree: Path, cwd: Path, flags: list[str], max_restarts: int, faults: list[int],
           attempt: int) -> tuple[int, float]:
    """One torchrun of pretrain_gpt.py through the drill; (exit code, seconds)."""
    python = sys.executable
    version = ".".join(map(str, sys.version_info[:3]))
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TORCH_CPP_LOG_LEVEL": "error",
           "PATH": os.path.dirname(python) + os.pathsep + os.environ.get("PATH", ""),
           "PYENV_VERSION": os.environ.get("PYENV_VERSION", version),
           "PYTHONPATH": os.pathsep.join(p for p in (opts.nvrx_site, str(ROOT / "tests"),
                                                     os.environ.get("PYTHONPATH")) if p),
           "RRFP_DRILL_RANK": "1", "RRFP_DRILL_ITERATION": ",".join(map(str, faults)) or "0",
           "RRFP_DRILL_KIND": "raise", "RRFP_DRILL_ONCE_FILE": str(cwd / "faults-fired.txt")}
    command = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(2 * opts.dp),
               "--max-restarts", str(max_restarts), "-m", "helpers.inprocess_drill", "--cpu",
               str(tree / "pretrain_gpt.py"), *COMMON, "--num-layers", "2", "--pipeline-model-parallel-size", "2",
               "--pipeline-schedule", opts.schedule, "--train-iters", str(opts.train_iters),
               "--ckpt-format", "torch_dist", "--num-workers", "0", "--save", "ckpt", "--load", "ckpt",
               "--rrfp-goodput-ledger", "job.db", "--tensorboard-dir", "tb", "--tensorboard-queue-size", "1",
               *flags]  # queue size 1: a failed process's losses reach the event file too
    (cwd / "commands.txt").open("a").write(" ".join(command) + "\n")
    start = time.monotonic()
    with (cwd / f"launch{attempt}.log").open("w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                              timeout=opts.timeout).returncode
    return code, time.monotonic() - start


def run_scenario(opts, tree: Path, name: str) -> dict:
    cwd = Path(opts.out) / name
    if cwd.exists():
        shutil.rmtree(cwd)
    cwd.mkdir(parents=True)
    flags, max_restarts = scenario_flags(name, opts)
    faults = [] if name == "ref" else opts.faults
    launches, codes, total = 0, [], 0.0
    while True:  # scenario a: the job is launched again until it completes (or the faults are spent)
        code, seconds = launch(opts, tree, cwd, flags, max_restarts, faults, launches)
        launches, total = launches + 1, total + seconds
        codes.append(code)
        if code == 0 or name != "a" or launches > len(faults):
            break
    report = subprocess.run([sys.executable, "-m", "megatron_rrfp", "goodput", str(cwd / "job.db"), "--json",
                             str(cwd / "goodput.json")], capture_output=True, text=True, timeout=300)
    goodput = json.loads((cwd / "goodput.json").read_text()) if report.returncode == 0 else {}
    losses = tensorboard_scalars(cwd / "tb", "lm loss")
    fired = (cwd / "faults-fired.txt").read_text().split() if (cwd / "faults-fired.txt").exists() else []
    return {"scenario": name, "exit_codes": codes, "launches": launches, "seconds": round(total, 1),
            "faults_fired": [int(f) for f in fired], "goodput": goodput.get("goodput"),
            "wall_s": goodput.get("wall_s"), "productive_s": goodput.get("productive_s"),
            "badput_s": goodput.get("badput_s"),
            "disruptions": [{k: d.get(k) for k in ("resumed_from", "wasted_iterations", "time_to_resume_s",
                                                   "recovery_s", "checkpoint_load_s", "checkpoint", "mechanism")}
                            for d in goodput.get("disruptions", [])],
            "losses": {str(k): v for k, v in sorted(losses.items())},
            "goodput_stderr": report.stderr[-2000:] if report.returncode else ""}


def _row(result: dict, reference: dict) -> str:
    d = result["disruptions"]
    lost = ", ".join(str(x["wasted_iterations"]) for x in d) or "-"
    resume = ", ".join(f"{x['time_to_resume_s']:.1f}" if x["time_to_resume_s"] is not None else "?" for x in d) or "-"
    iters = sorted(int(k) for k in result["losses"])
    ref = reference.get("losses", {}) if reference else {}
    diff = max((abs(result["losses"][str(i)] - ref[str(i)]) for i in iters if str(i) in ref), default=None)
    goodput = f"{result['goodput']:.3f}" if result["goodput"] is not None else "?"
    return (f"| {result['scenario']} | exit {result['exit_codes']} | {goodput} | {result['wall_s'] or 0:.1f} | "
            f"{lost} | {resume} | {len(iters)} ({iters[0] if iters else '-'}-{iters[-1] if iters else '-'}) | "
            f"{'-' if diff is None else f'{diff:.2e}'} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", required=True, help="Megatron-LM tree of the installed megatron-core")
    parser.add_argument("--nvrx-site", default="", help="directories holding nvidia-resiliency-ext (os.pathsep)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenarios", default="ref,a,b,c")
    parser.add_argument("--schedule", default="rrfp")
    parser.add_argument("--dp", type=int, choices=(1, 2), default=2, help="data-parallel size (PP is 2)")
    parser.add_argument("--train-iters", type=int, default=60)
    parser.add_argument("--faults", default="14,33,52", help="iterations where rank 1 fails (comma-separated)")
    parser.add_argument("--persistent-interval", type=int, default=20)
    parser.add_argument("--local-interval", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1500, help="seconds per launch")
    opts = parser.parse_args(argv)
    opts.faults = [int(f) for f in opts.faults.split(",") if f]
    names = [s for s in opts.scenarios.split(",") if s]
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        parser.error(f"--scenarios: unknown {unknown}; choose from {','.join(SCENARIOS)}")
    Path(opts.out).mkdir(parents=True, exist_ok=True)
    tree_copy = Path(opts.out) / "tree"
    tree = tree_copy / os.path.basename(opts.megatron_lm.rstrip("/"))
    if not tree.exists():
        tree = copy_tree(opts.megatron_lm, tree_copy)
    table_path = Path(opts.out) / "table.json"
    results = json.loads(table_path.read_text()) if table_path.exists() else {}
    for name in names:
        print(f"scenario {name} ...", flush=True)
        results[name] = run_scenario(opts, tree, name)
        table_path.write_text(json.dumps(results, indent=1))
    print("| scenario | exit codes | goodput | wall s | iterations redone per failure | time to resume s per failure "
          "| iterations logged | max loss diff vs ref |")
    print("|---|---|---|---|---|---|---|---|")
    for name in SCENARIOS:
        if name in results:
            print(_row(results[name], results.get("ref")))


if __name__ == "__main__":
    main()
