#!/usr/bin/env python3
"""Megatron-LM's pretrain_vlm.py (LLaVAModel) under --pipeline-schedule rrfp vs 1f1b, on CPU.

    python scripts/pretrain_vlm_rrfp_matrix.py /work/mlm/core_v0.16.1 /work/mlm/core_v0.19.0
    python scripts/pretrain_vlm_rrfp_matrix.py --cases tp1-pp4,tp2-pp4 /work/mlm/core_v0.19.0

For each Megatron-LM tree and each TP x PP case (default PP2 and PP4 at TP1 and TP2), the
unmodified script runs twice through ``python -m megatron_rrfp.launch --cpu`` (RRFP's
default hint, the W split where the model allows; then Megatron's 1F1B) on a copy of the
tree, with the tiny LLaVA of tests/helpers/megatron_lm.py (28x28 images, 14x14 patches: 5
image tokens per sample; hidden 64, 4 layers in the ViT and in the decoder, 3 iterations).
Prints, per case, the largest relative difference of the logged losses and of the grad
norms (from the tensorboard event files) and whether both are within --rtol; exits 1 if
any case is not. A tree runs with the interpreter whose megatron-core has its minor
(--python MINOR=PATH; defaults: 0.16 /work/venv311, 0.19 /work/venv312).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from helpers.megatron_lm import VLM, copy_tree, pretrain, release  # noqa: E402

CASES = ("tp1-pp2", "tp2-pp2", "tp1-pp4", "tp2-pp4")
DEFAULT_PYTHONS = {"0.16": "/work/venv311/bin/python", "0.19": "/work/venv312/bin/python"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trees", nargs="+", help="Megatron-LM source trees (read only; each is copied first)")
    p.add_argument("--cases", default=",".join(CASES), help="comma list of tpT-ppP cases (default: %(default)s)")
    p.add_argument("--python", action="append", default=[], metavar="MINOR=PATH",
                   help="interpreter for a megatron-core minor; default "
                        + ", ".join(f"{k}={v}" for k, v in DEFAULT_PYTHONS.items()))
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch (default: %(default)s)")
    args = p.parse_args(argv)
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    for case in args.cases:
        tp, _, pp = case.partition("-")
        if not (tp.startswith("tp") and pp.startswith("pp") and tp[2:].isdigit() and pp[2:].isdigit()):
            p.error(f"--cases: {case!r} is not tpT-ppP (e.g. tp2-pp4)")
    pythons = dict(DEFAULT_PYTHONS)
    for item in args.python:
        minor, sep, path = item.partition("=")
        if not sep:
            p.error(f"--python {item!r}: expected MINOR=PATH, e.g. 0.19=/work/venv312/bin/python")
        pythons[minor] = path
    args.pythons = pythons
    for tree in args.trees:
        if not (Path(tree) / "pretrain_vlm.py").is_file():
            p.error(f"{tree}: no pretrain_vlm.py (expected a Megatron-LM source tree)")
        minor = ".".join(map(str, release(tree)))
        if minor not in pythons:
            p.error(f"{tree} is Megatron-LM {minor}: name its interpreter with --python {minor}=PATH")
    return args


def _installed_minor(python: str) -> str:
    code = "from importlib.metadata import version; print('.'.join(version('megatron-core').split('.')[:2]))"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def _max_rel(a: dict, b: dict) -> float:
    if sorted(a) != sorted(b) or not a:
        return float("inf")
    return max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-30) for k in b)


def main(argv=None) -> int:
    args = parse_args(argv)
    failed = 0
    print(f"{'tree':<14} {'case':<8} {'iters':>5} {'loss max rel':>13} {'gnorm max rel':>14} {'ok':>3} {'s':>6}  "
          "losses (rrfp)  grad norms (rrfp)", flush=True)
    with tempfile.TemporaryDirectory(prefix="rrfp-vlm-") as tmp:
        for source in args.trees:
            minor = ".".join(map(str, release(source)))
            python = args.pythons[minor]
            if _installed_minor(python) != minor:
                print(f"{source}: {python} has megatron-core {_installed_minor(python)}, not {minor}", flush=True)
                return 2
            tree = copy_tree(source, Path(tempfile.mkdtemp(dir=tmp)))
            for case in args.cases:
                tp, pp = (int(part[2:]) for part in case.split("-"))
                flags = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                         "--num-layers", "4", *VLM]
                cwd = Path(tempfile.mkdtemp(dir=tmp))
                start = time.monotonic()
                runs = {s: pretrain(tree, "pretrain_vlm.py", flags, ["--pipeline-schedule", s], cwd, nproc=tp * pp,
                                    python=python, timeout=args.timeout, tensorboard=cwd / s)
                        for s in ("rrfp", "1f1b")}
                loss_rel = _max_rel(runs["rrfp"]["loss"], runs["1f1b"]["loss"])
                norm_rel = _max_rel(runs["rrfp"]["grad_norm"], runs["1f1b"]["grad_norm"])
                split = "linears deferred to W" in runs["rrfp"]["log"]
                ok = loss_rel <= args.rtol and norm_rel <= args.rtol and split
                failed += not ok
                losses = " ".join(f"{v:.6f}" for _, v in sorted(runs["rrfp"]["loss"].items()))
                norms = " ".join(f"{v:.6f}" for _, v in sorted(runs["rrfp"]["grad_norm"].items()))
                print(f"{os.path.basename(source.rstrip('/')):<14} {case:<8} {len(runs['1f1b']['loss']):>5} "
                      f"{loss_rel:>13.2e} {norm_rel:>14.2e} {'yes' if ok else 'NO':>3} "
                      f"{time.monotonic() - start:>6.0f}  {losses}  {norms}{'' if split else '  (split inactive)'}",
                      flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
