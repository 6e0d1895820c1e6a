"""Timelines: Chrome/Perfetto trace files and PNG pictures, for simulated and measured runs.

One span = (rank, name, category, start_s, end_s). ``pid`` is the rank and ``name`` the
action string ("0F3"), so a simulated and a measured run open side by side in
chrome://tracing or ui.perfetto.dev. Categories: F, B, W (compute), wait (blocked on
readiness), backpressure, agree (TP agreement), send, recv.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Iterable, Optional

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
            "name": span.name, "cat": span.category, "ph": "X", "pid": span.rank,
            "tid": 1 if span.category in ("send", "recv") else 0,
            "ts": span.start * 1e6, "dur": max(span.end - span.start, 0.0) * 1e6, "args": span.args,
        })
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms", "otherData": metadata or {}}, handle)
    return path


def plot_timelines(runs: dict[str, list[Span]], path: str, *, title: str = "", time_unit: str = "s") -> str:
    """One panel per run (shared time axis), one row per rank; F/B/W labelled with the
    microbatch index where the bar is wide enough."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = list(runs)
    ranks = max((max((s.rank for s in spans), default=0) for spans in runs.values()), default=0) + 1
    horizon = max((max((s.end for s in spans), default=0.0) for spans in runs.values()), default=1.0) or 1.0
    fig, axes = plt.subplots(len(names), 1, figsize=(14, 0.9 + 0.32 * ranks * len(names) + 0.5 * len(names)),
                             sharex=True, squeeze=False)
    used = set()
    for axis, name in zip(axes[:, 0], names):
        for span in runs[name]:
            if span.category in ("send", "recv"):
                continue
            used.add(span.category)
            width = span.end - span.start
            axis.barh(span.rank, width, left=span.start, height=0.8,
                      color=COLORS.get(span.category, COLORS["other"]), edgecolor="white", linewidth=0.3)
            if span.category in ("F", "B", "W") and width > horizon / 90:
                axis.text(span.start + width / 2, span.rank, span.name[1:].lstrip("FBW"),
                          ha="center", va="center", fontsize=5, color="white")
        spans = runs[name]
        end = max((s.end for s in spans), default=0.0)
        axis.set_title(f"{name} — makespan {end:.3f} {time_unit}", fontsize=9, loc="left")
        axis.set_yticks(range(ranks))
        axis.set_yticklabels([f"stage {r}" for r in range(ranks)], fontsize=7)
        axis.invert_yaxis()
        axis.set_xlim(0, horizon * 1.01)
    axes[-1, 0].set_xlabel(f"time ({time_unit})")
    handles = [Patch(color=COLORS[c], label=c) for c in COLORS if c in used]
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
