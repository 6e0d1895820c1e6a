"""``megatron-rrfp goodput LEDGER [--json PATH] [--png PATH]``: where did the job's time go?

Reads the SQLite ledger a job wrote with ``--rrfp-goodput-ledger`` (it may still be
running: the report then covers what is committed so far), prints the table, optionally
writes the figures as JSON and a chart (goodput over time above, badput stacked below).
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Optional

from ..checks import integer
from ..options import add_command, option
from .accounting import CATEGORIES, GoodputReport, goodput_report

BINS = integer(1, 10_000)

LABELS = {
    "startup": "startup", "checkpoint_save": "checkpoint save", "checkpoint_load": "checkpoint load",
    "data_loading": "data loading", "wasted_progress": "wasted progress (lost work)", "recovery": "recovery",
    "pipeline_bubble": "pipeline bubbles", "tp_coordination": "TP coordination", "other": "other",
}
COLORS = {
    "productive": "#55A868", "startup": "#8C8C8C", "checkpoint_save": "#4C72B0", "checkpoint_load": "#64B5CD",
    "data_loading": "#CCB974", "wasted_progress": "#C44E52", "recovery": "#DD8452", "pipeline_bubble": "#DDDDDD",
    "tp_coordination": "#8172B3", "other": "#DA8BC3",
}
FIELD_LABELS = {
    "compute_s": "F/B compute", "wait_s": "bubble (wait on readiness)", "backpressure_s": "backpressure",
    "agree_s": "TP agreement", "flush_s": "flush (last sends)", "data_wait_s": "data wait",
    "schedule_s": "schedule call (wall)",
}


@dataclass(kw_only=True, slots=True)
class GoodputOptions:
    """``megatron-rrfp goodput``'s command line."""

    ledger: str = option(None, "the SQLite file given to --rrfp-goodput-ledger", positional=True, metavar="LEDGER")
    json: Optional[str] = option(None, "write the figures as JSON", metavar="PATH")
    png: Optional[str] = option(None, "draw goodput over time and the stacked badput", metavar="PATH")
    bins: int = option(60, "time slices in the chart and JSON timeline", bound=BINS)


def add_goodput_parser(sub) -> None:
    add_command(sub, "goodput", GoodputOptions, run_goodput, help="goodput report of a job's ledger: where did the "
                "time go?", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)


def run_goodput(options: GoodputOptions) -> int:
    BINS.check("--bins", options.bins)
    report = goodput_report(options.ledger, bins=options.bins)  # LedgerError (a ValueError): one clear line
    print(format_report(report))
    if options.json:
        _makedirs_for(options.json)
        with open(options.json, "w", encoding="utf-8") as handle:
            json.dump(report.to_dict(), handle, indent=1)
        print(f"figures: {options.json}")
    if options.png:
        plot_goodput(report, options.png)
        print(f"chart: {options.png}")
    return 0


