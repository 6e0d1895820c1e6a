"""Activation memory, measured (runtime/memory.py) and bounded (``1x``, ``auto``), on real
megatron-core stages over gloo: one launch for every distributed check. Plus the same
accounting in-process, and the bench's memory columns from synthetic per-rank figures."""
from __future__ import annotations

import pytest
import torch

from helpers.memory import MICROBATCHES, memory_checks, message_bytes
from megatron_rrfp.launch.function import launch
from megatron_rrfp.policy.budget import AUTO_MARGIN
from megatron_rrfp.runtime.memory import ActivationMeter

PP = 2


@pytest.mark.timeout(300)
def test_activation_memory_and_limits_pp2_mlp():
    budget_forwards = 5.0
    results = launch(memory_checks, world_size=PP, timeout=240, args=(budget_forwards,))
    one_x = min(PP, MICROBATCHES)
    for r in results:
        # Megatron's 1F1B, wrapped from outside: exactly the hand-computed bytes x its in-flight peak
        megatron = r["megatron"]
        assert megatron["method"] == "saved-tensors"
        assert megatron["in_flight"] == (1 if r["last"] else one_x)
        assert megatron["bytes"] == megatron["in_flight"] * r["expected_per_forward"], r
        # RRFP at 1x holds what Megatron holds, plus messages that arrived before their task
        for name in ("bf-1x", "strict-1x"):
            ours = r[name]
            assert ours["in_flight"] == megatron["in_flight"], (name, r)
            assert megatron["bytes"] <= ours["bytes"] <= megatron["bytes"] + one_x * message_bytes(), (name, r)
        assert r["bf-1x"]["limit"] == one_x and r["strict-1x"]["limit"] == 0  # strict: the limit does not apply
        # bfw: W still holds its inputs -- counted in flight until W, and in the bytes
        bfw = r["bfw-1x"]
        assert bfw["in_flight"] <= one_x and bfw["wgrad_bytes"] > 0
        assert bfw["bytes"] >= bfw["wgrad_bytes"]
        if r["last"]:  # a W-pending forward beside the next one would pass Megatron's bytes (1x in bytes:
            assert bfw["in_flight"] == 1  # policy/membytes.py), so the last stage holds Megatron's own count
        # more in flight, more memory: the meter sees every held forward
        assert r["bf-8"]["bytes"] >= r["bf-8"]["in_flight"] * r["expected_per_forward"]
        # auto: forward-only calls (no_grad) do not calibrate; the first training call runs
        # at 1x, the next ones at the largest limit within the injected budget
        assert r["eval"]["limit"] == 0 and r["eval"]["in_flight"] == 0  # only messages waiting are held
        assert r["eval"]["bytes"] <= MICROBATCHES * message_bytes()
        calibration, *resolved = r["auto"]
        assert calibration["limit"] == one_x
        for run in resolved:
            assert run["bytes"] <= r["budget"], (run, r["budget"])
        assert resolved[0]["limit"] == resolved[1]["limit"]
    stage0 = next(r for r in results if not r["last"])
    limit = stage0["auto"][1]["limit"]
    assert one_x < limit <= int(AUTO_MARGIN * budget_forwards) < MICROBATCHES, stage0["auto"]
    # 1x in bytes with the split too: Megatron's peak (max over ranks) plus at most a waiting message
    assert max(r["bfw-1x"]["bytes"] for r in results) <= 1.01 * (max(r["megatron"]["bytes"] for r in results)
                                                                  + message_bytes())
    # the 1x bench claim, here as a functional check: same peak in flight, max over ranks
    assert max(r["bf-1x"]["in_flight"] for r in results) == max(r["megatron"]["in_flight"] for r in results)


