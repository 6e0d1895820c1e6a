#!/usr/bin/env python3
"""Run the version-sensitive tests against every supported megatron-core minor; print a table.

    python scripts/version_matrix.py                      # 0.15 - 0.19, every group
    python scripts/version_matrix.py --minors 0.17,0.18 --groups equivalence,wgrad

Each minor's newest release is installed with ``pip install --no-deps --target
ROOT/mcore-<minor> 'megatron-core~=<minor>.0'`` (once; reused while its version stays) by the
interpreter of its Python (0.15 / 0.16: 3.11, 0.17 - 0.19: 3.12, each a venv with torch and
megatron-rrfp's other dependencies), and put first on PYTHONPATH after this checkout, so
that venv's torch runs that megatron-core. A minor whose release is the venv's own
installed one runs without a target. Each group is one pytest run (``--junitxml``);
a cell reads passed / failed / skipped counts; ``--json`` keeps them with the logs' paths.
Needs pip's access to the package index for minors not yet installed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MINORS = ("0.15", "0.16", "0.17", "0.18", "0.19")
PYTHON_OF = {"0.15": "3.11", "0.16": "3.11", "0.17": "3.12", "0.18": "3.12", "0.19": "3.12"}
DEFAULT_PYTHONS = {"3.11": "/work/venv311/bin/python", "3.12": "/work/venv312/bin/python"}
GROUPS = {  # name: test ids (what depends on megatron-core's version)
    "equivalence": ["tests/distributed/test_executor.py::test_pp4_gpt_and_mlp",
                    "tests/distributed/test_executor.py::test_tp2_pp2_with_one_tp_rank_seeing_messages_late"],
    "interleaved": ["tests/distributed/test_interleaved.py::test_interleaved_chunks_match_megatron[pp2-gpt-2chunks]"],
    "wgrad": ["tests/distributed/test_wgrad.py"],
    "hookpoints": ["tests/e2e/test_integration.py::test_routing_pp2_returns_rrfp_and_1f1b_or_uninstall_restore",
                   "tests/e2e/test_integration.py::test_schedule_pg_collection_keyword_of_0_19_decides_the_pipeline_size",
                   "tests/e2e/test_integration.py::test_real_megatron_training_binds_the_routed_lookup",
                   "tests/unit/test_megatron_lm_hooks.py::test_real_megatron_training_calls_the_wrapped_names_through_"
                   "module_globals"],
    "hybrid": ["tests/distributed/test_hybrid.py"],
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minors", default=",".join(MINORS),
                   help="comma list of megatron-core minors (default: %(default)s)")
    p.add_argument("--groups", default=",".join(GROUPS), help="comma list of test groups (default: %(default)s)")
    p.add_argument("--python", action="append", default=[], metavar="VERSION=PATH",
                   help="the interpreter (a venv with torch) for a Python version; default "
                        + ", ".join(f"{k}={v}" for k, v in DEFAULT_PYTHONS.items()))
    p.add_argument("--target-root", default="/work",
                   help="each minor is pip-installed into TARGET_ROOT/mcore-<minor> (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per pytest run (default: %(default)s)")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)
    args.minors = [m.strip() for m in args.minors.split(",") if m.strip()]
    args.groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    for minor in args.minors:
        if minor not in PYTHON_OF:
            p.error(f"--minors: {minor!r} is not a supported minor ({', '.join(MINORS)})")
    for group in args.groups:
        if group not in GROUPS:
            p.error(f"--groups: unknown {group!r}; choose from {', '.join(GROUPS)}")
    args.pythons = dict(DEFAULT_PYTHONS)
    for item in args.python:
        version, sep, path = item.partition("=")
        if not sep or version not in DEFAULT_PYTHONS:
            p.error(f"--python {item!r}: give VERSION=PATH with VERSION one of {', '.join(DEFAULT_PYTHONS)}")
        args.pythons[version] = path
    return args


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


def installed_version(python: str, pythonpath: str = "") -> str:
    """megatron-core's version as ``python`` sees it with ``pythonpath`` first."""
    code = "from importlib.metadata import version; print(version('megatron-core'))"
    env = {**os.environ, "PYTHONPATH": pythonpath}
    result = _run([python, "-c", code], env=env, timeout=120)
    return result.stdout.strip() if result.returncode == 0 else ""


