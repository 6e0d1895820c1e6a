"""The readiness-first executor against megatron-core's own 1F1B (CPU, gloo, real models).

Every case injects random per-rank task delays so the executed order really departs
from 1F1B, then requires per-microbatch losses and every gradient to match megatron-core
within 1e-5 (relative, fp32). Launches are few and batched: process start-up dominates.
"""
from __future__ import annotations

import json

import pytest

from helpers.equivalence import Case, run_cases
from helpers.failures import api_contract, stress, unresponsive_peer
from megatron_rrfp.launch.function import DistributedTestFailure, launch
from megatron_rrfp.policy.hints import OrderedHint

TOL = 1e-5


def _check(results: list[list[dict]], *, expect_reordering: bool = True) -> None:
    """results[rank][case]: errors within TOL; at least one rank ran a non-1F1B order."""
    per_case = list(zip(*results))
    for case_results in per_case:
        for r in case_results:
            assert r["loss_rel_err"] <= TOL and r["grad_rel_err"] <= TOL, r
            assert all(abs(a - b) <= TOL * max(1.0, abs(a)) for a, b in zip(r["losses_megatron"], r["losses_rrfp"]))
        assert sum(r["num_losses"] for r in case_results) > 0  # the last stage really reported losses
        if expect_reordering:
            assert any(order != r["megatron_order"] for r in case_results for order in r["orders"]), \
                "injected delays should have changed the order somewhere"


@pytest.mark.timeout(400)
def test_pp2_gpt_trains_50_iterations_like_megatron_and_mlp_and_eval():
    cases = [
        Case(model="gpt", iterations=50, num_microbatches=6, max_task_delay_s=0.004),
        Case(model="mlp", iterations=3),
        Case(model="gpt", iterations=2, forward_only=True),
        Case(model="gpt", iterations=3, hint="bfw"),
        Case(model="mlp", iterations=2, variable_seq_lengths=True),
        Case(model="gpt", iterations=2, hint="bfw", transport="rounds"),  # the device protocol, over gloo
        Case(model="gpt", iterations=2, hint="zbh1", strict=True, max_task_delay_s=0.0),  # ZB-H1 as a baseline
        Case(model="gpt", iterations=2, hint="zbh1", buffer_limit="1x"),
        Case(model="gpt", iterations=2, hint="default", buffer_limit="1x"),
    ]
    results = launch(run_cases, world_size=2, timeout=360, args=(cases,))
    _check([r[:2] + r[3:8] for r in results])
    # eval: forwards only, order is free anyway; the default at 1x memory on PP=2 may well
    # run 1F1B's own order (the memory rule leaves it no room), but must match it exactly
    _check([r[2:3] + r[8:] for r in results], expect_reordering=False)
    last = results[1]
    assert all(r[3]["peak_deferred_wgrad_bytes"] > 0 for r in results)  # BFW really deferred W
    assert any("W" in order for r in results for order in r[3]["orders"])
    assert any("W" in order for r in results for order in r[8]["orders"])  # default: GPT's linears split B/W
    assert len(last[0]["losses_rrfp"]) == 50 and last[0]["losses_rrfp"][-1] < last[0]["losses_rrfp"][0]


@pytest.mark.timeout(400)
def test_pp4_gpt_and_mlp():
    # the third: what the default reads without the split at 1x (1F1B waiting for a late forward);
    # it may well run 1F1B's own order (it waits rather than reorder), but must match it exactly
    waiting = OrderedHint("1f1b", waits_for_forward=True)
    results = launch(run_cases, world_size=4, timeout=360, args=([Case(model="gpt", iterations=2),
                                                                  Case(model="mlp", iterations=2),
                                                                  Case(model="mlp", iterations=2, hint=waiting,
                                                                       buffer_limit="1x")],))
    _check([r[:2] for r in results])
    _check([r[2:] for r in results], expect_reordering=False)


@pytest.mark.timeout(300)
def test_tp2_pp3_tp_ranks_agree_while_the_unsplit_default_waits_for_a_late_forward():
    # a stage that waits with a backward ready must still make the same choice on both TP
    # ranks when one of them sees every message late, on both transports; the order may equal 1F1B's
    waiting = OrderedHint("1f1b", waits_for_forward=True)
    cases = [Case(model="mlp", iterations=2, hint=waiting, buffer_limit="1x", late_rank=2),
             Case(model="mlp", iterations=2, hint=waiting, buffer_limit="1x", late_rank=3, transport="rounds")]
    _check(launch(run_cases, world_size=6, tp=2, pp=3, timeout=240, args=(cases,)), expect_reordering=False)


@pytest.mark.timeout(400)
def test_tp2_pp2_with_one_tp_rank_seeing_messages_late():
    cases = [Case(model="gpt", iterations=2, late_rank=2), Case(model="mlp", iterations=2, late_rank=1),
             Case(model="gpt", iterations=2, hint="bfw", late_rank=3),
             Case(model="mlp", iterations=3, buffer_limit="auto"),  # TP ranks agree on auto's limit
             Case(model="mlp", iterations=2, late_rank=0, transport="rounds")]  # device protocol, agreed counters
    results = launch(run_cases, world_size=4, tp=2, pp=2, timeout=360, args=(cases,))
    _check(results)


@pytest.mark.timeout(400)
def test_dp2_pp2_with_megatron_ddp_and_finalize():
    results = launch(run_cases, world_size=4, pp=2, timeout=360,
                     args=([Case(model="gpt", iterations=3), Case(model="mlp", iterations=2),
                            Case(model="gpt", iterations=2, hint="bfw"),
                            Case(model="gpt", iterations=2, per_token_loss=True)],))
    _check(results)


