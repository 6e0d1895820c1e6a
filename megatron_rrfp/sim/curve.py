"""The speedup-vs-memory trade-off curve of a `megatron-rrfp simulate --buffer-limit 1x,2x,..`
study, as a picture: the curve a user needs to pick a buffer limit."""
from __future__ import annotations

import os

from .simulator import STRICT_SUFFIX

_AXIS_LABELS = {
    "peak_activation_mb": "peak activation memory, MB (max over ranks)",
    "speedup_vs_megatron_1f1b": "measured speedup over Megatron's schedule",
}


def plot_tradeoff(tradeoff: dict, path: str) -> str:
    """Speedup over strict 1F1B against peak in-flight activations (x Megatron's), one line
    per readiness-first policy, one marker per strict (fixed-order) policy. A trade-off with
    ``axes`` ({x, y, title}: point keys, as `bench` writes) is drawn on those instead; names in
    its ``fixed_order`` are marked like strict policies."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes = tradeoff.get("axes", {})
    x_key, y_key = axes.get("x", "peak_in_flight"), axes.get("y", "speedup_vs_1f1b_strict")
    one_x = tradeoff["megatron_peak_in_flight"] if x_key == "peak_in_flight" else None
    first = tradeoff["studies"][0]
    fig, axis = plt.subplots(figsize=(7, 4.5))
    strict_markers = iter("sD^vP*X")
    fixed = set(tradeoff.get("fixed_order", ()))
    for name, points in tradeoff["curve"].items():
        xs = [p[x_key] / one_x if one_x else p[x_key] for p in points]
        ys = [p[y_key] for p in points]
        if name.endswith(STRICT_SUFFIX) or name in fixed:  # fixed orders: black markers, so colours stay with the lines
            axis.scatter(xs, ys, marker=next(strict_markers, "o"), s=45, color="black", label=name, zorder=3)
        else:
            axis.plot(xs, ys, marker="o", label=name)
    if x_key == "peak_in_flight":
        axis.axvline(1.0 if one_x else 0, color="grey", linewidth=0.8, linestyle=":")
        axis.set_xlabel("peak (microbatch, chunk) activations in flight, x Megatron's" if one_x
                        else "peak (microbatch, chunk) activations in flight")
    else:
        if tradeoff.get(f"megatron_{x_key}") is not None:  # Megatron's own figure: the 1x line
            axis.axvline(tradeoff[f"megatron_{x_key}"], color="grey", linewidth=0.8, linestyle=":")
        axis.set_xlabel(_AXIS_LABELS.get(x_key, x_key))
    axis.set_ylabel(_AXIS_LABELS.get(y_key, "speedup over strict 1F1B (median of seeds)"))
    axis.set_title(axes.get("title") or f"PP={first['pipeline_size']} M={first['num_microbatches']} "
                   f"C={first['num_chunks']}, {len(first['seeds'])} seeds: speedup vs memory", fontsize=10)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
