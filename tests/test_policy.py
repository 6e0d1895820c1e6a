"""The arbitration policy, checked through the simulator (its test oracle)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_rrfp.policy.actions import Kind, Task, all_tasks, format_order, parse_order
from megatron_rrfp.policy.arbiter import Arbiter, ArbiterConfig
from megatron_rrfp.policy.hints import HintError, make_hint, megatron_1f1b_order
from megatron_rrfp.policy.topology import Topology
from megatron_rrfp.sim import REFERENCE_J3, Variability, lower_bound, median, policy, sample_realization, simulate


def check_dependencies(result, topology: Topology) -> None:
    """Every task starts after everything it consumes has finished (latency >= 0)."""
    end = {(stage, task): finish for stage, task, _, finish in result.trace}
    for stage, task, start, _ in result.trace:
        mb, chunk = task.microbatch, task.chunk
        if task.kind is Kind.F:
            up = topology.upstream(stage, chunk)
            if up is not None:
                assert start >= end[(up[0], Task(Kind.F, mb, up[1]))] - 1e-9, (stage, task)
        elif task.kind is Kind.B:
            assert start >= end[(stage, Task(Kind.F, mb, chunk))] - 1e-9, (stage, task)
            down = topology.downstream(stage, chunk)
            if down is not None:
                assert start >= end[(down[0], Task(Kind.B, mb, down[1]))] - 1e-9, (stage, task)
        else:
            assert start >= end[(stage, Task(Kind.B, mb, chunk))] - 1e-9, (stage, task)
    # one task at a time per stage
    by_stage: dict[int, list] = {}
    for stage, _, start, finish in result.trace:
        by_stage.setdefault(stage, []).append((start, finish))
    for spans in by_stage.values():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pp=st.integers(1, 6),
    microbatches=st.integers(1, 12),
    chunks=st.integers(1, 3),
    limit=st.integers(1, 6),
    hint=st.sampled_from(["bf", "bfw", "1f1b", "gpipe"]),
    strict=st.booleans(),
    sigma_compute=st.floats(0, 1.0),
    c50=st.floats(0, 2.0),
    sigma_msg=st.floats(0, 2.0),
    seed=st.integers(0, 2**16),
)
def test_every_policy_completes_respects_dependencies_and_buffer(pp, microbatches, chunks, limit, hint, strict,
                                                                 sigma_compute, c50, sigma_msg, seed):
    topology = Topology(pp, chunks)
    realization = sample_realization(
        Variability(sigma_compute=sigma_compute, c50=c50, sigma_msg=sigma_msg), topology, microbatches, seed)
    config = ArbiterConfig(hint=hint, buffer_limit=limit, strict=strict)
    if hint == "1f1b" and chunks > 1 and (microbatches < pp or 0 < microbatches % pp < pp):
        with pytest.raises(HintError, match="interleaved 1f1b hint needs"):
            simulate(config, topology, microbatches, realization)
        return
    result = simulate(config, topology, microbatches, realization, record_trace=True)  # raises on deadlock
    split = hint == "bfw"
    expected = set(all_tasks(microbatches, chunks, split_backward=split))
    for order in result.orders:
        assert len(order) == len(expected) and set(order) == expected  # each task exactly once
    check_dependencies(result, topology)
    if not strict:
        assert max(result.peak_in_flight) <= limit + (chunks - 1)


def test_zero_jitter_bf_and_strict_1f1b_hit_the_closed_form():
    for pp, m in [(2, 2), (4, 4), (4, 8), (8, 32), (3, 7)]:
        topology = Topology(pp)
        realization = sample_realization(Variability(), topology, m, seed=0)
        ideal = (m + pp - 1) * (1.0 + 2.0)  # (M + N - 1)(f + b)
        for name in ("1f1b-strict", "bf", "bf-strict", "1f1b"):
            assert simulate(policy(name), topology, m, realization).makespan == pytest.approx(ideal, abs=1e-12), name


def test_bf_last_stage_is_exactly_1f1b():
    topology = Topology(4)
    realization = sample_realization(Variability(**REFERENCE_J3), topology, 8, seed=3)
    last = simulate(policy("bf"), topology, 8, realization).orders[-1]
    assert format_order(last) == format_order(megatron_1f1b_order(3, topology, 8))


def test_reference_scenario_speedup_and_lower_bound():
    """PP=8, M=32, sigma_c=0.3, c50=0.1 f0, sigma_m=1.5, median of 5 seeds (the paper's reference)."""
    topology, m = Topology(8), 32
    base, bf, bfw, bounds = [], [], [], []
    for seed in range(5):
        realization = sample_realization(Variability(**REFERENCE_J3), topology, m, seed)
        base.append(simulate(policy("1f1b-strict"), topology, m, realization).makespan)
        bf.append(simulate(policy("bf"), topology, m, realization).makespan)
        bfw.append(simulate(policy("bfw"), topology, m, realization).makespan)
        bounds.append(lower_bound(realization, topology, m))
    speedup = median([b / r for b, r in zip(base, bf)])
    assert speedup >= 1.25, speedup
    assert median([r / lb for r, lb in zip(bf, bounds)]) <= 1.25
    assert median(bfw) < median(bf)


def test_same_inputs_same_decisions():
    topology = Topology(4, 2)
    realization = sample_realization(Variability(**REFERENCE_J3), topology, 8, seed=11)
    first = simulate(policy("bf", 3), topology, 8, realization).orders
    assert first == simulate(policy("bf", 3), topology, 8, realization).orders


def test_strict_runs_the_hint_exactly_and_readiness_first_does_not():
    topology = Topology(4)
    realization = sample_realization(Variability(**REFERENCE_J3), topology, 16, seed=1)
    strict = simulate(policy("1f1b-strict"), topology, 16, realization)
    for stage in range(4):
        assert strict.orders[stage] == megatron_1f1b_order(stage, topology, 16)
    loose = simulate(policy("1f1b"), topology, 16, realization)
    assert loose.orders != strict.orders


def test_backpressure_drains_backward_only():
    arbiter = Arbiter(ArbiterConfig(hint="bf", buffer_limit=2), stage=0, topology=Topology(4), num_microbatches=6)
    for mb in (0, 1):
        arbiter.record(Task(Kind.F, mb))
    assert arbiter.at_limit
    assert arbiter.choose({Task(Kind.F, 2)}) is None  # waits for a backward instead of a new forward
    assert arbiter.choose({Task(Kind.F, 2), Task(Kind.B, 1)}) == Task(Kind.B, 1)


def test_interleaved_backpressure_finishes_one_microbatch_at_a_time():
    arbiter = Arbiter(ArbiterConfig(hint="bf", buffer_limit=1), stage=0, topology=Topology(2, 2), num_microbatches=4)
    arbiter.record(Task(Kind.F, 0, 0))
    ready = {Task(Kind.F, 1, 0), Task(Kind.F, 0, 1)}
    assert arbiter.choose(ready) == Task(Kind.F, 0, 1)  # the focus microbatch's next chunk, not a new one


def test_bf_alternates_directions_with_chunk_priorities():
    arbiter = Arbiter(ArbiterConfig(hint="bf"), stage=1, topology=Topology(2, 2), num_microbatches=4)
    ready = {Task(Kind.F, 2, 0), Task(Kind.F, 1, 1), Task(Kind.B, 0, 0), Task(Kind.B, 1, 1)}
    assert arbiter.choose(ready) == Task(Kind.B, 1, 1)  # backward first, higher chunk first
    arbiter.record(Task(Kind.F, 0, 0))
    arbiter.record(Task(Kind.F, 1, 1))  # prefer B next; now pretend a B ran:
    arbiter.record(Task(Kind.B, 1, 1))
    assert arbiter.choose(ready - {Task(Kind.B, 1, 1), Task(Kind.F, 1, 1)}) == Task(Kind.F, 2, 0)


def test_bfw_runs_weight_tasks_only_when_nothing_else_is_ready():
    arbiter = Arbiter(ArbiterConfig(hint="bfw"), stage=0, topology=Topology(2), num_microbatches=4)
    assert arbiter.choose({Task(Kind.W, 0), Task(Kind.F, 1)}) == Task(Kind.F, 1)
    assert arbiter.choose({Task(Kind.W, 0), Task(Kind.W, 1)}) == Task(Kind.W, 0)


@given(kind=st.sampled_from(list(Kind)), mb=st.integers(0, 10**6), chunk=st.integers(0, 99))
def test_task_string_round_trips(kind, mb, chunk):
    task = Task(kind, mb, chunk)
    assert Task.parse(str(task)) == task
    assert parse_order(format_order([task, task])) == [task, task]


def test_bad_input_names_the_option(tmp_path):
    with pytest.raises(ValueError, match="buffer_limit"):
        ArbiterConfig(buffer_limit=0)
    with pytest.raises(HintError, match="unknown hint 'zigzag'"):
        make_hint("zigzag")
    with pytest.raises(ValueError, match="cannot parse task"):
        Task.parse("0X3")
    bad = tmp_path / "hint.json"
    bad.write_text(json.dumps({"stages": [["0F0", "0B0"], ["0F0", "0F0", "0B0"]]}))
    with pytest.raises(HintError, match="listed twice"):
        Arbiter(ArbiterConfig(hint=str(bad)), stage=1, topology=Topology(2), num_microbatches=1)
    missing = tmp_path / "missing.json"
    missing.write_text(json.dumps({"stages": ["0F0,0F1,0B0", "0F0,0B0"]}))
    with pytest.raises(HintError, match="missing: 0B1"):
        Arbiter(ArbiterConfig(hint=str(missing)), stage=0, topology=Topology(2), num_microbatches=2)
    with pytest.raises(HintError, match="lists 2 stages but the pipeline has 3"):
        Arbiter(ArbiterConfig(hint=str(missing)), stage=0, topology=Topology(3), num_microbatches=2)


def test_explicit_hint_file_drives_the_simulation(tmp_path):
    topology, m = Topology(2), 3
    orders = [megatron_1f1b_order(s, topology, m) for s in range(2)]
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"stages": [format_order(o) for o in orders]}))
    realization = sample_realization(Variability(sigma_compute=0.5), topology, m, seed=2)
    result = simulate(ArbiterConfig(hint=str(path), strict=True), topology, m, realization)
    assert result.orders == orders


