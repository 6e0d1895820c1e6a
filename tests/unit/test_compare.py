"""``megatron-rrfp compare A.json B.json``: the Markdown table of two bench runs, including a
bench.json from before activation-memory figures existed (its memory cells read n/a)."""
from __future__ import annotations

import json

import pytest

from megatron_rrfp.cli import main


def bench_report(times: dict, *, variability="j3", memory: dict | None = None) -> dict:
    """The shape ``megatron-rrfp bench`` writes (bench/run.py summarize)."""
    baseline = times["megatron-1f1b"]
    runs = []
    for schedule, seconds in times.items():
        run = {"schedule": schedule, "iteration_time_s": {"median": seconds, "p90": seconds, "all": [seconds]},
               "speedup_vs_megatron_1f1b": baseline / seconds, "bubble_fraction": 0.1 * seconds,
               "tokens_per_s": 1000 / seconds}
        if memory is not None:
            run["peak_activation_bytes"] = {"max_over_ranks": memory[schedule][0], "per_rank": [memory[schedule][0]]}
            run["peak_in_flight"] = {"max_over_ranks": memory[schedule][1], "per_rank": [memory[schedule][1]]}
        runs.append(run)
    config = {"model": "gpt", "pipeline_size": 4, "num_chunks": 1, "tensor_parallel": 1, "data_parallel": 1,
              "num_microbatches": 16, "variability": variability, "f0_ms": 50.0, "iterations": 5,
              "out_dir": "somewhere", "buffer_limit": 32}
    return {"config": config, "runs": runs}


def test_two_runs_side_by_side(tmp_path, capsys):
    old = bench_report({"megatron-1f1b": 4.0, "rrfp-bf": 3.4})  # no memory figures yet
    new = bench_report({"megatron-1f1b": 4.0, "rrfp-bf": 3.2, "rrfp-bfw": 3.0}, variability="j2",
                       memory={"megatron-1f1b": (2e6, 4), "rrfp-bf": (2.5e6, 5), "rrfp-bfw": (3e6, 6)})
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "bench.json").write_text(json.dumps(old))  # a bench --out directory works too
    (tmp_path / "b.json").write_text(json.dumps(new))
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("| `")}
    assert list(rows) == ["`megatron-1f1b`", "`rrfp-bf`", "`rrfp-bfw`"]
    assert rows["`rrfp-bf`"] == ["3.400 → 3.200", "**1.06×**", "1.18× → 1.25×", "34.0% → 32.0%", "n/a → 2.50",
                                 "n/a", "n/a → 5"]
    assert rows["`rrfp-bfw`"][:2] == ["n/a → 3.000", "n/a"]  # only B ran it
    assert "settings differ: variability j3 → j2" in out and "out_dir" not in out
    assert sum(line.startswith("|---") for line in out.splitlines()) == 1
    assert "Peak activation memory: not comparable (not measured in both runs)." in out
    assert main(["compare", str(tmp_path / "b.json"), str(tmp_path / "b.json")]) == 0
    assert "Peak activation memory: equal within 1% for `megatron-1f1b`, `rrfp-bf`, `rrfp-bfw`." \
        in capsys.readouterr().out


def test_a_file_that_is_not_a_bench_report_is_named(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    assert main(["compare", str(bad), str(bad)]) == 2
    assert f"{bad}: not a megatron-rrfp bench report" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["compare", str(bad)])  # argparse: B.json missing
