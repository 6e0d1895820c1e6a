"""PNG timelines: one panel per run, one row per rank, what every stage did and when."""
from __future__ import annotations

import os

from .chrome import COLORS, Span


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
