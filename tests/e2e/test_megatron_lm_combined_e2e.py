"""Megatron-LM's unmodified ``pretrain_gpt.py`` with ``--overlap-moe-expert-parallel-comm`` under
``--pipeline-schedule rrfp`` (its own forward step builds the schedule plan megatron-core's combined
step asks for), through ``python -m megatron_rrfp.launch --cpu``: EP2 x PP2 x 2 model chunks MoE
(4 experts, top-2, alltoall), bf16, 4 gloo ranks. rrfp's losses equal Megatron's combined-1F1B
interleaved schedule's and its plain interleaved schedule's, and its trace holds paired tasks and W
tasks (the default hint pairs with its B/W split).
``MEGATRON_LM`` names the trees (see tests/e2e/test_megatron_lm_e2e.py); a tree runs with the
installed megatron-core's minor, the others skip.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers.megatron_lm import copy_tree, pretrain, release
from megatron_rrfp.mcore.compat import MEGATRON_CORE_VERSION

TREES = [t for t in os.environ.get("MEGATRON_LM", "").split(os.pathsep) if t]
MOE = ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1",
       "--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2",
       "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "0.01", "--bf16",
       "--global-batch-size", "16"]  # 4 microbatches per pipeline: room for pairs
OVERLAP = ["--overlap-moe-expert-parallel-comm"]


@pytest.fixture(scope="module", params=TREES or [None], ids=[os.path.basename(t.rstrip("/")) for t in TREES] or
                ["no-tree"])
def tree(request, tmp_path_factory) -> Path:
    source = request.param
    if source is None:
        pytest.skip("set MEGATRON_LM to Megatron-LM source tree(s), e.g. MEGATRON_LM=/work/mlm/core_v0.19.0")
    found = release(source)
    if found != MEGATRON_CORE_VERSION.release[:2]:
        pytest.skip(f"{source} is Megatron-LM {found[0]}.{found[1]}, but megatron-core {MEGATRON_CORE_VERSION} "
                    "is installed (a tree runs with its own minor)")
    return copy_tree(source, tmp_path_factory.mktemp("megatron-lm"))


def _task_names(trace_dir: Path) -> set[str]:
    names = set()
    for path in trace_dir.glob("*.json"):
        events = json.loads(path.read_text())
        events = events["traceEvents"] if isinstance(events, dict) else events
        names |= {str(e["name"]) for e in events if e.get("ph") == "X" and e.get("cat") in ("F", "B", "W", "F+B")}
    return names


@pytest.mark.timeout(3 * 700 + 60)
def test_pretrain_gpt_with_the_overlap_under_rrfp_gives_megatrons_combined_1f1b_losses(tree, tmp_path):
    traces = tmp_path / "traces"
    rrfp = pretrain(tree, "pretrain_gpt.py", [*MOE, *OVERLAP],
                    ["--pipeline-schedule", "rrfp", "--rrfp-trace-dir", str(traces)], tmp_path, timeout=700)
    combined = pretrain(tree, "pretrain_gpt.py", [*MOE, *OVERLAP], ["--pipeline-schedule", "1f1b"], tmp_path,
                        timeout=700)
    interleaved = pretrain(tree, "pretrain_gpt.py", MOE, ["--pipeline-schedule", "1f1b"], tmp_path, timeout=700)
    assert rrfp["loss"].keys() == {1, 2, 3}
    assert rrfp["loss"] == combined["loss"] == interleaved["loss"], (rrfp["loss"], combined["loss"],
                                                                     interleaved["loss"])
    names = _task_names(traces)
    assert any("+" in name for name in names), "rrfp ran no forward paired with a backward"
    assert any("W" in name for name in names), f"no W task: the backward did not split beside the pairs {names}"
