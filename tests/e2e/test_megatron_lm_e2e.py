"""Megatron-LM's own entry scripts, unmodified, through ``python -m megatron_rrfp.launch --cpu``.

Fetches nothing: ``MEGATRON_LM`` names Megatron-LM source trees (os.pathsep-separated, e.g.
``/work/mlm/core_v0.16.1:/work/mlm/core_v0.19.0``); each tree whose release has the installed
megatron-core's minor runs, the others skip with the reason, and without ``MEGATRON_LM``
everything skips. A tree is copied to a temporary directory first (Megatron builds its
dataset helpers inside it at start-up, with the Makefile's ``python3`` / ``python3-config``:
the venv's bin goes first on PATH and, under pyenv, ``PYENV_VERSION`` defaults to this
interpreter's version). Ranks run from outside the checkout, 4 per launch (PP=2 alone: 2) (torchrun
``--standalone``), on CPU over gloo.

  pretrain_gpt.py     TP=2 x PP=2, RRFP's default hint vs Megatron's 1F1B: the same losses;
                      PP=2 x 2 model chunks x DP=2 with the production flags
                      (--overlap-grad-reduce --overlap-param-gather --use-distributed-optimizer):
                      losses and grad norms equal Megatron's interleaved schedule's, the split active
                      --pipeline-model-parallel-layout: PP=2 with 1 and 3 layers (Et|tttL), and PP=2 x 2
                      chunks of 0, 2, 1 and 1 layers (E|tt|t|tL; an embedding-only chunk), 2 ranks:
                      losses (and grad norms, the first) equal Megatron's (the second: refused at
                      start before megatron-core 0.19); --cuda-graph-impl full_iteration
                      (0.16.1: local with the full_iteration scope) exits at start with rrfp's one line
  pretrain_hybrid.py  (0.18+) HybridModel with megatron_rrfp.mcore.hybrid_spec, TP=2 x PP=2
                      and PP=2 x 2 model chunks (four '|' segments: Megatron's interleaved
                      schedule); rrfp's losses equal Megatron's
  pretrain_vlm.py     LLaVAModel (CLIP ViT + projection on stage 0, image tokens spliced into
                      the decoder's sequence), PP=2 (2 ranks): losses and grad norms (from the
                      tensorboard event file) equal 1F1B's, the split active
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from helpers.megatron_lm import VLM, copy_tree, pretrain, release
from megatron_rrfp.mcore.compat import MEGATRON_CORE_VERSION, hybrid_model_unavailable, interleaved_layout_unverified

TREES = [t for t in os.environ.get("MEGATRON_LM", "").split(os.pathsep) if t]
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
# Megatron-LM's production recipes' DP flags, interleaved; --clip-grad 1: the grad norm is logged
PRODUCTION = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2", "--num-layers", "4",
              "--overlap-grad-reduce", "--overlap-param-gather", "--use-distributed-optimizer", "--clip-grad", "1.0"]
HYBRID_SPEC = ["--spec", "megatron_rrfp.mcore.hybrid_spec", "hybrid_stack_spec"]
CASES = {  # id: (script, flags)
    "gpt-tp2-pp2": ("pretrain_gpt.py", [*TP2_PP2, "--num-layers", "2"]),
    "gpt-pp2-2chunks-dp2-overlap": ("pretrain_gpt.py", PRODUCTION),
    # the DP epoch rule forced on gloo (--rrfp-dp-overlap epochs, RRFP_RUNS), split on and off; PP=4: 8 ranks
    "gpt-pp2-2chunks-dp2-epochs": ("pretrain_gpt.py", PRODUCTION),
    "gpt-pp4-2chunks-dp2-epochs": ("pretrain_gpt.py", [*PRODUCTION, "--pipeline-model-parallel-size", "4",
                                                       "--num-layers", "8", "--micro-batch-size", "1"]),
    "hybrid-tp2-pp2": ("pretrain_hybrid.py", [*TP2_PP2, "--hybrid-layer-pattern", "*-|*-", *HYBRID_SPEC]),
    "hybrid-pp2-2chunks": ("pretrain_hybrid.py", ["--pipeline-model-parallel-size", "2", "--hybrid-layer-pattern",
                                                  "*-|*-|*-|*-", *HYBRID_SPEC]),
    # unequal stages (Megatron-LM's layout string: E embedding, t layer, L loss, | between stages)
    "gpt-pp2-layout-1-3": ("pretrain_gpt.py", ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                                               "--pipeline-model-parallel-layout", "Et|tttL", "--clip-grad", "1.0"]),
    "gpt-pp2-layout-2chunks-0-2-1-1": ("pretrain_gpt.py", ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                                                           "--pipeline-model-parallel-layout", "E|tt|t|tL"]),
    # the rest of LLaVA's matrix (PP2/PP4 x TP1/TP2, both trees): scripts/pretrain_vlm_rrfp_matrix.py
    "vlm-pp2": ("pretrain_vlm.py", ["--pipeline-model-parallel-size", "2", "--num-layers", "4", *VLM]),
}
EPOCHS = ["--rrfp-dp-overlap", "epochs"]
RRFP_RUNS = {  # rrfp's runs of a case, each against the one Megatron run (default: one, with rrfp's defaults)
    "gpt-pp2-2chunks-dp2-epochs": [EPOCHS, [*EPOCHS, "--rrfp-hint", "bf"]],
    "gpt-pp4-2chunks-dp2-epochs": [EPOCHS, [*EPOCHS, "--rrfp-hint", "bf"]],
}
GRAD_NORMS = {"vlm-pp2", "gpt-pp2-2chunks-dp2-overlap", "gpt-pp2-layout-1-3", *RRFP_RUNS}  # the split active
INTERLEAVED_LAYOUT = {"gpt-pp2-layout-2chunks-0-2-1-1"}  # refused where compat.interleaved_layout_unverified()
TWO_RANKS = {"vlm-pp2", "gpt-pp2-layout-1-3", "gpt-pp2-layout-2chunks-0-2-1-1"}  # PP=2 alone (else DP=2 or TP=2)
LAUNCH_TIMEOUT_S = 900


@pytest.fixture(scope="module", params=TREES or [None], ids=[os.path.basename(t.rstrip("/")) for t in TREES] or
                ["no-tree"])
def tree(request, tmp_path_factory) -> Path:
    """A copy of one MEGATRON_LM tree whose release matches the installed megatron-core."""
    source = request.param
    if source is None:
        pytest.skip("set MEGATRON_LM to Megatron-LM source tree(s), e.g. MEGATRON_LM=/work/mlm/core_v0.16.1")
    found = release(source)
    if found != MEGATRON_CORE_VERSION.release[:2]:
        pytest.skip(f"{source} is Megatron-LM {found[0]}.{found[1]}, but megatron-core {MEGATRON_CORE_VERSION} "
                    "is installed (a tree runs with its own minor)")
    return copy_tree(source, tmp_path_factory.mktemp("megatron-lm"))


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", list(CASES))
def test_rrfp_default_gives_megatrons_losses(tree, case, tmp_path):
    script, flags = CASES[case]
    if script == "pretrain_hybrid.py" and (hybrid_model_unavailable() or not (tree / script).is_file()):
        pytest.skip(hybrid_model_unavailable() or f"{tree.name} has no {script}")
    grad_norms = case in GRAD_NORMS
    if case in INTERLEAVED_LAYOUT and interleaved_layout_unverified():  # refused at start there, in one line
        run = pretrain(tree, script, flags, ["--pipeline-schedule", "rrfp"], tmp_path, nproc=2,
                       timeout=LAUNCH_TIMEOUT_S, check=False)
        assert run["returncode"] != 0 and "error: --pipeline-schedule rrfp does not support " \
            "--pipeline-model-parallel-layout 'E|tt|t|tL'" in run["log"], run["log"][-6000:]
        assert "> initializing torch distributed" not in run["log"], run["log"][-6000:]
        return
    nproc = 2 if case in TWO_RANKS else (8 if "pp4" in case else 4)
    reference = pretrain(tree, script, flags, ["--pipeline-schedule", "1f1b"], tmp_path, nproc=nproc,
                         timeout=LAUNCH_TIMEOUT_S, tensorboard=tmp_path / "1f1b" if grad_norms else None)
    assert sorted(reference["loss"]) == [1, 2, 3], reference["log"][-6000:]
    if grad_norms:
        assert sorted(reference["grad_norm"]) == [1, 2, 3], reference["log"][-6000:]
    for n, extra in enumerate(RRFP_RUNS.get(case, [[]])):
        rrfp = pretrain(tree, script, flags, ["--pipeline-schedule", "rrfp", *extra], tmp_path, nproc=nproc,
                        timeout=LAUNCH_TIMEOUT_S, tensorboard=tmp_path / f"rrfp{n}" if grad_norms else None)
        print(f"{tree.name} {case} {' '.join(extra)}: rrfp {rrfp['loss']} {rrfp['grad_norm']} "
              f"1f1b {reference['loss']} {reference['grad_norm']}")  # the figures the docs quote (pytest -s)
        if grad_norms and "bf" not in extra:  # the split active (LLaVA: on its ViT and decoder)
            assert "linears deferred to W" in rrfp["log"], rrfp["log"][-6000:]
        if extra[:2] == EPOCHS:  # the rule ran: the job's one line says where DP communication goes
            assert "in the task loop at fixed DP points" in rrfp["log"], rrfp["log"][-6000:]
            assert "the DP epoch rule runs with" in rrfp["log"], rrfp["log"][-6000:]  # after the measuring call
        if flags[:len(PRODUCTION)] == PRODUCTION:  # Megatron-LM kept them (its arguments print, both runs)
            for name in ("overlap_grad_reduce", "overlap_param_gather", "use_distributed_optimizer"):
                for run in (rrfp, reference):
                    assert re.search(rf"\b{name} \.+ True\b", run["log"]), (name, run["log"][-6000:])
        for metric in ("loss", "grad_norm"):
            for iteration, value in reference[metric].items():
                assert rrfp[metric][iteration] == pytest.approx(value, rel=1e-5), (metric, iteration, extra,
                                                                                  rrfp[metric], reference[metric])


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_full_iteration_cuda_graph_is_refused_before_any_rank_starts_work(tree, tmp_path):
    """FullCudaGraphWrapper around rrfp: each rank's parser exits with the one line, before
    Megatron-LM initializes torch.distributed (flags.check_cuda_graphs)."""
    spelling = (["--cuda-graph-impl", "full_iteration"] if release(str(tree)) >= (0, 19) else
                ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"])
    run = pretrain(tree, "pretrain_gpt.py", ["--pipeline-model-parallel-size", "2", "--num-layers", "2", *spelling],
                   ["--pipeline-schedule", "rrfp"], tmp_path, nproc=2, timeout=LAUNCH_TIMEOUT_S, check=False)
    line = (f"error: --pipeline-schedule rrfp does not support {' '.join(spelling)}: "
            "Megatron-LM wraps the schedule in FullCudaGraphWrapper")
    assert run["returncode"] != 0 and line in run["log"], run["log"][-6000:]
    assert "> initializing torch distributed" not in run["log"] and not run["loss"], run["log"][-6000:]
