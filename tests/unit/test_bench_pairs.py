"""The bench under ``--overlap-moe-expert-parallel-comm`` (bench/pairs.py): a combined step's emulated
device time is the simulator's pair model, the options are checked before any rank starts, and one
short EP2 x PP2 x 2 chunks bench run executes Megatron's combined 1F1B in the simulator's order and
RRFP's pairs."""
from __future__ import annotations

import json
import time

import pytest

from megatron_rrfp.bench.comm_emulation import CommEmulator, CommTimes
from megatron_rrfp.bench.emulation import DeviceTimeEmulator
from megatron_rrfp.bench.run import BenchConfig
from megatron_rrfp.policy.actions import Kind, Task
from megatron_rrfp.policy.topology import Topology
from megatron_rrfp.sim.variability import Variability, sample_realization

_MOE = Variability(num_experts=4, expert_parallel=2)


def _emulator(a2a_time: float, a2a_s: float):
    topology = Topology(2, 2)
    realization = sample_realization(Variability(f0=0.1, num_experts=4, expert_parallel=2, a2a_time=a2a_time),
                                     topology, 4, seed=3)
    emulator = DeviceTimeEmulator(stage=0, topology=topology, num_microbatches=4, table=None)
    emulator.comm = CommEmulator(CommTimes(a2a_s=a2a_s), [])
    emulator.begin_iteration(realization)
    return emulator, realization


@pytest.mark.parametrize("a2a_time, a2a_s", [(2.0, 0.0), (0.0, 0.1), (0.5, 0.05)])
def test_a_pair_takes_the_longer_of_its_compute_and_its_all_to_alls(a2a_time, a2a_s):
    """The drawn all-to-all time (--a2a-time) and the all-to-alls run inside the step (--a2a-ms,
    counted, not slept) against both halves' compute, as ``Realization.pair_duration``."""
    emulator, realization = _emulator(a2a_time, a2a_s)
    forward, backward = Task(Kind.F, 1, 0), Task(Kind.B, 0, 1)
    step_a2a = 4 * a2a_s  # what the step's own all-to-alls add

    def step():
        for _ in range(4):
            emulator.comm.all_to_all()
        return "out"

    drawn = realization.backward_comm[0][0][1] + realization.backward_comm[0][1][0]
    compute = realization.duration(0, forward, False) + realization.duration(0, backward, False) - drawn
    expected = max(compute, drawn + step_a2a)
    start = time.time()
    assert emulator._run_pair(forward, backward, step) == "out"
    elapsed = time.time() - start
    assert elapsed >= expected - 1e-3
    assert elapsed < compute + drawn + step_a2a  # not the two in series
    tally = emulator.tally.as_dict()
    assert tally["F"]["device"] + tally["B"]["device"] == pytest.approx(expected)
    assert [s.name for s in emulator.spans] == ["0F1+1B0"]
    if not a2a_s:  # the drawn all-to-alls alone: the simulator's own pair time
        assert expected == pytest.approx(realization.pair_duration(0, forward, backward))


@pytest.mark.parametrize("options, flag", [
    (dict(delay_wgrad_compute=True), "--delay-wgrad-compute needs"),
    (dict(overlap_moe_expert_parallel_comm=True, num_chunks=2), "--num-experts"),  # dense
    (dict(overlap_moe_expert_parallel_comm=True, workload=_MOE), "--virtual-pipeline-model-parallel-size > 1"),
    (dict(overlap_moe_expert_parallel_comm=True, workload=_MOE, num_chunks=2,
          schedules=("megatron-1f1b", "rrfp-bfw")), "rrfp-bfw"),
    (dict(overlap_moe_expert_parallel_comm=True, workload=_MOE, num_chunks=2, optimal=True,
          schedules=("megatron-1f1b", "rrfp-default")), "--optimal"),
])
def test_paired_options_are_checked_before_any_rank_starts(options, flag):
    config = BenchConfig(pipeline_size=2, data_parallel=2, num_microbatches=4, **options)
    with pytest.raises(ValueError, match=flag):
        config.validate()


def _names(trace_path: str, rank: int) -> list[str]:
    with open(trace_path, encoding="utf-8") as handle:
        events = json.load(handle)["traceEvents"]
    return [e["name"] for e in events
            if e.get("ph") == "X" and e.get("pid") == rank and e.get("cat") in ("F", "B", "W", "F+B")]


@pytest.mark.timeout(500)
def test_bench_runs_megatrons_combined_1f1b_and_rrfps_pairs(tmp_path):
    """EP2 x PP2 x 2 chunks on 4 gloo ranks: Megatron's combined-1F1B interleaved schedule runs the
    steps the simulator's ``combined_orders`` holds (its pairs seen by the bench's hook), RRFP pairs."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    from megatron_rrfp.bench.run import run_bench
    from megatron_rrfp.sim.combined import combined_orders

    config = BenchConfig(pipeline_size=2, num_chunks=2, data_parallel=2, num_microbatches=8, iterations=1,
                         warmup=1, variability="j3", f0_ms=20.0, schedules=("megatron-1f1b", "rrfp-default"),
                         workload=Variability(num_experts=4, expert_parallel=2, a2a_time=0.6),
                         overlap_moe_expert_parallel_comm=True,
                         delay_wgrad_compute=hasattr(RowParallelLinear, "backward_dw"),  # megatron-core >= 0.19
                         out_dir=str(tmp_path), timeout_s=400.0)
    report = run_bench(config, progress=False)
    megatron, rrfp = report["runs"]
    steps = combined_orders(Topology(2, 2), 8)[0]
    assert _names(str(tmp_path / "trace-megatron-1f1b.json"), 0) == ["+".join(map(str, s)) for s in steps]
    # after the first call (the byte budget's calibration runs no pairs)
    assert any("+" in name for rank in range(4) for name in _names(str(tmp_path / "trace-rrfp-default.json"), rank))
    for run in (megatron, rrfp):
        assert run["peak_activation_bytes"]["max_over_ranks"] > 0 and run["simulated_iteration_time_s"] > 0
