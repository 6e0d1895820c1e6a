"""Megatron-LM's unmodified entry scripts through ``python -m megatron_rrfp.launch --cpu``:
copy a source tree, launch a script with torchrun, read back what it logged.

Shared by tests/e2e/test_megatron_lm_e2e.py and scripts/pretrain_vlm_rrfp_matrix.py. A tree is
copied first because Megatron builds its dataset helpers inside it at start-up, with the
Makefile's ``python3`` / ``python3-config``: the interpreter's bin goes first on PATH and,
under pyenv, ``PYENV_VERSION`` defaults to this interpreter's version (the trees carry a
``.python-version`` that would pick another).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

COMMON = ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
          "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3",
          "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "constant", "--clip-grad", "0",
          "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024", "--mock-data", "--split", "98,2,0",
          "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--transformer-impl", "local",
          "--use-cpu-initialization", "--distributed-backend", "gloo", "--no-persist-layer-norm",
          "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
          "--no-rope-fusion", "--no-gradient-accumulation-fusion", "--attention-dropout", "0", "--hidden-dropout", "0",
          "--seed", "1234"]
# pretrain_vlm.py (LLaVAModel: CLIP ViT + MLP projection on stage 0, GPT decoder): a 28x28
# image in 14x14 patches is 4 patches + the class token = 5 image tokens spliced into each
# 64-token text sample (decoder sequence 69, padded to --decoder-seq-length). The ViT gets
# --num-layers too (Megatron-LM sets encoder_num_layers from it). --clip-grad 1: the grad
# norm is computed (and logged) only when clipping is on.
VLM = ["--img-h", "28", "--img-w", "28", "--patch-dim", "14", "--decoder-seq-length", "128",
       "--max-position-embeddings", "128", "--ckpt-format", "torch", "--clip-grad", "1.0"]
# not anchored: another rank's memory report can end on the same line (no newline between them)
LOSS = re.compile(r"\[[^\]]+\] iteration\s+(\d+)/\s*\d+ \|[^\n]*? lm loss: (\S+) \|")


def release(tree: str) -> tuple[int, int]:
    text = (Path(tree) / "megatron" / "core" / "package_info.py").read_text()
    return tuple(int(re.search(rf"^{name} *= *(\d+)", text, re.MULTILINE).group(1)) for name in ("MAJOR", "MINOR"))


def copy_tree(source: str, into: Path) -> Path:
    """The parts of a Megatron-LM tree the entry scripts import, copied under ``into``."""
    copy = into / os.path.basename(source.rstrip("/"))
    shutil.copytree(Path(source) / "megatron", copy / "megatron")
    for script in Path(source).glob("*.py"):  # pretrain_*.py and their neighbours (gpt_builders.py, ...)
        shutil.copy(script, copy / script.name)
    return copy


def tensorboard_scalars(directory: Path, tag: str) -> dict[int, float]:
    """{step: value} of one scalar Megatron wrote with --tensorboard-dir (full float precision;
    stdout prints the grad norm to 3 decimals)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)} if tag in events.Tags()["scalars"] else {}


def pretrain(tree: Path, script: str, flags: list[str], schedule: list[str], cwd: Path, *, nproc: int = 4,
             python: str = sys.executable, timeout: float = 900, tensorboard: Optional[Path] = None,
             check: bool = True) -> dict:
    """Launch ``tree/script`` on CPU; {"loss": {iteration: lm loss}, "grad_norm": {...}, "log": text,
    "returncode": int}.

    Losses come from stdout (rank 0 of the last stage prints them to 7 digits); with
    ``tensorboard`` the grad norms (and full-precision losses) come from the event file.
    ``check=False``: a failed launch returns its log and exit code instead of failing the caller.
    """
    bin_dir = os.path.dirname(python)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    if "PYENV_VERSION" not in env:  # python3-config for the helpers, of this interpreter's version
        version = subprocess.run([python, "-c", "import sys; print('.'.join(map(str, sys.version_info[:3])))"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        env["PYENV_VERSION"] = version
    extra = ["--tensorboard-dir", str(tensorboard)] if tensorboard is not None else []
    command = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "megatron_rrfp.launch", "--cpu", str(tree / script), *COMMON, *flags, *extra, *schedule]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    log = result.stdout + result.stderr
    if not check and result.returncode != 0:
        return {"loss": {}, "grad_norm": {}, "log": log, "returncode": result.returncode}
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    losses = {int(m.group(1)): float(m.group(2)) for m in LOSS.finditer(result.stdout)}
    grad_norms = tensorboard_scalars(tensorboard, "grad-norm") if tensorboard is not None else {}
    if "rrfp" in schedule:
        assert "megatron-rrfp: pipeline schedule rrfp" in log, log[-6000:]
    return {"loss": losses, "grad_norm": grad_norms, "log": log, "returncode": result.returncode}