def format_report(report: GoodputReport) -> str:
    wall = report.wall_s
    share = (lambda s: f"{100 * s / wall:6.1f}%") if wall > 0 else (lambda s: "     -")
    plural = lambda n, word: f"{n} {word}{'' if n == 1 else ('es' if word.endswith('s') else 's')}"  # noqa: E731
    lines = [
        f"goodput ledger {report.path}" + (f"  (job {report.job})" if report.job else "")
        + ("  [job still running: up to the last committed event]" if report.live else ""),
        f"{plural(report.sessions, 'process')}, {plural(len(report.disruptions), 'disruption')}, "
        f"{plural(report.checkpoint_saves, 'checkpoint save')}",
        f"wall time {_duration(wall)}   goodput {100 * report.goodput:.1f}%   "
        f"goodput {report.goodput_tokens_per_s:,.1f} tokens/s (kept tokens / wall time)   "
        f"throughput {report.throughput_tokens_per_s:,.1f} tokens/s (all tokens / iteration time)",
        f"iterations: {report.count('kept') + report.count('wasted')} completed, {report.count('kept')} kept, "
        f"{report.count('wasted')} redone after a disruption, {report.count('incomplete')} cut short",
        "",
        f"{'where the time went':<30}{'seconds':>12}{'share':>9}",
        f"{'productive':<30}{report.productive_s:>12.2f}{share(report.productive_s)}",
        f"{'  F/B compute':<30}{report.fb_compute_s:>12.2f}{share(report.fb_compute_s)}",
        f"{'  rest (optimizer, unsplit...)':<30}{report.productive_s - report.fb_compute_s:>12.2f}"
        f"{share(report.productive_s - report.fb_compute_s)}",
    ]
    for name in CATEGORIES:
        lines.append(f"{LABELS[name]:<30}{report.badput[name]:>12.2f}{share(report.badput[name])}")
    lines.append(f"{'total (= wall time)':<30}{report.accounted_s:>12.2f}{share(report.accounted_s)}")
    if report.unmeasured_iterations:
        lines.append(f"note: {report.unmeasured_iterations} kept iterations had no RRFP breakdown (Megatron's own "
                     "schedule?): their bubbles and TP time are not observable and count as productive")
    fields = [f for f in FIELD_LABELS if f in report.breakdown]
    if fields:
        lines += ["", "per-iteration breakdown across ranks, seconds (mean over kept iterations)",
                  f"{'':<30}{'min':>10}{'median':>10}{'max':>10}"]
        for name in fields:
            row = report.breakdown[name]
            lines.append(f"{FIELD_LABELS[name]:<30}{row['min']:>10.4f}{row['median']:>10.4f}{row['max']:>10.4f}")
    if "iteration_s" in report.breakdown:
        row = report.breakdown["iteration_s"]
        lines.append(f"{'iteration (across iterations)':<30}"
                     f"{row['min']:>10.4f}{row['median']:>10.4f}{row['max']:>10.4f}")
    if "peak_activation_bytes" in report.breakdown:
        lines += ["", "peak activation memory across ranks (the largest over kept iterations)",
                  f"{'':<30}{'min':>10}{'median':>10}{'max':>10}"]
        row = report.breakdown["peak_activation_bytes"]
        lines.append(f"{'activations held, MB':<30}{row['min'] / 1e6:>10.2f}{row['median'] / 1e6:>10.2f}"
                     f"{row['max'] / 1e6:>10.2f}")
        if "peak_in_flight" in report.breakdown:
            row = report.breakdown["peak_in_flight"]
            lines.append(f"{'forwards in flight':<30}{row['min']:>10.0f}{row['median']:>10.0f}{row['max']:>10.0f}")
    if report.disruptions:
        lines += ["", "disruptions"]
        for d in report.disruptions:
            who = f" on rank {d.rank}" if d.rank is not None else ""
            how = ", ".join(x for x in (f"{d.mechanism} restart" if d.mechanism else "",
                                         f"{d.checkpoint} checkpoint" if d.checkpoint else "") if x)
            resumed = ("not resumed" if d.resumed_at_s is None else
                       f"training again {_duration(d.time_to_resume_s)} later (recovery "
                       f"{_duration(d.recovery_s)}, checkpoint load {_duration(d.load_s)})"
                       + (f", from iteration {d.resumed_from}" if d.resumed_from is not None else "")
                       + (f" ({how})" if how else ""))
            lines.append(f"  at {_duration(d.time_s)}: {d.kind}{who}{' (inferred)' if d.inferred else ''}; {resumed}; "
                         f"{plural(d.wasted_iterations, 'iteration')} redone, {d.wasted_s:.2f} s of work lost")
            if d.message:
                lines.append(f"      {d.message.splitlines()[0][:160]}")
        total = report.disruptions_total()
        if total["disruptions"] > 1:
            kinds = ", ".join(f"{n} {name}" for name, n in sorted(total["by_mechanism"].items()))
            lines.append(f"  in total: {plural(total['wasted_iterations'], 'iteration')} redone; "
                         f"{total['resumed']} resumed after {_duration(total['time_to_resume_s'])} (recovery "
                         f"{_duration(total['recovery_s'])}, checkpoint load {_duration(total['checkpoint_load_s'])})"
                         + (f"; restarts: {kinds}" if kinds else ""))
    return "\n".join(lines)


def plot_goodput(report: GoodputReport, path: str) -> str:
    """Top: goodput per time slice and cumulative. Bottom: badput shares per slice, stacked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = report.timeline
    scale, unit = _time_unit(report.wall_s)
    x = [(b["start_s"] + b["end_s"]) / 2 / scale for b in bins]
    width = [(b["end_s"] - b["start_s"]) / scale for b in bins]
    slice_s = [max(b["end_s"] - b["start_s"], 1e-12) for b in bins]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, height_ratios=(1, 1.4))
    goodput = [b["productive"] / s for b, s in zip(bins, slice_s)]
    done, total = 0.0, 0.0
    cumulative = []
    for b, s in zip(bins, slice_s):
        done, total = done + b["productive"], total + s
        cumulative.append(done / total)
    top.bar(x, goodput, width=width, color=COLORS["productive"], alpha=0.55, label="goodput per slice")
    top.plot(x, cumulative, color="black", linewidth=1.5, label="cumulative goodput")
    top.set_ylim(0, 1.05)
    top.set_ylabel("goodput (productive / wall)")
    top.set_title(f"{report.job or os.path.basename(report.path)} - goodput {100 * report.goodput:.1f}% over "
                  f"{_duration(report.wall_s)}; {report.goodput_tokens_per_s:,.0f} good tokens/s vs "
                  f"{report.throughput_tokens_per_s:,.0f} tokens/s throughput", fontsize=9, loc="left")
    top.legend(fontsize=8, loc="lower right")
    base = [0.0] * len(bins)
    for name in CATEGORIES:
        values = [b[name] / s for b, s in zip(bins, slice_s)]
        if any(v > 0 for v in values):
            bottom.bar(x, values, width=width, bottom=base, color=COLORS[name],
                       label=f"{LABELS[name]} {report.badput[name]:.1f} s")
            base = [a + v for a, v in zip(base, values)]
    for d in report.disruptions:
        for axis in (top, bottom):
            axis.axvline(d.time_s / scale, color=COLORS["wasted_progress"], linestyle="--", linewidth=1)
    bottom.set_ylim(0, 1.05)
    bottom.set_ylabel("badput share of each slice")
    bottom.set_xlabel(f"time since the job started ({unit})")
    bottom.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    _makedirs_for(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 3 * 3600:
        return 3600.0, "h"
    if seconds >= 3 * 60:
        return 60.0, "min"
    return 1.0, "s"


def _duration(seconds: float) -> str:
    scale, unit = _time_unit(seconds)
    return f"{seconds / scale:.1f} {unit}" if unit != "s" else f"{seconds:.1f} s"


def _makedirs_for(path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
