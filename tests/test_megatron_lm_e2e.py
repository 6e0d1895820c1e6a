"""Megatron-LM's own entry scripts, unmodified, through ``python -m megatron_rrfp.launch --cpu``.

Fetches nothing: ``MEGATRON_LM`` names Megatron-LM source trees (os.pathsep-separated, e.g.
``/work/mlm/core_v0.16.1:/work/mlm/core_v0.19.0``); each tree whose release has the installed
megatron-core's minor runs, the others skip with the reason, and without ``MEGATRON_LM``
everything skips. A tree is copied to a temporary directory first (Megatron builds its
dataset helpers inside it at start-up, with the Makefile's ``python3`` / ``python3-config``:
the venv's bin goes first on PATH and, under pyenv, ``PYENV_VERSION`` defaults to this
interpreter's version). Ranks run from outside the checkout, 4 per launch (torchrun
``--standalone``), on CPU over gloo.

  pretrain_gpt.py     TP=2 x PP=2, RRFP's default hint vs Megatron's 1F1B: the same losses
  pretrain_hybrid.py  (0.18+) HybridModel with megatron_rrfp.mcore.hybrid_spec, TP=2 x PP=2
                      and PP=2 x 2 model chunks (four '|' segments: Megatron's interleaved
                      schedule); rrfp's losses equal Megatron's
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rrfp.mcore.compat import MEGATRON_CORE_VERSION, hybrid_model_unavailable

TREES = [t for t in os.environ.get("MEGATRON_LM", "").split(os.pathsep) if t]
COMMON = ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
          "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3",
          "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "constant", "--clip-grad", "0",
          "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024", "--mock-data", "--split", "98,2,0",
          "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--transformer-impl", "local",
          "--use-cpu-initialization", "--distributed-backend", "gloo", "--no-persist-layer-norm",
          "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
          "--no-rope-fusion", "--no-gradient-accumulation-fusion", "--attention-dropout", "0", "--hidden-dropout", "0",
          "--seed", "1234"]
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
HYBRID_SPEC = ["--spec", "megatron_rrfp.mcore.hybrid_spec", "hybrid_stack_spec"]
CASES = {  # id: (script, flags)
    "gpt-tp2-pp2": ("pretrain_gpt.py", [*TP2_PP2, "--num-layers", "2"]),
    "hybrid-tp2-pp2": ("pretrain_hybrid.py", [*TP2_PP2, "--hybrid-layer-pattern", "*-|*-", *HYBRID_SPEC]),
    "hybrid-pp2-2chunks": ("pretrain_hybrid.py", ["--pipeline-model-parallel-size", "2", "--hybrid-layer-pattern",
                                                  "*-|*-|*-|*-", *HYBRID_SPEC]),
}
# not anchored: another rank's memory report can end on the same line (no newline between them)
LOSS = re.compile(r"\[[^\]]+\] iteration\s+(\d+)/\s*\d+ \|[^\n]*? lm loss: (\S+) \|")
LAUNCH_TIMEOUT_S = 900


def _release(tree: str) -> tuple[int, int]:
    text = (Path(tree) / "megatron" / "core" / "package_info.py").read_text()
    return tuple(int(re.search(rf"^{name} *= *(\d+)", text, re.MULTILINE).group(1)) for name in ("MAJOR", "MINOR"))


@pytest.fixture(scope="module", params=TREES or [None], ids=[os.path.basename(t.rstrip("/")) for t in TREES] or
                ["no-tree"])
def tree(request, tmp_path_factory) -> Path:
    """A copy of one MEGATRON_LM tree whose release matches the installed megatron-core."""
    source = request.param
    if source is None:
        pytest.skip("set MEGATRON_LM to Megatron-LM source tree(s), e.g. MEGATRON_LM=/work/mlm/core_v0.16.1")
    release = _release(source)
    if release != MEGATRON_CORE_VERSION.release[:2]:
        pytest.skip(f"{source} is Megatron-LM {release[0]}.{release[1]}, but megatron-core {MEGATRON_CORE_VERSION} "
                    "is installed (a tree runs with its own minor)")
    copy = tmp_path_factory.mktemp("megatron-lm") / os.path.basename(source.rstrip("/"))
    shutil.copytree(Path(source) / "megatron", copy / "megatron")  # what the entry scripts import
    for script in Path(source).glob("*.py"):  # pretrain_*.py and their neighbours (gpt_builders.py, ...)
        shutil.copy(script, copy / script.name)
    return copy


def _pretrain(tree: Path, script: str, flags: list[str], schedule: list[str], cwd: Path) -> dict[int, float]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore",
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    env.setdefault("PYENV_VERSION", ".".join(map(str, sys.version_info[:3])))  # python3-config for the helpers
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               "-m", "megatron_rrfp.launch", "--cpu", str(tree / script), *flags, *COMMON, *schedule]
    result = subprocess.run(command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, cwd=cwd, env=env)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    losses = {int(m.group(1)): float(m.group(2)) for m in LOSS.finditer(result.stdout)}
    assert sorted(losses) == [1, 2, 3], result.stdout[-6000:]
    if "rrfp" in schedule:
        assert "megatron-rrfp: pipeline schedule rrfp" in result.stdout + result.stderr
    return losses


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", list(CASES))
def test_rrfp_default_gives_megatrons_losses(tree, case, tmp_path):
    script, flags = CASES[case]
    if script == "pretrain_hybrid.py" and (hybrid_model_unavailable() or not (tree / script).is_file()):
        pytest.skip(hybrid_model_unavailable() or f"{tree.name} has no {script}")
    rrfp = _pretrain(tree, script, flags, ["--pipeline-schedule", "rrfp"], tmp_path)
    reference = _pretrain(tree, script, flags, ["--pipeline-schedule", "1f1b"], tmp_path)
    print(f"{tree.name} {case}: rrfp {rrfp} 1f1b {reference}")  # the figures the docs quote (pytest -s)
    for iteration, loss in reference.items():
        assert rrfp[iteration] == pytest.approx(loss, rel=1e-5), (iteration, rrfp, reference)
