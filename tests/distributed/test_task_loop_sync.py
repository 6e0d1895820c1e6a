"""RRFP's task loop makes no host/device synchronising call of its own: the host may run
ahead of the device by up to two tasks only if nothing in between waits for a stream. Run
on CPU with a probe (tests/helpers/sync_probe.py) that records the calls that would wait on
CUDA — value reads, copies between devices, synchronize — made by megatron_rrfp's code while
``PipelineIteration.run`` runs, on a real megatron-core GPT at PP=2 over the device (rounds)
protocol, two hints, per-token loss on (the split backward is left out: it failed on
megatron-core 0.19 when this test was written; tests/distributed/test_wgrad.py covers it)."""
from __future__ import annotations

import pytest

from helpers.equivalence import Case
from helpers.sync_probe import SyncProbe, syncs_in_task_loop
from megatron_rrfp.launch.function import launch

# train/ holds the forward step and data of the project's own driver: the user's side of the
# schedule (Megatron-LM's pretrain_gpt.py there), not RRFP's. The rounds transport reads its
# message headers (int64, built on the CPU by transport.encode_header) to post them.
USER_SIDE = "train/"
HOST_METADATA = ("tolist[int64] at runtime/rounds.py:",)


def _rrfp_calls(calls: list[str]) -> list[str]:
    return [c for c in calls if not c.split(" at ")[1].startswith(USER_SIDE) and not c.startswith(HOST_METADATA)]


@pytest.mark.timeout(400)
def test_the_task_loop_makes_no_synchronising_call():
    cases = [Case(model="gpt", hint=hint, iterations=1, num_microbatches=4, transport="rounds", per_token_loss=True,
                  max_task_delay_s=0.002) for hint in ("bf", "1f1b")]
    for result in launch(syncs_in_task_loop, world_size=2, pp=2, timeout=360, args=(cases,)):
        assert result["runs"] == 2
        assert result["grad_rel_err"] <= 1e-5, result
        calls = _rrfp_calls(result["calls"])
        assert calls == [], "synchronising calls in the task loop:\n" + "\n".join(calls)


def test_the_probe_sees_what_would_synchronise():
    """The probe itself: a copy to a device, a value read and a same-device no-op, from megatron_rrfp code."""
    import torch

    from megatron_rrfp.runtime.report import IterationReport  # any megatron_rrfp module's frame will do

    del IterationReport
    source = compile("t.to(torch.device('cpu')); t.sum().item(); t.to(torch.float64); t.add_(1)",
                     __import__("megatron_rrfp.runtime.report", fromlist=["x"]).__file__, "exec")
    with SyncProbe() as probe:
        exec(source, {"t": torch.ones(2), "torch": torch})
    assert [c.split(" at ")[0] for c in probe.calls] == ["to[float32]", "item[float32]"], probe.calls
