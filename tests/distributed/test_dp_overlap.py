"""Where data-parallel communication may overlap RRFP's task loop, and the rule that makes it safe
(mcore/dp_overlap.py); the rule itself is exercised on the single-queue emulation
(tests/unit/test_transport_emulated.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_rrfp.mcore import dp_overlap
from megatron_rrfp.mcore.config import RRFPConfig
from megatron_rrfp.mcore.dp_overlap import overlapped_dp_communication_allowed, overlapping_flags, whole_stage_agreement

AFTER_LOOP, EPOCHS, IN_LOOP, LOCKSTEP = (dp_overlap.AFTER_LOOP, dp_overlap.EPOCHS, dp_overlap.IN_LOOP,
                                        dp_overlap.LOCKSTEP)


def _ddp(grad: bool, param: bool):
    return SimpleNamespace(ddp_config=SimpleNamespace(overlap_grad_reduce=grad, overlap_param_gather=param))


def test_only_interleaved_dp_overlap_on_cuda_needs_the_whole_stage_agreement():
    chunks = [_ddp(True, True), _ddp(True, True)]
    assert whole_stage_agreement(chunks, device_type="cuda", data_parallel_size=2)
    assert whole_stage_agreement([_ddp(False, True)] * 2, device_type="cuda", data_parallel_size=2)
    for models, device, dp in ((chunks, "cpu", 2), (chunks, "cuda", 1), (chunks[:1], "cuda", 2),
                               ([_ddp(False, False)] * 2, "cuda", 8)):
        assert not whole_stage_agreement(models, device_type=device, data_parallel_size=dp)
    assert not whole_stage_agreement(chunks, device_type="cuda", data_parallel_size=2, forward_only=True)


def test_dp_communication_lockstep_or_after_the_loop_where_cuda_needs_a_rule():
    chunks = [_ddp(True, True), _ddp(True, True)]

    def mode(models=chunks, device="cuda", dp=2, choice="auto", forward_only=False):
        return dp_overlap.dp_communication(models, device_type=device, data_parallel_size=dp, choice=choice,
                                           forward_only=forward_only)

    assert mode() == mode(choice="epochs") == EPOCHS  # the default on CUDA: the epoch rule
    assert mode(choice="after-loop") == AFTER_LOOP and mode(choice="lockstep") == LOCKSTEP
    assert mode(device="cpu", choice="epochs") == EPOCHS and mode(dp=1, choice="epochs") == IN_LOOP
    # nothing to place: CPU, one chunk, DP 1, no overlap flag, forward only; a named after-loop applies anywhere
    assert mode(device="cpu") == mode(models=chunks[:1]) == mode(dp=1) == IN_LOOP
    assert mode(models=[_ddp(False, False)] * 2) == mode(forward_only=True) == IN_LOOP
    assert mode(dp=1, choice="after-loop") == IN_LOOP
    assert mode(device="cpu", choice="after-loop") == mode(models=chunks[:1], choice="after-loop") == AFTER_LOOP
    # a named lockstep applies on any device too (its cost, measured on CPU: bench --whole-stage-agreement), but
    # only where there is something to place in the loop; the rule itself asks for it on CUDA only
    assert mode(device="cpu", choice="lockstep") == LOCKSTEP
    assert mode(device="cpu", choice="lockstep", models=chunks[:1]) == mode(dp=1, choice="lockstep") == IN_LOOP
    assert not whole_stage_agreement(chunks, device_type="cpu", data_parallel_size=2)
    assert dp_overlap.describe(EPOCHS, "auto", chunks, 2) == (
        "megatron-rrfp: DP 2 x 2 chunks with --overlap-grad-reduce --overlap-param-gather: in the task loop at "
        "fixed DP points, rounds in epoch order (replicas independent between DP points); the first iteration runs "
        "them after the loop and measures which DP points to keep (--rrfp-dp-overlap auto; "
        "'after-loop' or 'lockstep' name the others)")
    assert dp_overlap.describe(AFTER_LOOP, "after-loop", chunks, 2) == (
        "megatron-rrfp: DP 2 x 2 chunks with --overlap-grad-reduce --overlap-param-gather: parameter all-gathers "
        "before the task loop, reductions after it (replicas independent) (--rrfp-dp-overlap after-loop)")
    with pytest.raises(ValueError, match=r"dp_overlap \(--rrfp-dp-overlap\) must be one of auto, epochs, lockstep, "
                                         r"after-loop"):
        RRFPConfig.of(dp_overlap="at-end")


def test_overlap_is_allowed_everywhere_given_the_rule():
    assert overlapped_dp_communication_allowed(device_type="cuda", data_parallel_size=2, interleaved=True)
    # without the whole-stage agreement the interleaved CUDA case is outside the argument
    assert not overlapped_dp_communication_allowed(device_type="cuda", data_parallel_size=2, interleaved=True,
                                                   whole_stage=False)
    for device, dp, interleaved in (("cpu", 2, True), ("cuda", 1, True), ("cuda", 2, False)):
        assert overlapped_dp_communication_allowed(device_type=device, data_parallel_size=dp, interleaved=interleaved,
                                                   whole_stage=False)


def test_flags_are_named_as_megatron_lm_spells_them():
    assert overlapping_flags([_ddp(True, True)]) == ["overlap_grad_reduce (--overlap-grad-reduce)",
                                                     "overlap_param_gather (--overlap-param-gather)"]
    assert overlapping_flags([SimpleNamespace()]) == []


def test_the_simulated_cost_of_dp_communication_at_the_end_and_overlapped():
    """sim/dp_comm.py on a hand-made trace: one stage, two chunks, split backward."""
    from megatron_rrfp.policy.actions import Kind, Task
    from megatron_rrfp.sim.dp_comm import DPComm, iteration_time

    trace = [(0, Task(Kind.F, 0, 0), 0.0, 1.0), (0, Task(Kind.F, 0, 1), 1.0, 2.0),
             (0, Task(Kind.B, 0, 1), 2.0, 3.0), (0, Task(Kind.W, 0, 1), 3.0, 4.0),
             (0, Task(Kind.B, 0, 0), 4.0, 5.0), (0, Task(Kind.W, 0, 0), 5.0, 6.0)]
    comm = DPComm(reduce_per_bucket=1.0, gather_per_bucket=0.5, buckets_per_chunk=2)
    # at the end: 4 reductions after t=6, then 4 all-gathers
    assert iteration_time(trace, 1, 2, comm, overlap_grad_reduce=False, overlap_param_gather=False) == 6 + 4 + 2
    # overlapped: chunk 1's buckets from t=4 (its last W) run 4..6, chunk 0's 6..8; one all-gather exposed
    assert iteration_time(trace, 1, 2, comm, overlap_grad_reduce=True, overlap_param_gather=True) == 8 + 0.5
    # B-only parameters apart (a quarter bucket per chunk, taken from the mixed ones): launched at each last B
    apart = DPComm(reduce_per_bucket=1.0, gather_per_bucket=0.5, buckets_per_chunk=2, b_only_apart=True,
                   b_only_share=0.25)
    assert iteration_time(trace, 1, 2, apart, overlap_grad_reduce=True, overlap_param_gather=True) == 7.75 + 0.5


def test_lockstep_replicas_run_every_task_at_the_slower_replicas_pace():
    """sim.variability.lockstep, the model of the whole-stage agreement (scripts/lockstep_cost.py):
    identical replicas change nothing; otherwise each task and message takes the slower draw, and
    no replica finishes its iteration sooner in lock-step than alone."""
    from megatron_rrfp.policy.topology import Topology
    from megatron_rrfp.sim.simulator import policy, simulate
    from megatron_rrfp.sim.variability import (
        VARIABILITY_LEVELS,
        Variability,
        lockstep,
        sample_realization,
        with_host_cost,
    )

    topology, m, j3 = Topology(4, 2), 8, Variability(**VARIABILITY_LEVELS["j3"])
    a, b = (sample_realization(j3, topology, m, seed) for seed in (1, 2))
    assert lockstep([a, a]) == a
    both = lockstep([a, b])
    assert both.forward[2][1][3] == max(a.forward[2][1][3], b.forward[2][1][3])
    assert both.gradient_latency[0][0][5] == max(a.gradient_latency[0][0][5], b.gradient_latency[0][0][5])
    rrfp = policy("default")
    assert simulate(rrfp, topology, m, both).makespan >= max(simulate(rrfp, topology, m, r).makespan for r in (a, b))
    with pytest.raises(ValueError, match="host cost"):
        lockstep([a, with_host_cost(a, [{}] * 4)])


def test_lockstep_cost_script_prints_no_cost_without_jitter(capsys):
    import os
    import runpy

    script = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "scripts", "lockstep_cost.py")
    assert runpy.run_path(script)["main"](["--pp", "2", "--variability", "j0,j3", "--seeds", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 2 and rows[0].endswith("| +0.0% |"), rows  # j0: the replicas draw alike
    assert float(rows[1].split("|")[-2].strip().rstrip("%")) > 0, rows  # j3: lock-step waits for the slower


def _production_steps_on_cpu() -> list:
    import torch.distributed as dist

    from megatron_rrfp.selfcheck.equivalence import PRODUCTION_STEPS, gpt_equivalence

    ctx = {"world": dist.get_world_size(), "seed": 0, "stall_timeout_s": 60.0}
    # the after-loop step: DP communication out of the loop (named, so it applies on CPU; the default's
    # epoch rule has its own CPU twin, test_dp_epoch_rule.py)
    after_loop = PRODUCTION_STEPS["production-dp-after-loop-pp2-chunks2"]
    return [gpt_equivalence(ctx, iterations=2, num_microbatches=4, device="cpu", **layout)
            for layout in (PRODUCTION_STEPS["production-bf16-dp-overlap-pp2-chunks2"],
                           PRODUCTION_STEPS["production-moe-ep2-pp2"], after_loop)]


@pytest.mark.timeout(400)
def test_production_selfcheck_steps_run_on_cpu():
    """The GPU self-check's production steps' code on gloo, 4 ranks: DP2 x PP2 x 2 chunks with
    --overlap-grad-reduce --overlap-param-gather --use-distributed-optimizer in bf16, MoE
    EP2 x PP2 (alltoall), and the fp32 DP-overlap step with its DP communication out of the loop
    (Megatron-LM's grad_sync_func / param_sync_func set), each against Megatron's own schedule."""
    from megatron_rrfp.launch.function import launch

    for results in launch(_production_steps_on_cpu, world_size=4, tp=1, pp=2, timeout=360):
        assert [status for status, _ in results] == ["PASS", "PASS", "PASS"], results
        assert "2 chunks x DP=2, overlapped DP + distributed optimizer, bf16" in results[0][1], results
        assert "EP=2 (alltoall)" in results[1][1], results
