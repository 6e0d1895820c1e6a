"""The speedup-vs-memory trade-off curve of a `megatron-rrfp simulate --buffer-limit 1x,2x,..`
study, as a picture: the curve a user needs to pick a buffer limit."""
from __future__ import annotations

import os

from .simulator import STRICT_SUFFIX


def plot_tradeoff(tradeoff: dict, path: str) -> str:
    """Speedup over strict 1F1B against peak in-flight activations (x Megatron's), one line
    per readiness-first policy, one marker per strict (fixed-order) policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    one_x = tradeoff["megatron_peak_in_flight"]
    first = tradeoff["studies"][0]
    fig, axis = plt.subplots(figsize=(7, 4.5))
    strict_markers = iter("sD^vP*X")
    for name, points in tradeoff["curve"].items():
        xs = [p["peak_in_flight"] / one_x if one_x else p["peak_in_flight"] for p in points]
        ys = [p["speedup_vs_1f1b_strict"] for p in points]
        if name.endswith(STRICT_SUFFIX):  # fixed orders: black markers, so colours stay with the lines
            axis.scatter(xs, ys, marker=next(strict_markers, "o"), s=45, color="black", label=name, zorder=3)
        else:
            axis.plot(xs, ys, marker="o", label=name)
    axis.axvline(1.0 if one_x else 0, color="grey", linewidth=0.8, linestyle=":")
    axis.set_xlabel("peak (microbatch, chunk) activations in flight, x Megatron's" if one_x
                    else "peak (microbatch, chunk) activations in flight")
    axis.set_ylabel("speedup over strict 1F1B (median of seeds)")
    axis.set_title(f"PP={first['pipeline_size']} M={first['num_microbatches']} C={first['num_chunks']}, "
                   f"{len(first['seeds'])} seeds: speedup vs memory", fontsize=10)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
