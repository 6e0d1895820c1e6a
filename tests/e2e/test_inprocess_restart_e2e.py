"""Megatron-LM's --inprocess-restart under --pipeline-schedule rrfp: pretrain_gpt.py on CPU, NVRx itself.

    MEGATRON_LM=/work/mlm/core_v0.16.1 NVRX_SITE=/path/to/site \
        python -m pytest -n 0 -s tests/e2e/test_inprocess_restart_e2e.py

``MEGATRON_LM``: Megatron-LM trees (``os.pathsep``-separated; the one whose minor is the installed
megatron-core's runs). ``NVRX_SITE``: a directory holding nvidia-resiliency-ext (put on the ranks'
PYTHONPATH; several joined with os.pathsep) when it is not installed: megatron-core 0.19 needs NVRx
>= 0.6, whose wheels pip installs
only on glibc >= 2.39 (docs/resilience.md). Skipped without either.

Rank 1 raises in its first forward step of iteration 4 (tests/helpers/inprocess_drill.py); the job
re-enters pretrain in the same processes, resumes from the checkpoint of iteration 2 and reaches
iteration 6 with exit code 0. Asserted: no thread, session or calibration of the failed world is
seen in the new one; the losses after the restart equal an uninterrupted run resumed from the same
checkpoint; the goodput ledger names the restart in-process and the checkpoint persistent. The same
on 4 ranks at PP2 x DP2 and TP2 x PP2, where the healthy ranks first have to leave a blocking gloo
collective of Megatron's (the launcher's sliced waits).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.megatron_lm import COMMON, LOSS, copy_tree, release
from megatron_rrfp.mcore import compat

TESTS = Path(__file__).resolve().parents[1]
TREES = [t for t in os.environ.get("MEGATRON_LM", "").split(os.pathsep) if t]
NVRX_SITE = os.environ.get("NVRX_SITE", "")
FLAGS = ["--num-layers", "2", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "rrfp",
         "--train-iters", "6", "--save-interval", "2", "--ckpt-format", "torch",
         "--inprocess-restart", "--inprocess-granularity", "rank"]


def _nvrx_importable() -> bool:
    code = "import nvidia_resiliency_ext.inprocess"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (NVRX_SITE, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, timeout=120).returncode == 0


def _tree() -> str:
    installed = (compat.MEGATRON_CORE_VERSION.major, compat.MEGATRON_CORE_VERSION.minor)
    for tree in TREES:
        if release(tree) == installed:
            return tree
    pytest.skip(f"no MEGATRON_LM tree of megatron-core {installed[0]}.{installed[1]} (given: {TREES})")


def _drill(tree: Path, cwd: Path, flags: list[str], fault_iteration: int, *, nproc: int = 2,
           rank: int = 1) -> tuple[int, str]:
    """pretrain_gpt.py through the drill on ``nproc`` ranks (``rank`` raises at ``fault_iteration``; 0: never)."""
    cwd.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    version = ".".join(map(str, sys.version_info[:3]))
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TORCH_CPP_LOG_LEVEL": "error",
           "PATH": os.path.dirname(python) + os.pathsep + os.environ.get("PATH", ""),
           "PYENV_VERSION": os.environ.get("PYENV_VERSION", version),
           "PYTHONPATH": os.pathsep.join(p for p in (NVRX_SITE, str(TESTS), os.environ.get("PYTHONPATH")) if p),
           "RRFP_DRILL_RANK": str(rank), "RRFP_DRILL_ITERATION": str(fault_iteration), "RRFP_DRILL_KIND": "raise"}
    command = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "helpers.inprocess_drill", "--cpu", str(tree / "pretrain_gpt.py"), *COMMON, *flags]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=cwd, env=env)
    return result.returncode, result.stdout + result.stderr


def _losses(log: str) -> dict[int, float]:
    """{iteration: lm loss}, the last one logged for each (an iteration redone after the restart)."""
    return {int(m.group(1)): float(m.group(2)) for m in LOSS.finditer(log)}


def _restarted_losses(log: str, ranks: int) -> dict[int, float]:
    """Every rank's new world holds nothing of the failed one's (session, calibrations, threads);
    the losses the restarted job logged, iterations 1-6."""
    worlds = re.findall(r"rrfp-drill: rank (\d) new world: old session open (\w+) \| calibrations carried (\d+) \| "
                        r"old rrfp threads alive \[(.*?)\]", log)
    assert sorted(w[0] for w in worlds) == [str(r) for r in range(ranks)], log[-4000:]
    assert all(w[1:] == ("False", "0", "") for w in worlds), worlds
    restarted = _losses(log)
    assert sorted(restarted) == [1, 2, 3, 4, 5, 6], restarted
    return restarted


def _resumed_uninterrupted(tmp_path: Path, run: Path, tree, flags: list[str], **drill) -> str:
    """The log of a job that resumes the run's checkpoint of iteration 2 and is not interrupted."""
    reference = tmp_path / "reference"
    (reference / "ckpt").mkdir(parents=True)
    shutil.copytree(run / "ckpt" / "iter_0000002", reference / "ckpt" / "iter_0000002")
    (reference / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2")
    code, ref_log = _drill(tree, reference, [*flags, "--load", "ckpt", "--save", "ckpt2"], 0, **drill)
    assert code == 0, ref_log[-8000:]
    return ref_log


@pytest.mark.timeout(1500)
@pytest.mark.skipif(not TREES, reason="MEGATRON_LM names no Megatron-LM tree")
def test_a_rank_that_raises_mid_iteration_restarts_in_process_and_matches_an_uninterrupted_resume(tmp_path):
    if not _nvrx_importable():
        pytest.skip("nvidia-resiliency-ext is not importable (install the 'resilience' extra or set NVRX_SITE)")
    tree = copy_tree(_tree(), tmp_path)
    run = tmp_path / "run"
    code, log = _drill(tree, run, [*FLAGS, "--save", "ckpt", "--load", "ckpt", "--rrfp-goodput-ledger", "job.db"], 4)
    assert code == 0, log[-8000:]
    assert "rrfp-drill: fault raise on rank 1 at iteration 4" in log, log[-4000:]
    assert "megatron-rrfp: --inprocess-restart:" in log  # the launcher's repairs, named once
    restarted = _restarted_losses(log, 2)

    # the same checkpoint (iteration 2), resumed by a job that is not interrupted
    ref_log = _resumed_uninterrupted(tmp_path, run, tree, FLAGS)
    expected = _losses(ref_log)
    assert sorted(expected) == [3, 4, 5, 6], expected
    print(f"\n{os.path.basename(_tree())}: after the in-process restart {[restarted[i] for i in range(3, 7)]}, "
          f"uninterrupted from the same checkpoint {[expected[i] for i in range(3, 7)]}")
    for it in range(3, 7):
        assert restarted[it] == pytest.approx(expected[it], rel=1e-5), (it, restarted, expected)

    report = subprocess.run([sys.executable, "-m", "megatron_rrfp", "goodput", str(run / "job.db"), "--json",
                             str(tmp_path / "goodput.json")], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    disruptions = json.loads((tmp_path / "goodput.json").read_text())["disruptions"]
    resumed = [d for d in disruptions if d["mechanism"] is not None]
    assert resumed and resumed[0]["mechanism"] == "in-process" and resumed[0]["checkpoint"] == "persistent", \
        disruptions
    assert resumed[0]["resumed_from"] == 2, disruptions


LAYOUTS = {"dp2": ([], 1), "tp2": (["--tensor-model-parallel-size", "2"], 3)}
"""4 ranks at PP2: DP2 (rank 1 raises; ranks 0 and 2 then wait in Megatron's gradient all-reduce), or
TP2 (rank 3 raises; its TP peer, rank 2, waits in the broadcast of get_batch_on_this_tp_rank)."""


@pytest.mark.timeout(1800)
@pytest.mark.skipif(not TREES, reason="MEGATRON_LM names no Megatron-LM tree")
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_ranks_waiting_in_megatrons_gloo_collectives_restart_too(tmp_path, layout):
    """The healthy ranks leave Megatron's blocking gloo collective (the launcher's sliced waits) and
    the job restarts in-process, as at PP2; losses after it equal an uninterrupted resume."""
    if not _nvrx_importable():
        pytest.skip("nvidia-resiliency-ext is not importable (install the 'resilience' extra or set NVRX_SITE)")
    extra, rank = LAYOUTS[layout]
    flags = [*FLAGS, *extra, "--num-workers", "0"]
    tree = copy_tree(_tree(), tmp_path)
    run = tmp_path / "run"
    code, log = _drill(tree, run, [*flags, "--save", "ckpt", "--load", "ckpt"], 4, nproc=4, rank=rank)
    assert code == 0, log[-8000:]
    assert f"rrfp-drill: fault raise on rank {rank} at iteration 4" in log, log[-4000:]
    assert "blocking gloo collectives wait in slices" in log, log[-4000:]
    restarted = _restarted_losses(log, 4)

    ref_log = _resumed_uninterrupted(tmp_path, run, tree, flags, nproc=4, rank=rank)
    expected = _losses(ref_log)
    print(f"\n{os.path.basename(_tree())} {layout}: after the in-process restart "
          f"{[restarted[i] for i in range(3, 7)]}, uninterrupted from the same checkpoint "
          f"{[expected.get(i) for i in range(3, 7)]}")
    for it in range(3, 7):
        assert restarted[it] == pytest.approx(expected[it], rel=1e-5), (it, restarted, expected)


@pytest.mark.timeout(1500)
@pytest.mark.skipif(not TREES, reason="MEGATRON_LM names no Megatron-LM tree")
def test_megatrons_own_1f1b_restarts_in_process_too(tmp_path):
    """The comparison run, ``--pipeline-schedule 1f1b`` under the same drill: rank 0 waits for rank 1 in a
    gloo receive of Megatron's p2p code (waited on a helper thread on a CPU run, so NVRx's asynchronous
    exception reaches it); the job restarts in-process and its losses equal an uninterrupted resume."""
    if not _nvrx_importable():
        pytest.skip("nvidia-resiliency-ext is not importable (install the 'resilience' extra or set NVRX_SITE)")
    flags = ["1f1b" if flag == "rrfp" else flag for flag in FLAGS] + ["--num-workers", "0"]
    tree = copy_tree(_tree(), tmp_path)
    run = tmp_path / "run"
    code, log = _drill(tree, run, [*flags, "--save", "ckpt", "--load", "ckpt"], 4)
    assert code == 0, log[-8000:]
    assert "rrfp-drill: fault raise on rank 1 at iteration 4" in log, log[-4000:]
    restarted = _losses(log)
    assert sorted(restarted) == [1, 2, 3, 4, 5, 6], (restarted, log[-4000:])
    expected = _losses(_resumed_uninterrupted(tmp_path, run, tree, flags))
    print(f"\n{os.path.basename(_tree())} 1f1b: after the in-process restart {[restarted[i] for i in range(3, 7)]}, "
          f"uninterrupted from the same checkpoint {[expected.get(i) for i in range(3, 7)]}")
    for it in range(3, 7):
        assert restarted[it] == pytest.approx(expected[it], rel=1e-5), (it, restarted, expected)