@pytest.mark.timeout(400)
def test_dp2_pp2_overlapped_reductions_under_the_split_launch_early_and_match_megatron():
    """overlap_grad_reduce (+ distributed optimizer) with the default policy's B/W split:
    gradients equal Megatron's, and from the second iteration on (DDP's golden counts are
    recorded in the first, as in Megatron) every bucket launches inside the schedule (during
    the last W, weight by weight, or after the last B), none from finish_grad_sync. With
    --rrfp-dp-overlap after-loop every bucket launches after the last task, before
    finish_grad_sync, in every iteration."""
    cases = [Case(model="gpt", iterations=3, hint="default", buffer_limit="1x", overlap_grad_reduce=True,
                  bucket_size=2000),
             Case(model="gpt", iterations=2, hint="default", buffer_limit="1x", overlap_grad_reduce=True,
                  use_distributed_optimizer=True, bucket_size=2000),
             Case(model="gpt", iterations=2, hint="default", buffer_limit="1x", overlap_grad_reduce=True,
                  use_distributed_optimizer=True, bucket_size=2000, dp_overlap="after-loop")]
    results = launch(run_cases, world_size=4, pp=2, timeout=360, args=(cases,))
    _check(results, expect_reordering=False)
    for rank in results:
        *in_loop, after_loop = rank
        for it in after_loop["bucket_launches"]:  # (finish_grad_sync's call in the first iteration is a no-op)
            ours = [task for task, at_finish in it["launched_at_task"] if not at_finish]
            assert ours and all(task == it["tasks"] for task in ours), it
        for r in in_loop:
            assert any("W" in order for order in r["orders"]), r["orders"]  # the split was active
            first, *later = r["bucket_launches"]
            assert first["launched_at_task"] and all(at_finish for _, at_finish in first["launched_at_task"])
            for it in later:  # every bucket launched by the schedule itself, none left to finish_grad_sync
                launched = it["launched_at_task"]
                assert len(launched) >= 1 and not any(at_finish for _, at_finish in launched), it
                assert all(0 < task <= it["tasks"] for task, _ in launched), it
    print("\n[overlap] bucket launches (task count at launch, by finish_grad_sync) / tasks, iteration 2:",
          [(r["stage"], r["bucket_launches"][1]) for rank in results for r in rank[:1]])


@pytest.mark.timeout(400)
def test_tp2_pp2_sequence_parallel_split_equals_megatron():
    """Megatron's sequence parallelism (norms marked sequence_parallel on CPU) with the B/W
    split active, default policy and ZB-H1 read readiness-first, against Megatron's 1F1B."""
    cases = [Case(model="gpt", iterations=2, hint=hint, buffer_limit="1x", sequence_parallel=True)
             for hint in ("default", "zbh1")]
    results = launch(run_cases, world_size=4, tp=2, pp=2, timeout=360, args=(cases,))
    _check(results, expect_reordering=False)
    for rank in results:
        for r in rank:
            assert any("W" in order for order in r["orders"]), r["orders"]  # the split was active
            assert r["peak_deferred_wgrad_bytes"] > 0


@pytest.mark.timeout(400)
def test_stress_hundreds_of_delay_patterns_tp2_pp2():
    results = launch(stress, world_size=4, tp=2, pp=2, timeout=360, args=(200,), kwargs={"late_rank": 0})
    for r in results:
        assert r["patterns"] == 200 and r["mismatches"] == 0 and r["hangs"] == 0, r
    # the patterns really produced different orders (M=6 at PP=2 allows only a handful)
    assert max(r["distinct_orders"] for r in results) >= 4


@pytest.mark.timeout(200)
def test_routing_timers_and_bad_options_naming_the_option():
    result = launch(api_contract, world_size=2, timeout=150)[0]
    assert result["routed"] == {"pp2": True, "pp1": True}
    assert all(seconds > 0 for seconds in result["timers"].values()), result["timers"]
    messages = result["errors"]
    assert "overlap_p2p_comm" in messages["overlap_p2p_comm"]
    assert "buffer_limit" in messages["buffer_limit"]
    assert "unknown hint 'zigzag'" in messages["hint"] and "--rrfp-hint" in messages["hint"]
    assert "timeout_s" in messages["timeout"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["hang", "kill"])
def test_unresponsive_or_dead_peer_fails_fast_with_a_diagnosis(tmp_path, mode):
    report = tmp_path / "rank0.json"
    with pytest.raises(DistributedTestFailure):
        # rank 0 writes its report and exits; rank 1 hangs or dies: the launch fails either way
        launch(unresponsive_peer, world_size=2, timeout=120, args=(str(report), mode))
    seen = json.loads(report.read_text())
    assert seen["error"] == "PipelineStallError", seen
    assert seen["seconds"] < 12.0, seen  # timeout 3 s (hang) or the transport error (kill)
    assert "rank 0 (pipeline stage 0)" in seen["message"] and "arbiter:" in seen["message"]
    assert "ready:" in seen["message"] and "dispatched:" in seen["message"]


@pytest.mark.timeout(300)
def test_hint_file_running_forwards_out_of_microbatch_order_feeds_each_its_own_data(tmp_path):
    # Stage 0 runs F1 before F0 (and F3 before F2): Megatron's iterators are sequential,
    # so the executor must still give every microbatch its own batch.
    hint = tmp_path / "swapped.json"
    hint.write_text(json.dumps({"stages": ["0F1,0F0,0F3,0F2,0B0,0B1,0B2,0B3",
                                           "0F0,0B0,0F1,0B1,0F2,0B2,0F3,0B3"]}))
    results = launch(run_cases, world_size=2, timeout=240,
                     args=([Case(model="gpt", num_microbatches=4, hint=str(hint), strict=True,
                                 max_task_delay_s=0.0)],))
    _check(results)
    assert results[0][0]["orders"][0].startswith("0F1,0F0")
