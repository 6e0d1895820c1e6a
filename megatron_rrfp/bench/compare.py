"""``megatron-rrfp compare A.json B.json``: two benchmark runs side by side, as a Markdown
table to paste into a pull request.

    megatron-rrfp bench ... --json before.json      # on main
    megatron-rrfp bench ... --json after.json       # on your branch
    megatron-rrfp compare before.json after.json

One row per schedule found in either file: median iteration time A -> B and B's speedup
over A (A time / B time), each run's speedup over Megatron's 1F1B, bubble fraction, and the
peak activation memory and forwards in flight (max over ranks) with B / A; a line under the
table says for which schedules memory was equal. A field a file does not have (an older
bench.json without memory figures, a schedule only one run has) is shown as "n/a". Lines
above the table say what differs between the two runs' settings, so a reader knows whether
the comparison is like for like.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from ..options import add_command, option

NA = "n/a"
_IGNORED_CONFIG = ("out_dir", "timeout_s", "goodput_ledger")  # where and how long, not what was measured


@dataclass(kw_only=True, slots=True)
class CompareOptions:
    """``megatron-rrfp compare``'s command line."""

    a: str = option(None, "the baseline run (bench --json, or its out dir's bench.json)", positional=True,
                    metavar="A.json")
    b: str = option(None, "the run to compare with it", positional=True, metavar="B.json")


def add_compare_parser(sub) -> argparse.ArgumentParser:
    return add_command(sub, "compare", CompareOptions, _run,
                       help="two bench.json files side by side (time, speedup, bubble, memory)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)


def _run(options: CompareOptions) -> int:
    print(compare(load(options.a), load(options.b), names=(options.a, options.b)))
    return 0


def load(path: str) -> dict:
    """A bench report; a directory means its bench.json. ValueError naming the file otherwise."""
    if os.path.isdir(path):
        path = os.path.join(path, "bench.json")
    try:
        with open(path, encoding="utf-8") as handle:
            report = json.load(handle)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file (give a bench.json written by megatron-rrfp bench)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(report, dict) or not isinstance(report.get("runs"), list):
        raise ValueError(f"{path}: not a megatron-rrfp bench report (no 'runs' list)")
    return report


def compare(a: dict, b: dict, *, names: tuple[str, str] = ("A", "B")) -> str:
    runs_a, runs_b = _by_schedule(a), _by_schedule(b)
    schedules = list(runs_a) + [s for s in runs_b if s not in runs_a]
    lines = [f"A: {names[0]}  {_describe(a)}", f"B: {names[1]}  {_describe(b)}"]
    differences = _config_differences(a.get("config") or {}, b.get("config") or {})
    lines.append("settings differ: " + ", ".join(differences) if differences else "settings: identical")
    lines += ["", "| schedule | time A → B (s) | B vs A | speedup vs Megatron 1F1B A → B | bubble A → B "
                  "| peak activations A → B (MB) | B / A | in flight A → B |",
              "|---|---|---|---|---|---|---|---|"]
    for schedule in schedules:
        ra, rb = runs_a.get(schedule, {}), runs_b.get(schedule, {})
        time_a, time_b = _median_time(ra), _median_time(rb)
        mem_a = _max_over_ranks(ra.get("peak_activation_bytes"))
        mem_b = _max_over_ranks(rb.get("peak_activation_bytes"))
        cells = [
            f"`{schedule}`",
            _pair(time_a, time_b, "{:.3f}"),
            _ratio(time_a, time_b, "{:.2f}×", bold=True),  # B's speedup over A
            _pair(ra.get("speedup_vs_megatron_1f1b"), rb.get("speedup_vs_megatron_1f1b"), "{:.2f}×"),
            _pair(_percent(ra.get("bubble_fraction")), _percent(rb.get("bubble_fraction")), "{:.1f}%"),
            _pair(_mb(mem_a), _mb(mem_b), "{:.2f}"),
            _ratio(mem_b, mem_a, "{:.2f}×"),
            _pair(_max_over_ranks(ra.get("peak_in_flight")), _max_over_ranks(rb.get("peak_in_flight")), "{:.0f}"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", _memory_note(runs_a, runs_b, schedules),
              "B vs A: A's median iteration time / B's (> 1: B is faster). Peak activations: max over ranks "
              "of the schedule call's activation memory; B / A > 1: B held more. n/a: not in that file."]
    return "\n".join(lines)


def _memory_note(runs_a: dict, runs_b: dict, schedules: list[str], tolerance: float = 0.01) -> str:
    """Whether memory was equal: every speed figure is read beside its memory."""
    equal, differ = [], []
    for schedule in schedules:
        a = _max_over_ranks(runs_a.get(schedule, {}).get("peak_activation_bytes"))
        b = _max_over_ranks(runs_b.get(schedule, {}).get("peak_activation_bytes"))
        if a and b:
            (equal if abs(b / a - 1) <= tolerance else differ).append(f"`{schedule}` {b / a:.2f}×")
    if not equal and not differ:
        return "Peak activation memory: not comparable (not measured in both runs)."
    parts = ([f"equal within {100 * tolerance:g}% for {', '.join(s.split()[0] for s in equal)}"] if equal else []) \
        + ([f"different for {', '.join(differ)} (B / A)"] if differ else [])
    return "Peak activation memory: " + "; ".join(parts) + "."


# -- cells ------------------------------------------------------------------------------

def _by_schedule(report: dict) -> dict[str, dict]:
    return {str(run.get("schedule")): run for run in report["runs"] if isinstance(run, dict)}


def _median_time(run: dict) -> Optional[float]:
    times = run.get("iteration_time_s")
    return times.get("median") if isinstance(times, dict) else None


def _max_over_ranks(value: Any) -> Optional[float]:
    """A number, or bench's {"max_over_ranks": ...}; None when absent."""
    if isinstance(value, dict):
        value = value.get("max_over_ranks")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _percent(fraction: Optional[float]) -> Optional[float]:
    return None if fraction is None else 100.0 * fraction


def _mb(value: Optional[float]) -> Optional[float]:
    return None if value is None else value / 1e6


def _fmt(value: Optional[float], spec: str) -> str:
    return NA if value is None else spec.format(value)


def _pair(a: Optional[float], b: Optional[float], spec: str) -> str:
    return f"{_fmt(a, spec)} → {_fmt(b, spec)}"


def _ratio(numerator: Optional[float], denominator: Optional[float], spec: str, bold: bool = False) -> str:
    if numerator is None or denominator is None or denominator == 0:
        return NA
    text = spec.format(numerator / denominator)
    return f"**{text}**" if bold else text


def _describe(report: dict) -> str:
    c = report.get("config") or {}
    if not c:
        return ""
    chunks = f" chunks={c['num_chunks']}" if c.get("num_chunks", 1) > 1 else ""
    return (f"{c.get('model')} PP={c.get('pipeline_size')}{chunks} TP={c.get('tensor_parallel')} "
            f"DP={c.get('data_parallel')} M={c.get('num_microbatches')} {c.get('variability')} "
            f"f0={c.get('f0_ms')} ms, median of {c.get('iterations')}")


def _config_differences(a: dict, b: dict) -> list[str]:
    keys = [k for k in list(a) + [k for k in b if k not in a] if k not in _IGNORED_CONFIG]
    return [f"{k} {_short(a.get(k, NA))} → {_short(b.get(k, NA))}" for k in keys if a.get(k, NA) != b.get(k, NA)]


def _short(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["add_compare_parser", "compare", "load"]
