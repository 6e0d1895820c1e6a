#!/usr/bin/env python3
"""The one-GPU device check: what only a GPU host can show, in one command, within a deadline.

    python3 scripts/device_check.py --out DIR [--require-gpu] [--parts b,d,c,e,f,a] [--deadline 470]
        [--budget a=300,b=120,...] [--wheels wheels] [--workers N] [--suite-args "..."]
    python3 scripts/device_check.py --prepare-wheels [--wheels wheels]   # here, where PyPI is reachable

Parts, run in the order given (default b,d,c,e,f,a: the GPU parts first, the suite takes what is left):
  a suite        the whole CPU suite with the GPU visible: pytest -m "not cuda" over the machine's cores
                 (xdist, --dist loadfile); counts and the failed tests' ids
  b selfcheck    the one-GPU self-check steps (scripts/gpu_selfcheck.py as one rank), the
                 queue-serialization probe timed by CUDA events among them; every step's verdict
  c cuda-tests   pytest -m cuda (tests that need GPUs; the multi-GPU ones skip on one)
  d split-cost   scripts/split_cost.py --device cuda in fp32 and in bf16; their figures
  e demo         megatron-rrfp demo with CUDA visible (the CPU default), then demo --device cuda:
                 with fewer GPUs than --pp it must refuse in one line naming the count (checked
                 without a GPU too); --pp 2 where two GPUs are visible, --pp 1 on one (a refusal
                 of --pp 1 is a SKIP)
  f task-times   scripts/measure_task_times.py --device cuda --out DIR/task_times.json

DIR gets device_check.json (every part's PASS / FAIL / SKIP, its time and figures, rewritten
after each part) and device_check.log (every command and all it printed); other outputs go to
a temporary folder. A part runs for at most its budget and never past the overall deadline: a
part over its budget is killed with every process it started (its process session, and any
process carrying its tag in its environment) and is a FAIL with its time; a part that cannot
start in the time left is a SKIP saying so. A part whose GPU is missing is a SKIP; a missing
package (torch, megatron-core, pytest, pytest-xdist) refuses the whole run at once (exit 2),
one line each. megatron-core and the other packages a GPU image lacks travel as wheels in
``--wheels`` (see ``--prepare-wheels``): those built for the interpreter that it lacks, or has
older (a megatron-core already there stays: it is the one checked), are installed with
``pip --no-index --target`` into a folder put first on the parts' PYTHONPATH. Only the
standard library runs in this process; the GPU is never reset or reconfigured.
Exit status: 0 no FAIL, 1 a FAIL, 2 refused.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
PARTS = {"a": "suite", "b": "selfcheck", "c": "cuda-tests", "d": "split-cost", "e": "demo", "f": "task-times"}
DEFAULT_ORDER = "b,d,c,e,f,a"
DEFAULT_BUDGET_S = {"a": 300, "b": 120, "c": 150, "d": 150, "e": 150, "f": 120}
DEFAULT_DEADLINE_S = 470  # the check's own limit: 8 minutes, with room for the wheels' install
MIN_START_S = 15  # a part is not started with less time than this left before the deadline
KILL_GRACE_S = 5  # SIGTERM, then this long, then SIGKILL
LEAVE_S = 3  # after a command ends, what of it still runs this long later was left behind
TAG_VARIABLE = "RRFP_DEVICE_CHECK_TAG"
GPU_PARTS = {"b", "c", "d", "f"}
# What a GPU image with torch, pytest, pytest-xdist, hypothesis and matplotlib lacks for the
# suite and the CLI: leg B's versions (Python 3.12, megatron-core 0.19.2), pinned as CI runs them.
# pydantic: megatron.training and wandb; wandb and its own needs: test_train's W&B offline run.
WHEELS = (("megatron-core", "0.19.2"), ("pydantic", "2.14.4"), ("pydantic-core", "2.50.5"),
          ("annotated-types", "0.8.0"), ("typing-inspection", "0.4.5"), ("typing-extensions", "4.16.0"),
          ("wandb", "0.31.0"), ("cwevals", "0.0.1b1"), ("platformdirs", "4.14.9"), ("distro", "1.9.0"),
          ("sniffio", "1.3.1"), ("googleapis-common-protos", "1.76.0"), ("opentelemetry-api", "1.45.2"),
          ("opentelemetry-sdk", "1.45.2"), ("opentelemetry-proto", "1.45.2"),
          ("opentelemetry-exporter-otlp-proto-http", "1.45.2"), ("opentelemetry-exporter-otlp-proto-common", "1.45.2"),
          ("opentelemetry-semantic-conventions", "0.66b2"), ("opentelemetry-exporter-http-transport", "0.66b2"),
          ("opentelemetry-exporter-otlp-common", "0.66b2"))
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                   "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
UNDER_TEST = {"megatron-core"}  # installed from a wheel only where missing, never over another version
TRAVEL_LIMIT_MIB = 64  # the working tree and the carried wheels, together

# Run by the parts' interpreter: what it has. Imports torch where a chosen part needs the GPU
# count (its CUDA build and the GPUs it sees; no CUDA context is made), never megatron-core
# (found, not imported: seconds saved).
ENV_PROBE = r"""
import importlib.metadata as md, importlib.util, json, platform, sys
carried, look_at_gpus = json.loads(sys.argv[1]), sys.argv[2] == "gpus"
out = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform()}
def found(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
out["modules"] = {m: found(m) for m in ("torch", "megatron.core", "pytest", "xdist", "hypothesis", "matplotlib",
                                       "transformer_engine")}
def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None
out["versions"] = {d: version(d) for d in ("torch", "megatron-core", "pytest", "pytest-xdist", "hypothesis",
                                           "matplotlib", "numpy")}
try:
    from packaging.version import Version
except ImportError:
    Version = None
need = {}
ours = {"py3", "py2.py3", f"cp{sys.version_info[0]}{sys.version_info[1]}"}
for dist, (carried_version, python_tag, only_if_missing) in carried.items():
    have = version(dist)
    older = have is not None and Version is not None and Version(have) < Version(carried_version)
    fits = bool(ours & set(python_tag.split(".")))
    need[dist] = {"installed": have, "fits": fits,
                  "install": fits and (have is None or (older and not only_if_missing))}
out["carried"] = need
try:
    if not look_at_gpus:
        raise LookupError("GPUs not looked at: no chosen part needs them")
    import torch
    out["torch"] = torch.__version__
    out["cuda_build"] = torch.version.cuda
    out["gpus"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(out["gpus"])]
    nccl = getattr(torch.cuda, "nccl", None)
    try:
        out["nccl"] = ".".join(map(str, nccl.version())) if nccl is not None and out["gpus"] else None
    except Exception as exc:
        out["nccl"] = f"unknown ({exc})"
except LookupError as exc:
    out["torch"], out["gpus"] = version("torch"), None
    out["gpu_note"] = str(exc)
except Exception as exc:
    out["torch_error"] = f"{type(exc).__name__}: {exc}"
    out["gpus"] = 0
print(json.dumps(out))
"""


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --------------------------------------------------------------------------- processes

@dataclass
class Command:
    command: list
    returncode: Optional[int] = None
    seconds: float = 0.0
    timed_out: bool = False
    killed: int = 0  # processes beside the command killed with it at its time limit
    left_behind: int = 0  # processes of the part still alive after the command: killed
    left_behind_commands: list = field(default_factory=list)  # their command lines (the first few)
    output: str = field(default="", repr=False)

    def record(self) -> dict:
        row = asdict(self)
        row.pop("output")
        return row

    def tail(self, lines: int = 6) -> str:
        return " | ".join(line.strip() for line in self.output.strip().splitlines()[-lines:])


def tagged_processes(tag: str) -> list[int]:
    """Processes whose environment carries ``TAG_VARIABLE=tag`` (Linux /proc; [] elsewhere)."""
    marker = f"{TAG_VARIABLE}={tag}".encode() + b"\0"
    found = []
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")[:200].strip()
    except OSError:
        return "?"


def session_processes(sid: int) -> list[int]:
    """Processes of session ``sid`` (Linux /proc; [] elsewhere)."""
    found = []
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 4 and int(fields[4]) == sid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def kill_tree(pid: int, tag: str, ended: Callable[[], bool]) -> int:
    """SIGTERM the command's process session and every process carrying ``tag``, SIGKILL what is
    left after the grace; returns how many processes there were beside the command itself.
    ``ended`` reaps the command (Popen.poll) and says whether it is gone."""
    def alive() -> set[int]:
        return set(session_processes(pid)) | set(tagged_processes(tag))

    victims = alive()
    others = len(victims - {pid})
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for target in victims:
            try:
                os.kill(target, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        end = time.monotonic() + (KILL_GRACE_S if sig == signal.SIGTERM else 2)
        while time.monotonic() < end:
            victims = alive() - {pid}
            if ended() and not victims:
                return others
            time.sleep(0.1)
        victims = alive()
    return others


class Runner:
    """Runs the parts' commands: output to the log (and kept), a timeout, no survivors."""

    def __init__(self, log, env: dict, cwd: Path) -> None:
        self.log, self.env, self.cwd = log, env, cwd
        self.current: Optional[subprocess.Popen] = None
        self.current_tag = ""
        self.lock = threading.Lock()

    def write(self, text: str) -> None:
        with self.lock:
            self.log.write(text)
            self.log.flush()

    def run(self, command: list, *, timeout: float, tag: str, env: Optional[dict] = None) -> Command:
        result = Command([str(c) for c in command])
        self.write(f"\n=== {utc_now()} [{tag}] $ {shlex.join(result.command)}   (timeout {timeout:.0f} s)\n")
        start = time.monotonic()
        child_env = dict(self.env if env is None else env)
        child_env[TAG_VARIABLE] = tag
        proc = subprocess.Popen(result.command, cwd=self.cwd, env=child_env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.current, self.current_tag = proc, tag
        chunks: list[str] = []

        def pump() -> None:
            for raw in iter(proc.stdout.readline, b""):
                line = raw.decode("utf-8", "replace")
                chunks.append(line)
                self.write(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=max(0.1, timeout))
        except subprocess.TimeoutExpired:
            result.timed_out = True
            result.killed = kill_tree(proc.pid, tag, lambda: proc.poll() is not None)
            proc.wait()
        result.returncode = proc.returncode
        settle = time.monotonic() + LEAVE_S  # helpers that end with their parent (multiprocessing's
        while True:  # fork server and resource tracker) take a moment to see it go
            left = [p for p in tagged_processes(tag) + session_processes(proc.pid) if p != proc.pid]
            if not left or time.monotonic() > settle:
                break
            time.sleep(0.1)
        if left:  # the command ended but left processes behind: they go too, and the part says so
            result.left_behind = len(set(left))
            result.left_behind_commands = [command_line(p) for p in sorted(set(left))[:5]]
            kill_tree(proc.pid, tag, lambda: True)
        reader.join(5)
        result.seconds = round(time.monotonic() - start, 2)
        result.output = "".join(chunks)
        self.current = None
        self.write(f"=== [{tag}] {'killed at its time limit' if result.timed_out else 'exit'} "
                   f"{result.returncode} after {result.seconds:.1f} s"
                   + (f"; {result.left_behind} processes left behind, killed: {result.left_behind_commands}"
                      if result.left_behind else "") + "\n")
        return result

    def stop_current(self) -> None:
        proc = self.current
        if proc is not None and proc.poll() is None:
            kill_tree(proc.pid, self.current_tag, lambda: proc.poll() is not None)


# --------------------------------------------------------------------------- parts

@dataclass
class Part:
    part: str
    name: str
    status: str = "SKIP"
    seconds: float = 0.0
    budget_s: float = 0.0
    detail: str = ""
    tag: str = ""
    commands: list = field(default_factory=list)
    figures: dict = field(default_factory=dict)


class Context:
    def __init__(self, args, runner: Runner, env_info: dict, work: Path, run_id: str) -> None:
        self.args, self.runner, self.env, self.work, self.run_id = args, runner, env_info, work, run_id
        self.python = args.python
        self.gpus = int(env_info.get("gpus") or 0)
        self.part_end = 0.0

    def left(self) -> float:
        return self.part_end - time.monotonic()

    def run(self, part: Part, command: list, **kw) -> Command:
        result = self.runner.run(command, timeout=self.left(), tag=part.tag, **kw)
        part.commands.append(result.record())
        return result


PYTEST_LINE = re.compile(r"(?:^\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+))"
                         r"|(?:^(tests/\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b)", re.MULTILINE)
PYTEST_SUMMARY = re.compile(r"^=+ (.*\d+ (?:passed|failed|error|errors|skipped|deselected)[^=]*) in ([\d.]+)s",
                            re.MULTILINE)


def pytest_counts(output: str) -> tuple[dict, list]:
    """Outcome counts from pytest -v output (also of a run killed midway), and failed ids."""
    counts: dict = {}
    failed = []
    for match in PYTEST_LINE.finditer(output):
        outcome, test = (match.group(1), match.group(2)) if match.group(1) else (match.group(4), match.group(3))
        counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
        if outcome in ("FAILED", "ERROR"):
            failed.append(test)
    summary = PYTEST_SUMMARY.findall(output)
    if summary:  # the closing line, where pytest got to print it, is the authority
        counts = {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", summary[-1][0])}
    return counts, failed


def pytest_part(ctx: Context, part: Part, selection: list) -> None:
    result = ctx.run(part, [ctx.python, "-m", "pytest", "-v", "-p", "no:cacheprovider", *selection])
    counts, failed = pytest_counts(result.output)
    part.figures.update(counts=counts, failed_tests=failed[:50])
    count_text = ", ".join(f"{n} {word}" for word, n in counts.items()) or "no test counted"
    if result.timed_out:
        part.status = "FAIL"
        part.detail = f"killed at its time limit after {result.seconds:.0f} s ({count_text} by then)"
    elif result.returncode == 0:
        part.status, part.detail = "PASS", count_text
    elif result.returncode == 5:
        part.status, part.detail = "FAIL", f"no test selected ({shlex.join(selection)})"
    else:
        part.status = "FAIL"
        part.detail = f"exit {result.returncode}: {count_text}" + (f"; failed: {', '.join(failed[:8])}" if failed
                                                                   else f"; {result.tail(3)}")
    if result.left_behind:
        part.detail += f"; {result.left_behind} processes left behind, killed"


def part_suite(ctx: Context, part: Part) -> None:
    workers = ctx.args.workers if ctx.args.workers is not None else (os.cpu_count() or 1)
    if ctx.args.suite_args:
        selection = shlex.split(ctx.args.suite_args)
    else:
        selection = ["tests", "-m", "not cuda"]
        if shutil.which("slurmctld") is None:  # its fixture installs SLURM with apt-get: a network
            selection += ["--ignore", "tests/e2e/test_slurm.py"]
            part.figures["left_out"] = ("tests/e2e/test_slurm.py: no slurmctld here, and the test installs SLURM "
                                        "with apt-get, which needs a network")
    part.figures["workers"] = workers
    pytest_part(ctx, part, ["-n", str(workers), *(["--dist", "loadfile"] if workers else []), *selection])


def part_selfcheck(ctx: Context, part: Part) -> None:
    out = ctx.work / "selfcheck.json"
    step_timeout = max(20, int(ctx.left()) - 15)
    result = ctx.run(part, [ctx.python, str(REPO / "scripts" / "gpu_selfcheck.py"), "--json", str(out),
                            "--step-timeout", str(step_timeout)])
    steps = []
    if out.exists():
        data = json.loads(out.read_text(encoding="utf-8"))
        steps = data["ranks"][0] if data.get("ranks") else []
    part.figures["steps"] = steps
    failed = [s["step"] for s in steps if s["status"] == "FAIL"]
    verdicts = ", ".join(f"{s['step']} {s['status']}" for s in steps)
    probe = next((s["detail"] for s in steps if s["step"] == "queue-serialization"), "")
    if result.timed_out:
        part.status, part.detail = "FAIL", f"killed at its time limit after {result.seconds:.0f} s ({verdicts})"
    elif result.returncode != 0 or failed or not steps:
        part.status = "FAIL"
        part.detail = (f"failed: {', '.join(failed)} ({verdicts})" if failed
                       else f"exit {result.returncode}, no results: {result.tail(3)}")
    else:
        part.status, part.detail = "PASS", f"{verdicts}; queue-serialization: {probe}"


def part_cuda_tests(ctx: Context, part: Part) -> None:
    pytest_part(ctx, part, ["-n", "0", "-m", "cuda", "tests"])


def part_split_cost(ctx: Context, part: Part) -> None:
    lines, failed = [], []
    for dtype in ("fp32", "bf16"):
        out = ctx.work / f"split_cost_{dtype}.json"
        command = [ctx.python, str(REPO / "scripts" / "split_cost.py"), "--device", "cuda", "--json", str(out)]
        result = ctx.run(part, command + (["--bf16"] if dtype == "bf16" else []))
        if result.timed_out:
            part.status, part.detail = "FAIL", f"{dtype}: killed at the part's time limit after {result.seconds:.0f} s"
            return
        figures = json.loads(out.read_text(encoding="utf-8")) if out.exists() else None
        if figures:
            part.figures[dtype] = figures
            ms = figures["median_ms"]
            unsplit, split = ms["F"] + ms["B"], ms["F'"] + ms["B'"] + ms["W"]
            peak = max((figures.get("peak_mib") or {}).values(), default=0.0)
            lines.append(f"{dtype}: F+B {unsplit:.2f} ms, F+B'+W {split:.2f} ms ({100 * (split / unsplit - 1):+.1f}%), "
                         f"peak {peak:.0f} MiB, stash {figures['stash_mib']:.0f} MiB, "
                         f"grads {figures['max_rel_grad_diff']:.1e} (tol {figures['tolerance']:.0e})")
        if result.returncode != 0:
            failed.append(f"{dtype} exit {result.returncode}: {result.tail(2)}")
    part.status = "FAIL" if failed else "PASS"
    part.detail = "; ".join(failed + lines)


def part_demo(ctx: Context, part: Part) -> None:
    cli = [ctx.python, "-m", "megatron_rrfp"]
    cpu = ctx.run(part, [*cli, "demo", "--out", str(ctx.work / "demo-cpu"), "--json", str(ctx.work / "demo-cpu.json")])
    subs = {"cpu-default": "PASS" if cpu.returncode == 0 else "FAIL"}
    notes = [f"demo (CUDA visible, CPU default): {'exit 0' if cpu.returncode == 0 else 'FAIL: ' + cpu.tail(3)} "
             f"in {cpu.seconds:.0f} s"]

    def finish() -> None:
        part.figures["sub_checks"] = subs
        part.status = "FAIL" if "FAIL" in subs.values() else "PASS"
        part.detail = "; ".join(notes)

    if cpu.timed_out:
        subs["cpu-default"] = "FAIL"
        notes[0] = f"demo (CPU default): killed at the part's time limit after {cpu.seconds:.0f} s"
        return finish()
    helped = ctx.run(part, [*cli, "demo", "--help"])
    if "--device" not in helped.output:
        subs["cuda"] = "SKIP"
        notes.append("demo --device cuda: SKIP: this tree's demo has no --device option")
        return finish()
    too_many = max(2, ctx.gpus + 1)  # the refusal is checked without a GPU too: it must name 0
    refused = ctx.run(part, [*cli, "demo", "--device", "cuda", "--pp", str(too_many)])
    lines = [line for line in refused.output.splitlines() if line.strip()]
    naming = [line for line in lines if re.search(rf"(?<!\d){ctx.gpus}(?!\d)", line) and "GPU" in line.upper()]
    if refused.returncode not in (0, None) and naming and not refused.timed_out:
        subs["cuda-refusal"] = "PASS"
        notes.append(f"demo --device cuda --pp {too_many} on {ctx.gpus} GPU(s) refused: {naming[-1].strip()}")
    else:
        subs["cuda-refusal"] = "FAIL"
        notes.append(f"demo --device cuda --pp {too_many} on {ctx.gpus} GPU(s): exit {refused.returncode}, no line "
                     f"naming the count: {refused.tail(2)}")
    pp = 2 if ctx.gpus >= 2 else 1
    if ctx.gpus == 0:
        subs["cuda-run"] = "SKIP"
        notes.append("demo --device cuda: SKIP: no CUDA device is visible")
        return finish()
    if ctx.left() < MIN_START_S:
        subs["cuda-run"] = "SKIP"
        notes.append(f"demo --device cuda --pp {pp}: SKIP: {ctx.left():.0f} s left of the part's time")
        return finish()
    run = ctx.run(part, [*cli, "demo", "--device", "cuda", "--pp", str(pp), "--out", str(ctx.work / "demo-cuda"),
                         "--json", str(ctx.work / "demo-cuda.json")])
    said = [line for line in run.output.splitlines() if line.strip()]
    if run.returncode == 0:
        subs["cuda-run"] = "PASS"
        notes.append(f"demo --device cuda --pp {pp}: exit 0 in {run.seconds:.0f} s")
    elif pp == 1 and run.returncode == 2 and not run.timed_out:
        subs["cuda-run"] = "SKIP"
        notes.append(f"demo --device cuda --pp 1: SKIP: refused ({said[-1].strip() if said else 'no message'})")
    else:
        subs["cuda-run"] = "FAIL"
        notes.append(f"demo --device cuda --pp {pp}: " + (f"killed after {run.seconds:.0f} s" if run.timed_out
                                                          else f"exit {run.returncode}: {run.tail(3)}"))
    finish()


def part_task_times(ctx: Context, part: Part) -> None:
    out = Path(ctx.args.out) / "task_times.json"
    command = [ctx.python, str(REPO / "scripts" / "measure_task_times.py"), "--device", "cuda", "--out", str(out),
               *shlex.split(ctx.args.task_times_args or "")]
    result = ctx.run(part, command)
    if result.timed_out:
        part.status, part.detail = "FAIL", f"killed at its time limit after {result.seconds:.0f} s"
    elif result.returncode != 0:
        part.status, part.detail = "FAIL", f"exit {result.returncode}: {result.tail(3)}"
    else:
        try:
            data = json.loads(out.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            part.status, part.detail = "FAIL", f"exit 0 but {out.name} is not JSON: {exc}"
            return
        part.figures["file"] = str(out)
        part.figures["keys"] = sorted(data)[:20] if isinstance(data, dict) else type(data).__name__
        part.status, part.detail = "PASS", f"{out.name} written ({out.stat().st_size} bytes) in {result.seconds:.0f} s"


PART_FUNCTIONS: dict[str, Callable[[Context, Part], None]] = {
    "a": part_suite, "b": part_selfcheck, "c": part_cuda_tests, "d": part_split_cost, "e": part_demo,
    "f": part_task_times}


def skip_reason(ctx: Context, key: str) -> str:
    """Why a part cannot run on this machine ('' if it can): a GPU part without a GPU, a missing script."""
    if key == "f" and not (REPO / "scripts" / "measure_task_times.py").exists():
        return "scripts/measure_task_times.py is not in this tree"
    if key in GPU_PARTS and ctx.gpus == 0:
        return (f"no CUDA device is visible (torch {ctx.env.get('torch', '?')}, built with CUDA "
                f"{ctx.env.get('cuda_build')}): this part needs one GPU")
    return ""


# --------------------------------------------------------------------------- prerequisites

def carried_wheels(folder: Path) -> dict[str, tuple[str, Path, str]]:
    """{distribution (normalised): (version, file, python tag)} of the wheels in ``folder``."""
    found = {}
    for wheel in sorted(folder.glob("*.whl")) if folder.is_dir() else []:
        parts = wheel.name[:-4].split("-")
        found[re.sub(r"[-_.]+", "-", parts[0]).lower()] = (parts[1], wheel, parts[-3] if len(parts) >= 5 else "")
    return found


def probe_environment(python: str, carried: dict, env: dict, gpus: bool) -> dict:
    try:
        wheels = {d: (v, tag, d in UNDER_TEST) for d, (v, _, tag) in carried.items()}
        out = subprocess.run([python, "-c", ENV_PROBE, json.dumps(wheels),
                              "gpus" if gpus else "-"],
                             capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"probe_error": f"{type(exc).__name__}: {exc}", "modules": {}, "carried": {}, "gpus": 0}
    if out.returncode != 0 or not out.stdout.strip():
        return {"probe_error": (out.stderr.strip() or out.stdout.strip())[-400:], "modules": {}, "carried": {},
                "gpus": 0}
    return json.loads(out.stdout.strip().splitlines()[-1])


def refusals(info: dict, parts: list, args, python: str, wheels: Optional[dict]) -> list[str]:
    """One line per missing prerequisite of the chosen parts."""
    if "probe_error" in info:
        return [f"{python} could not be run to look at its packages: {info['probe_error']}"]
    modules, lines = info["modules"], []
    folder = f"{args.wheels}/ (python3 scripts/device_check.py --prepare-wheels, where PyPI is reachable)"
    if not modules.get("torch") or "torch_error" in info:
        lines.append(f"torch is not importable by {python} ({info.get('torch_error', 'not installed')}): "
                     "every part needs it; run with the interpreter that holds PyTorch (--python)")
    if wheels and wheels.get("returncode"):
        lines.append(f"pip could not install the carried wheels (exit {wheels['returncode']}): {wheels.get('error')}")
    elif not modules.get("megatron.core"):
        lines.append(f"megatron-core is not importable by {python}, and no megatron_core wheel is in {folder}")
    if {"a", "c"} & set(parts) and not modules.get("pytest"):
        lines.append(f"parts {','.join(p for p in parts if p in 'ac')} need pytest, not importable by {python}: "
                     f"install it or carry its wheel in {args.wheels}/")
    if "a" in parts and not modules.get("xdist"):
        lines.append(f"part a (the suite over the machine's cores) needs pytest-xdist, not importable by {python}: "
                     f"install it or carry its wheel in {args.wheels}/")
    if args.require_gpu and not info.get("gpus"):
        lines.append(f"--require-gpu: no CUDA device is visible to {python} (torch {info.get('torch')}, "
                     f"CUDA build {info.get('cuda_build')})")
    return lines


def install_wheels(runner: Runner, python: str, carried: dict, info: dict, site: Path, timeout: float) -> dict:
    """pip-installs (no index, no deps) the carried wheels the interpreter lacks (or has older,
    but for the packages under test: a megatron-core already there is the one checked)."""
    wanted = [carried[d][1] for d, state in info.get("carried", {}).items() if state["install"]]
    record = {"folder_wheels": len(carried), "installed": [w.name for w in wanted], "site": str(site)}
    if not wanted:
        return record
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    result = runner.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                         "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wanted)],
                        timeout=timeout, tag="wheels")
    record.update(seconds=result.seconds, returncode=result.returncode)
    if result.returncode != 0:
        record["error"] = result.tail(4)
    return record


def prepare_wheels(folder: Path) -> int:
    """Downloads WHEELS for the GPU image (CPython 3.12, x86-64 manylinux) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
               "3.12", "--implementation", "cp", *(a for p in WHEEL_PLATFORMS for a in ("--platform", p)),
               "-d", str(folder), *(f"{name}=={version}" for name, version in WHEELS)]
    print("$", shlex.join(command), flush=True)
    if subprocess.run(command).returncode != 0:
        print("device_check: pip download failed (above); nothing else was changed", file=sys.stderr)
        return 1
    wanted = {re.sub(r"[-_.]+", "-", n).lower() for n, _ in WHEELS}
    have = carried_wheels(folder)
    stale = [path for dist, (_, path, _) in have.items() if dist not in wanted]
    versions = {re.sub(r"[-_.]+", "-", n).lower(): v for n, v in WHEELS}
    stale += [path for dist, (version, path, _) in have.items() if dist in versions and version != versions[dist]]
    if stale:
        print(f"device_check: {folder} also holds {', '.join(p.name for p in stale)}: remove them (two versions of "
              "one package stop pip's install there)", file=sys.stderr)
    wheels_mib = sum(p.stat().st_size for p in folder.glob("*.whl")) / 2**20
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True).stdout.split(b"\0")
    tree_mib = sum((REPO / f.decode()).stat().st_size for f in tracked if f and (REPO / f.decode()).is_file()) / 2**20
    print(f"device_check: {len(have)} wheels, {wheels_mib:.1f} MiB in {folder}; with the tracked tree "
          f"({tree_mib:.1f} MiB): {wheels_mib + tree_mib:.1f} MiB of the {TRAVEL_LIMIT_MIB} MiB that travel")
    return 1 if stale or wheels_mib + tree_mib > TRAVEL_LIMIT_MIB else 0


# --------------------------------------------------------------------------- main

def parse_budgets(text: str, parser) -> dict:
    budgets = dict(DEFAULT_BUDGET_S)
    for item in filter(None, (text or "").split(",")):
        key, _, value = item.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if key not in PARTS or seconds <= 0:
            parser.error(f"--budget: {item!r} is not PART=SECONDS with PART one of {','.join(PARTS)} and SECONDS > 0")
        budgets[key] = seconds
    return budgets


def main(argv=None) -> int:
    started = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for device_check.json / .log "
                                                                      "(default: $OUT)")
    parser.add_argument("--parts", default=DEFAULT_ORDER, help=f"which parts, in this order (default {DEFAULT_ORDER})")
    parser.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S,
                        help="seconds from start after which no part runs (default %(default)s)")
    defaults = ",".join(f"{k}={v}" for k, v in DEFAULT_BUDGET_S.items())
    parser.add_argument("--budget", default="", help=f"PART=SECONDS,... each part's own limit (default {defaults})")
    parser.add_argument("--wheels", default="wheels", help="folder of carried wheels, relative to the repository "
                                                           "(default %(default)s)")
    parser.add_argument("--site", default=os.path.join(tempfile.gettempdir(), "rrfp-device-check-site"),
                        help="where the carried wheels are installed (default %(default)s)")
    parser.add_argument("--python", default=sys.executable, help="the parts' interpreter (default: this one)")
    parser.add_argument("--workers", type=int, default=None, help="part a's xdist workers (default: every core)")
    parser.add_argument("--suite-args", default="", help="part a: these pytest arguments instead of the whole suite")
    parser.add_argument("--task-times-args", default="", help="part f: more arguments for measure_task_times.py")
    parser.add_argument("--require-gpu", action="store_true", help="refuse to run without a visible CUDA device")
    parser.add_argument("--prepare-wheels", action="store_true", help="download the wheels to carry into --wheels, "
                                                                      "then stop (needs PyPI)")
    args = parser.parse_args(argv)
    wheels = Path(args.wheels) if os.path.isabs(args.wheels) else REPO / args.wheels
    if args.prepare_wheels:
        return prepare_wheels(wheels)
    if not args.out:
        parser.error("--out: no folder given and $OUT is unset; name the folder for device_check.json and .log")
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or len(set(parts)) != len(parts):
        parser.error(f"--parts: {args.parts!r}: each of {','.join(PARTS)} at most once "
                     f"({', '.join(f'{k} {v}' for k, v in PARTS.items())})")
    if args.deadline <= 0 or (args.workers is not None and args.workers < 0):
        parser.error("--deadline must be > 0 and --workers >= 0")
    budgets = parse_budgets(args.budget, parser)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rrfp-device-check-"))
    run_id = uuid.uuid4().hex[:12]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    report = {"schema": "rrfp-device-check/1", "command": [sys.argv[0], *(argv if argv is not None else sys.argv[1:])],
              "started_utc": utc_now(), "deadline_s": args.deadline, "budgets_s": {p: budgets[p] for p in parts},
              "run_id": run_id, "work": str(work), "cpus": os.cpu_count(), "status": "RUNNING",
              "parts": [asdict(Part(p, PARTS[p], detail="not started")) for p in parts]}
    json_path, log_path = out / "device_check.json", out / "device_check.log"

    def save() -> None:
        report["seconds"] = round(time.monotonic() - started, 2)
        tmp = json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=1), encoding="utf-8")
        tmp.replace(json_path)

    def say(text: str) -> None:
        print(f"device_check: {text}", flush=True)
        runner.write(f"device_check: {text}\n")

    with open(log_path, "w", encoding="utf-8") as log:
        runner = Runner(log, env, REPO)
        runner.write(f"device_check {shlex.join(report['command'])} at {report['started_utc']}; work folder {work}\n")

        def interrupted(signum, _frame):
            raise KeyboardInterrupt(f"signal {signum}")

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, interrupted)
        try:
            carried = carried_wheels(wheels)
            look = args.require_gpu or bool(set(parts) & (GPU_PARTS | {"e"}))
            info = probe_environment(args.python, carried, env, look)
            if any(state["install"] for state in info.get("carried", {}).values()):
                report["wheels"] = install_wheels(runner, args.python, carried, info, Path(args.site),
                                                  timeout=max(30.0, args.deadline / 3))
                env["PYTHONPATH"] = os.pathsep.join([args.site, env["PYTHONPATH"]])
                info = probe_environment(args.python, carried, env, look)
            report["environment"] = info
            refused = refusals(info, parts, args, args.python, report.get("wheels"))
            if refused:
                report["status"], report["refused"] = "REFUSED", refused
                for part in report["parts"]:
                    part["detail"] = "refused: a prerequisite is missing (see 'refused')"
                for line in refused:
                    say(f"refused: {line}")
                save()
                return 2
            gpus = (f"CUDA {info.get('cuda_build')}, NCCL {info.get('nccl')}, {info['gpus']} GPU(s) "
                    f"{info.get('gpu_names')}" if info.get("gpus") is not None else info.get("gpu_note"))
            say(f"torch {info.get('torch')} ({gpus}), megatron-core {info['versions'].get('megatron-core')}, "
                f"{os.cpu_count()} cores; parts {','.join(parts)}")
            ctx = Context(args, runner, info, work, run_id)
            deadline = started + args.deadline
            for index, key in enumerate(parts):
                part = Part(key, PARTS[key], budget_s=budgets[key], tag=f"{run_id}-{key}")
                reason = skip_reason(ctx, key)
                left = deadline - time.monotonic()
                if not reason and left < MIN_START_S:
                    reason = f"not started: {max(left, 0):.0f} s left before the {args.deadline:g} s deadline"
                if reason:
                    part.status, part.detail = "SKIP", reason
                else:
                    part.budget_s = round(min(budgets[key], left), 1)
                    begin = time.monotonic()
                    ctx.part_end = begin + part.budget_s
                    try:
                        PART_FUNCTIONS[key](ctx, part)
                    except KeyboardInterrupt:
                        runner.stop_current()
                        part.status, part.detail = "FAIL", "interrupted (the check was stopped)"
                        raise
                    except Exception as exc:  # noqa: BLE001 - a part's own error is its FAIL, the rest go on
                        runner.stop_current()
                        part.status, part.detail = "FAIL", f"the check itself failed: {type(exc).__name__}: {exc}"
                    finally:
                        part.seconds = round(time.monotonic() - begin, 2)
                        report["parts"][index] = asdict(part)
                        save()
                report["parts"][index] = asdict(part)
                say(f"{key} {part.name}: {part.status} in {part.seconds:.1f} s: {part.detail}")
                save()
        except KeyboardInterrupt as exc:
            runner.stop_current()
            report["status"] = "FAIL"
            report["interrupted"] = str(exc)
            say(f"stopped ({exc}): the parts so far are in {json_path}")
            save()
            return 1
        statuses = [p["status"] for p in report["parts"]]
        report["status"] = "FAIL" if "FAIL" in statuses else "PASS"
        report["finished_utc"] = utc_now()
        save()
        try:
            work.rmdir()  # nothing was written there
        except OSError:
            pass
        say(f"{report['status']}: " + ", ".join(f"{p['part']} {p['status']} {p['seconds']:.0f} s"
                                              for p in report["parts"])
            + f"; {report['seconds']:.0f} s in all; {json_path}, {log_path}")
    return 1 if report["status"] == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())
