"""Chrome/Perfetto trace files of simulated and measured runs.

One span = (rank, name, category, start_s, end_s). ``pid`` is the rank and ``name`` the
action string ("0F3"), so a simulated and a measured run open side by side in
chrome://tracing or ui.perfetto.dev. Categories: F, B, W (compute), wait (blocked on
readiness), backpressure, agree (TP agreement), send, recv.

Flow arrows: a task span whose ``args["flow_out"]`` lists (message key, seconds from the
span's start to the send) pairs (``message_key``) and a "recv" span with the same key in
``args["flow_in"]`` are joined by an arrow from the send (inside the sending task) to the
start of the receive (Perfetto: click a task, follow its arrow).
Arrows are drawn only when both ends are in the file (a merged, common-clock trace:
``trace/merge.py``).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional

COLORS = {
    "F": "#4C72B0", "B": "#DD8452", "W": "#55A868", "wait": "#DDDDDD", "backpressure": "#C44E52",
    "agree": "#8172B3", "send": "#937860", "recv": "#DA8BC3", "other": "#8C8C8C",
}


@dataclass(slots=True)
class Span:
    rank: int
    name: str
    category: str
    start: float
    end: float
    args: dict = field(default_factory=dict)


def message_key(src: int, dst: int, kind: str, microbatch: int, chunk: int) -> str:
    """The same string on the sending and the receiving rank (``chunk``: the receiver's)."""
    return f"{src}>{dst} {kind} mb{microbatch} c{chunk}"


def spans_from_simulation(trace: Iterable[tuple], time_unit_s: float = 1.0) -> list[Span]:
    """Simulator trace tuples (stage, task, start, end) -> spans, scaled to seconds."""
    return [Span(stage, str(task), task.kind.value, start * time_unit_s, end * time_unit_s)
            for stage, task, start, end in trace]


def write_chrome_trace(spans: Iterable[Span], path: str, *, metadata: Optional[dict] = None,
                       rank_labels: Optional[dict[int, str]] = None) -> str:
    spans = list(spans)
    events = []
    for rank in sorted({s.rank for s in spans}):
        label = (rank_labels or {}).get(rank, f"rank {rank}")
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": label}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
    for span in spans:
        events.append({
            "name": span.name, "cat": span.category, "ph": "X", "pid": span.rank, "tid": _tid(span),
            "ts": span.start * 1e6, "dur": max(span.end - span.start, 0.0) * 1e6, "args": span.args,
        })
    events += _flow_events(spans)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms", "otherData": metadata or {}}, handle)
    return path


def _tid(span: Span) -> int:
    return 1 if span.category in ("send", "recv") else 0


def _flow_events(spans: list[Span]) -> list[dict]:
    """Chrome "s"/"f" flow pairs from each sending task's end to its message's receive."""
    receives = {span.args["flow_in"]: span for span in spans if "flow_in" in span.args}
    events, ids = [], {}
    for span in spans:
        for key, sent in span.args.get("flow_out", ()):
            recv = receives.get(key)
            if recv is None:
                continue
            flow = ids.setdefault(key, len(ids) + 1)
            inside = min(span.start + max(sent, 0.0), span.end)  # binds to the sending task's slice
            events.append({"name": "p2p", "cat": "p2p", "ph": "s", "id": flow, "pid": span.rank, "tid": _tid(span),
                           "ts": inside * 1e6, "args": {"message": key}})
            events.append({"name": "p2p", "cat": "p2p", "ph": "f", "bp": "e", "id": flow, "pid": recv.rank,
                           "tid": _tid(recv), "ts": recv.start * 1e6, "args": {"message": key}})
    return events