def prepare(minor: str, python: str, root: Path) -> tuple[str, str, str]:
    """(version, target dir or '', error): the venv's own release when it is this minor, else a
    --target install of the minor's newest release."""
    own = installed_version(python)
    if own.startswith(minor + "."):
        return own, "", ""
    target = root / f"mcore-{minor}"
    version = installed_version(python, str(target)) if target.is_dir() else ""
    if version.startswith(minor + "."):
        return version, str(target), ""
    result = _run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade", "--target", str(target),
                   f"megatron-core~={minor}.0"], timeout=1800)
    version = installed_version(python, str(target))
    if result.returncode != 0 or not version.startswith(minor + "."):
        return "", "", f"pip install megatron-core~={minor}.0 failed: {(result.stderr or result.stdout)[-400:]}"
    return version, str(target), ""


def run_group(python: str, target: str, tests: list[str], timeout: float, log_dir: Path, name: str) -> dict:
    """One pytest run; counts from its JUnit XML."""
    xml, log = log_dir / f"{name}.xml", log_dir / f"{name}.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), target) if p)}
    env.pop("MEGATRON_LM", None)  # the Megatron-LM end-to-end runs are not part of the matrix
    start = time.monotonic()
    try:
        result = _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *tests],
                      cwd=REPO, env=env, timeout=timeout)
        log.write_text(result.stdout + result.stderr)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:g} s", "log": str(log)}
    counts = {"passed": 0, "failed": 0, "skipped": 0, "seconds": round(time.monotonic() - start, 1), "log": str(log)}
    if not xml.is_file():
        return {**counts, "error": f"pytest exit {result.returncode}, no report"}
    failed_ids = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        key = {"failure": "failed", "error": "failed"}.get(outcome, outcome)
        counts[key] += 1
        if key == "failed":
            failed_ids.append(case.get("name"))
    counts["failed_ids"] = failed_ids
    return counts


def cell(result: dict) -> str:
    if "error" in result and not result.get("passed"):
        return "ERROR"
    parts = [f"{result[k]} {k}" for k in ("passed", "failed", "skipped") if result.get(k)]
    return ", ".join(parts) or "none"


def main(argv=None) -> int:
    args = parse_args(argv)
    root = Path(args.target_root)
    root.mkdir(parents=True, exist_ok=True)
    log_root = Path(tempfile.mkdtemp(prefix="rrfp-version-matrix-"))
    rows = []
    for minor in args.minors:
        python = args.pythons[PYTHON_OF[minor]]
        version, target, error = prepare(minor, python, root)
        row = {"minor": minor, "python": PYTHON_OF[minor], "version": version, "target": target, "groups": {}}
        if error:
            row["error"] = error
            print(f"{minor}: {error}", file=sys.stderr, flush=True)
        else:
            for group in args.groups:
                log_dir = log_root / minor
                log_dir.mkdir(exist_ok=True)
                row["groups"][group] = run_group(python, target, GROUPS[group], args.timeout, log_dir, group)
                print(f"{minor} ({version}) {group}: {cell(row['groups'][group])}", file=sys.stderr, flush=True)
        rows.append(row)
    widths = [max(len(g), 22) for g in args.groups]
    print("| megatron-core | Python | " + " | ".join(g.ljust(w) for g, w in zip(args.groups, widths)) + " |")
    print("|---------------|--------|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        cells = [row.get("error", "")[:w].ljust(w) if "error" in row else cell(row["groups"][g]).ljust(w)
                 for g, w in zip(args.groups, widths)]
        print(f"| {(row['version'] or row['minor']):<13} | {row['python']:<6} | " + " | ".join(cells) + " |")
    failures = [(row["minor"], group, result.get("failed_ids") or result.get("error"))
                for row in rows for group, result in row["groups"].items() if result.get("failed") or "error" in result]
    for minor, group, what in failures:
        print(f"{minor} {group}: {what}  (log: {log_root / minor / (group + '.log')})")
    print(f"logs: {log_root}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 1 if failures or any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