def test_policy_modules_import_without_torch_distributed():
    code = ("import sys; import megatron_rrfp.policy.plan, megatron_rrfp.policy.dryrun, megatron_rrfp.sim; "
            "assert 'torch' not in sys.modules, 'policy and simulator must not import torch'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_strict_list_that_cannot_complete_is_refused_when_planned():
    # stage 1 waits for F1 first, but stage 0 only produces it after B0, which needs stage 1's B0
    orders = [parse_order("0F0,0B0,0F1,0B1"), parse_order("0F1,0F0,0B0,0B1")]
    from megatron_rrfp.policy.hints import OrderedHint
    from megatron_rrfp.policy.plan import Plan

    config = ArbiterConfig(hint=OrderedHint("cyclic", orders), strict=True)
    with pytest.raises(HintError, match="cannot run to completion"):
        Plan.build(config, Topology(2), 2)
    # readiness-first with the same ranking is fine: the order is a hint, not a plan
    Plan.build(ArbiterConfig(hint=OrderedHint("cyclic", orders)), Topology(2), 2)


def test_torch_pipelining_csv_hint_round_trip(tmp_path):
    # an interleaved 1F1B-like CSV for PP=2, 2 chunks (stages 0..3 in loop placement), with comm actions
    from megatron_rrfp.policy.hints import load_pipelining_csv

    topology, m = Topology(2, 2), 2
    rows = []
    for stage in range(2):
        order = megatron_1f1b_order(stage, topology, m)
        cells = [f"{t.chunk * 2 + stage}{t.kind.value}{t.microbatch}" for t in order]
        rows.append(",".join(cells[:1] + [f"{stage}SEND_F0"] + cells[1:]))
    path = tmp_path / "interleaved.csv"
    path.write_text("\n".join(rows) + "\n")
    hint = load_pipelining_csv(str(path))
    realization = sample_realization(Variability(sigma_compute=0.4), topology, m, seed=4)
    result = simulate(ArbiterConfig(hint=str(path), strict=True), topology, m, realization)
    assert result.orders == [megatron_1f1b_order(s, topology, m) for s in range(2)]
    assert not hint.split_backward


def test_pipelining_csv_with_split_backward_and_errors(tmp_path):
    zb = tmp_path / "zb.csv"
    zb.write_text("0F0,0F1,0I0,0I1,0W0,0W1\n1F0,1I0,1W0,1F1,1I1,1W1\n")
    result = simulate(ArbiterConfig(hint=str(zb)), Topology(2), 2,
                      sample_realization(Variability(), Topology(2), 2, seed=0))
    assert any(t.kind is Kind.W for t in result.orders[0])
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0X0\n1F0\n")
    with pytest.raises(HintError, match="unknown action '0X0'"):
        make_hint(str(bad))
    v_shape = tmp_path / "v.csv"
    v_shape.write_text("0F0,3F0\n1F0,2F0\n")  # ZBV places stage 3 on rank 0
    with pytest.raises(HintError, match="only loop placement"):
        make_hint(str(v_shape))
    mixed = tmp_path / "mixed.csv"
    mixed.write_text("0F0,0B0,0I1\n1F0\n")
    with pytest.raises(HintError, match="mixes full backwards"):
        make_hint(str(mixed))