def test_meter_counts_each_saved_storage_once_until_autograd_frees_it():
    """A chain with known saved tensors: exp saves its output, which gelu saves again (one
    storage); the linear saves its input; parameters are not activations."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 16)
    x = torch.randn(4, 8, requires_grad=True)
    meter = ActivationMeter("cpu", persistent=linear.parameters())
    with meter:
        hidden = torch.exp(linear(x))  # linear saves x (128 B); exp saves its output (256 B)
        loss = torch.nn.functional.gelu(hidden).sum()  # gelu saves its input: the same storage
        assert meter.bytes == 4 * 4 * 8 + 4 * 4 * 16
        waiting = torch.zeros(10)
        meter.hold(waiting)  # a received message waiting for its task
        assert meter.bytes == 128 + 256 + 40
        meter.release(waiting)
        loss.backward()
        assert meter.bytes == 0  # autograd freed every saved tensor
    assert meter.peak_bytes == 128 + 256 + 40
    with meter:  # a dropped graph releases what it saved, without a backward
        loss = torch.exp(linear(x)).sum()
        assert meter.bytes == 128 + 256
        del loss
        assert meter.bytes == 0
    assert meter.peak_bytes == 128 + 256


def test_bench_table_and_json_carry_memory():
    from megatron_rrfp.bench.run import BenchConfig, summarize
    from megatron_rrfp.bench.table import format_table

    config = BenchConfig(pipeline_size=2, num_microbatches=4, schedules=("megatron-1f1b", "rrfp-bf"), iterations=1,
                         warmup=0, buffer_limit="1.5x")

    def rank(r: int) -> dict:
        run = {"walls": [1.0], "busy": [1.5], "spans": [], "breakdown": None, "activation_measure": "saved-tensors"}
        return {"rank": r, "stage": r, "world_size": 2, "runs": {
            "megatron-1f1b": {**run, "peak_activation_bytes": 2_000_000 - r, "peak_in_flight": 2 - r,
                              "buffer_limit": None},
            "rrfp-bf": {**run, "walls": [0.8], "peak_activation_bytes": 3_000_000 - r, "peak_in_flight": 3 - r,
                        "buffer_limit": 3}}}

    report = summarize(config, [rank(0), rank(1)])
    bf = report["runs"][1]
    assert bf["peak_activation_bytes"] == {"max_over_ranks": 3_000_000, "per_rank": [3_000_000, 2_999_999]}
    assert bf["peak_in_flight"] == {"max_over_ranks": 3, "per_rank": [3, 2]}
    assert bf["activation_memory_vs_megatron_1f1b"] == pytest.approx(1.5)
    assert bf["buffer_limit"] == {"spec": "1.5x", "per_stage": [3, 3]}
    assert report["runs"][0]["buffer_limit"] is None and report["activation_measure"] == "saved-tensors"
    table = format_table(report)
    assert "act MB" in table and "in flight" in table and "1.50x" in table and "rrfp-bf [3, 3]" in table


def test_goodput_ledger_keeps_peak_memory_across_ranks(tmp_path):
    """Every rank's peak activation bytes and forwards in flight reach the ledger ([min,
    median, mean, max] across ranks; a schedule without a report passes ``memory=``), and
    the report shows the largest per-iteration figures."""
    from types import SimpleNamespace

    from megatron_rrfp.goodput import GoodputRecorder, goodput_report
    from megatron_rrfp.goodput.cli import format_report
    from megatron_rrfp.goodput.recorder import breakdown_vector

    def report(peak: int, in_flight: int):
        return SimpleNamespace(wall_s=1.0, compute_s=0.5, wait_s=0.3, backpressure_s=0.0, agree_s=0.0, flush_s=0.0,
                               peak_activation_bytes=peak, peak_in_flight=in_flight, buffer_limit=4)

    iterations = [[report(3_000_000, 4), report(1_000_000, 2)],  # RRFP: from the reports
                  [None, None]]  # Megatron's own schedule, measured around the call
    memories = [[None, None], [(5_000_000, 4), (2_000_000, 1)]]
    clock = [0.0]
    path = str(tmp_path / "goodput.db")
    current: list = []
    recorder = GoodputRecorder(path, rank=0, world=2, clock=lambda: (clock[0], clock[0]),
                               gather=lambda vector: current)
    for number, (reports, memory) in enumerate(zip(iterations, memories), start=1):
        current[:] = [breakdown_vector(r, 0.0, m) for r, m in zip(reports, memory)]
        recorder.iteration_start(number)
        clock[0] += 1.0
        recorder.iteration(number, tokens=8, report=reports[0], memory=memory[0])
    recorder.job_end()
    result = goodput_report(path)
    assert result.breakdown["peak_activation_bytes"] == {"min": 2_000_000, "median": 3_500_000, "max": 5_000_000}
    assert result.breakdown["peak_in_flight"] == {"min": 2, "median": 3, "max": 4}
    figures = result.to_dict()
    assert figures["memory_across_ranks"]["peak_activation_bytes"]["max"] == 5_000_000
    assert "peak_activation_bytes" not in figures["breakdown_across_ranks_s"]
    text = format_report(result)
    assert "activations held, MB" in text and "5.00" in text and "forwards in flight" in text


def test_megatron_lm_log_line_carries_peak_memory():
    from types import SimpleNamespace

    from megatron_rrfp.goodput.recorder import peak_memory_line

    report = SimpleNamespace(peak_activation_bytes=12_345_678, peak_in_flight=6, buffer_limit=8)
    assert peak_memory_line(report, 10, world=1) == (
        "megatron-rrfp: iteration 10 | peak activation memory 12.3 MB (max over ranks) | peak forwards in flight 6"
        " | buffer limit 8 on rank 0")
    assert peak_memory_line(None, 10, world=1) is None  # nothing measured: no line


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_meter_keeps_the_users_peak_statistics():
    """Megatron-LM's report_memory reads torch.cuda.max_memory_allocated: an earlier, higher
    peak (start-up, a checkpoint load) survives the schedule's meter, which then says its
    figure is an upper bound; a call that sets a new peak is measured exactly."""
    device = torch.device("cuda", torch.cuda.current_device())
    big = torch.empty(64 * 2 ** 20, dtype=torch.uint8, device=device)
    del big
    earlier = torch.cuda.max_memory_allocated(device)
    with ActivationMeter(device) as meter:
        small = torch.empty(2 ** 20, dtype=torch.uint8, device=device)
    del small
    assert torch.cuda.max_memory_allocated(device) == earlier
    assert meter.method == "cuda-allocator-bound" and meter.peak_bytes >= 2 ** 20
    with ActivationMeter(device) as meter:
        larger = torch.empty(128 * 2 ** 20, dtype=torch.uint8, device=device)
    del larger
    assert meter.method == "cuda-allocator" and 128 * 2 ** 20 <= meter.peak_bytes < 130 * 2 ** 20
    with ActivationMeter(device, reset_peak=True) as meter:  # an explicit measurement
        small = torch.empty(2 ** 20, dtype=torch.uint8, device=device)
    del small
    assert meter.method == "cuda-allocator" and 2 ** 20 <= meter.peak_bytes < 3 * 2 ** 20
