"""Tasks as profilers and traces see them, in one process (loopback transport, two stages):
every task is a torch.profiler range named like "0F3" in an exported profiler trace, and a
merged Chrome/Perfetto trace joins every send to its receive with a flow arrow that runs
forward in time."""
from __future__ import annotations

import json
import threading

import pytest

from helpers.loopback import LoopbackNetwork, RecordingWork
from megatron_rrfp.policy.actions import Kind, Task
from megatron_rrfp.policy.arbiter import ArbiterConfig
from megatron_rrfp.policy.plan import Plan
from megatron_rrfp.policy.topology import Topology
from megatron_rrfp.runtime.executor import PipelineIteration
from megatron_rrfp.trace import write_chrome_trace
from megatron_rrfp.trace.merge import write_merged_trace

pytestmark = pytest.mark.timeout(120)
M = 4


def run_two_stages(record_spans: bool):
    """Stage 1 on a thread, stage 0 on the calling thread (where the profiler runs)."""
    topology, network = Topology(2), LoopbackNetwork([0, 1])
    plan = Plan.build(ArbiterConfig(hint="bf"), topology, M)
    stages = [PipelineIteration(work=RecordingWork(s), arbiter=plan.arbiter(s, forward_only=False),
                                topology=topology, stage=s, stage_ranks=[0, 1], transport=network.transport(s),
                                inbox=network.inboxes[s], agreement=None, timeout_s=20, forward_only=False,
                                record_spans=record_spans) for s in (0, 1)]
    reports: dict = {}
    other = threading.Thread(target=lambda: reports.setdefault(1, stages[1].run()))
    other.start()
    reports[0] = stages[0].run()
    other.join(20)
    assert set(reports) == {0, 1}
    return reports


def test_every_task_is_a_named_profiler_range(tmp_path):
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        run_two_stages(record_spans=False)
    path = tmp_path / "profile.json"
    profiler.export_chrome_trace(str(path))
    names = {event.get("name") for event in json.loads(path.read_text())["traceEvents"]}
    expected = {str(Task(kind, mb)) for kind in (Kind.F, Kind.B) for mb in range(M)}
    assert expected <= names, sorted(n for n in names if n and n[:1].isdigit())


def test_merged_trace_draws_an_arrow_from_each_send_to_its_receive(tmp_path):
    reports = run_two_stages(record_spans=True)
    origin = min(r.started_at for r in reports.values())  # one process: one clock already
    spans = []
    for report in reports.values():
        for span in report.spans:
            span.start += report.started_at - origin
            span.end += report.started_at - origin
            spans.append(span)
    events = json.loads(open(write_chrome_trace(spans, str(tmp_path / "merged.json"))).read())["traceEvents"]
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert starts.keys() == ends.keys() and len(starts) == 2 * M  # M activations down, M gradients up
    for flow, start in starts.items():
        end = ends[flow]
        assert (start["pid"], end["pid"]) in ((0, 1), (1, 0)) and end["bp"] == "e"
        assert end["ts"] >= start["ts"] - 1.0, (start, end)  # microseconds: the receive follows the send
    receives = [e for e in events if e["ph"] == "X" and e["cat"] == "recv"]
    assert {e["name"] for e in receives if e["pid"] == 1} == {f"recv 0F{mb}" for mb in range(M)}
    assert all(e["tid"] == 1 for e in receives)

    # write_merged_trace without a process group: this process alone, on its own clock
    alone = write_merged_trace(reports[0].spans, reports[0].started_at, str(tmp_path / "alone.json"))
    events = json.loads(open(alone).read())["traceEvents"]
    assert not [e for e in events if e["ph"] in ("s", "f")]  # the other ends are not in the file
    assert {e["name"] for e in events if e["ph"] == "X" and e["cat"] == "F"} == {f"0F{mb}" for mb in range(M)}
