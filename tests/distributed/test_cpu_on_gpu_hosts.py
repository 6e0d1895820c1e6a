"""CPU runs on a GPU host: the processes a CPU command starts see no CUDA device, and every
CPU-or-CUDA decision follows the rank's process group, not whether a GPU is visible.

These run on CPU-only machines too: what they pin is the decision (the environment a rank is
given, the backend a device follows), which is what went wrong on GPU hosts.
"""
from __future__ import annotations

import argparse
import os

import pytest

from megatron_rrfp import cli
from megatron_rrfp.launch.env import cuda_hidden
from megatron_rrfp.launch.function import launch


def _what_a_rank_sees() -> dict:
    import torch

    from megatron_rrfp.cpu import enable_cpu_reference_schedules
    from megatron_rrfp.mcore.compat import pipeline_device

    return {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "cuda_available": torch.cuda.is_available(), "device": str(pipeline_device()),
            "redirected": enable_cpu_reference_schedules()}


def test_launched_ranks_see_no_gpu_whatever_the_launching_process_sees(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # as on a GPU host
    seen = launch(_what_a_rank_sees, world_size=2, timeout=120, init_megatron=False,
                  env={"CUDA_VISIBLE_DEVICES": "0"})  # even a caller's own choice: gloo ranks cannot use it
    for rank in seen:
        assert rank == {"CUDA_VISIBLE_DEVICES": "", "cuda_available": False, "device": "cpu", "redirected": True}


def test_the_pipeline_device_follows_the_process_group():
    import torch.distributed as dist

    from megatron_rrfp.mcore.compat import pipeline_device

    assert not dist.is_initialized()
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert pipeline_device().type == "cpu"  # gloo cannot send CUDA tensors, whatever is visible
    finally:
        dist.destroy_process_group()


def _namespace(command: str, **fields) -> argparse.Namespace:
    return argparse.Namespace(command=command, **fields)


@pytest.mark.parametrize("args, on_cpu", [
    (_namespace("demo", device="cpu"), True),
    (_namespace("bench", device="cuda"), False),
    (_namespace("train", cpu=True), True),
    (_namespace("train", cpu=False), False),
    (_namespace("simulate"), True),
    (_namespace("goodput"), True),
])
def test_which_commands_hide_the_gpu(args, on_cpu):
    assert cli.runs_on_cpu(args) is on_cpu


def test_a_cpu_command_hides_the_gpu_before_it_runs(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # as on a GPU host
    seen = []
    monkeypatch.setattr("megatron_rrfp.sim.cli._run_simulate", lambda args: seen.append(cuda_hidden()) or 0)
    assert cli.main(["simulate", "--pp", "2", "-m", "4"]) == 0
    assert seen == [True]


def test_demo_on_cuda_with_fewer_gpus_than_stages_is_refused_in_one_line(capsys):
    assert cli.main(["demo", "--device", "cuda", "--pp", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "--device cuda runs one rank per GPU" in err[0] and "4 GPUs needed" in err[0]
    assert "leave out --device cuda" in err[0]


def test_bench_through_torchs_launcher_gathers_every_ranks_figures(tmp_path):
    """``bench --device cuda``'s path (torch's launcher, one rank per device, figures gathered
    on rank 0), here on gloo ranks: what can run of it without GPUs."""
    from megatron_rrfp.bench.run import BenchConfig, _run_with_torch_launcher
    from megatron_rrfp.bench.summary import summarize

    config = BenchConfig(pipeline_size=2, num_microbatches=4, iterations=1, warmup=0, variability="j0", f0_ms=5.0,
                         schedules=["megatron-1f1b", "rrfp-default"], out_dir=str(tmp_path), timeout_s=300)
    config.validate()
    progress = tmp_path / "progress"
    progress.write_text("")
    per_rank = _run_with_torch_launcher(config, 2, str(progress), None)
    assert sorted(r["rank"] for r in per_rank) == [0, 1]
    assert progress.read_text().split()[-3:] == ["2", "2", "rrfp-default"]
    report = summarize(config, per_rank)
    assert [run["schedule"] for run in report["runs"]] == ["megatron-1f1b", "rrfp-default"]
