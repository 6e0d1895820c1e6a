"""What the launcher does for Megatron-LM's --inprocess-restart (megatron_lm/inprocess.py), what a resumed
run resumed from (megatron_lm/resume.py), and the ledger's per-disruption checkpoint kind, restart
mechanism and recovery / checkpoint-load split (goodput accounting and report).

The runs themselves: tests/distributed/test_inprocess_restart.py (emulated NVRx) and
tests/e2e/test_inprocess_restart_e2e.py (Megatron-LM + NVRx).
"""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
from argparse import Namespace
from typing import Any, Optional

import pytest

from megatron_rrfp.goodput import GoodputRecorder, goodput_report
from megatron_rrfp.goodput.cli import format_report
from megatron_rrfp.megatron_lm import inprocess, resume


class FakeClock:
    def __init__(self, wall0: float, mono0: float) -> None:
        self.wall0, self.mono0, self.t = wall0, mono0, 0.0

    def __call__(self):
        return self.wall0 + self.t, self.mono0 + self.t


def _two_failures(path: str) -> None:
    """Process 1: iterations 1-6 (1 s each), a local save at 2, 4 and 6 (0.5 s); iteration 7 cut at 10 s.
    In-process restart: the same process loads the local checkpoint of 6 (1 s) at 12 s, iterations 7-9,
    a fault in 10 at 16.5 s. Process 2 (a requeue, persistent checkpoint of 8) starts at 30 s."""
    clock = FakeClock(1000.0, 50.0)
    recorder = GoodputRecorder(path, rank=0, world=1, job="drill", clock=clock)
    recorder.job_start()
    for it in range(1, 7):
        recorder.iteration_start(it)
        clock.t += 1.0
        recorder.iteration(it, tokens=100)
        if it % 2 == 0:
            with recorder.checkpoint_save(it):
                clock.t += 0.5
    recorder.iteration_start(7)
    clock.t = 10.0
    recorder.disruption("RankShouldRestart", "Interruption.EXCEPTION on ranks={1}", rank=1)
    recorder.close()
    recorder = GoodputRecorder(path, rank=0, world=1, job="drill", clock=clock)  # same process, new session
    recorder.job_start()
    clock.t = 12.0
    with recorder.checkpoint_load():
        clock.t = 13.0
    recorder.restart(6, checkpoint="local", mechanism="in-process")
    for it in range(7, 10):
        recorder.iteration_start(it)
        clock.t += 1.0
        recorder.iteration(it, tokens=100)
    recorder.iteration_start(10)
    clock.t = 16.5
    recorder.disruption("RuntimeError", "injected", rank=0)
    recorder.close()
    clock = FakeClock(1030.0, 900.0)
    recorder = GoodputRecorder(path, rank=0, world=1, job="drill", clock=clock)
    recorder.job_start()
    clock.t = 2.0
    with recorder.checkpoint_load():
        clock.t = 5.0
    recorder.restart(8, checkpoint="persistent", mechanism="requeue")
    recorder.iteration_start(9)
    clock.t = 6.0
    recorder.iteration(9, tokens=100)
    recorder.job_end()


def test_each_disruption_names_its_checkpoint_kind_and_restart_mechanism_and_splits_the_time_to_resume(tmp_path):
    path = str(tmp_path / "job.db")
    _two_failures(path)
    report = goodput_report(path)
    first, second = report.disruptions
    assert (first.checkpoint, first.mechanism, first.resumed_from, first.wasted_iterations) == \
        ("local", "in-process", 6, 0)
    assert first.time_to_resume_s == pytest.approx(3.0) and first.load_s == pytest.approx(1.0)
    assert first.recovery_s == pytest.approx(2.0)
    assert (second.checkpoint, second.mechanism, second.resumed_from, second.wasted_iterations) == \
        ("persistent", "requeue", 8, 1)  # iteration 9 was done and redone
    assert second.load_s == pytest.approx(3.0) and second.time_to_resume_s == pytest.approx(1030 + 5 - 1016.5)
    total = report.disruptions_total()
    assert total["wasted_iterations"] == 1 and total["checkpoint_load_s"] == pytest.approx(4.0)
    assert total["by_mechanism"] == {"in-process": 1, "requeue": 1}
    assert total["by_checkpoint"] == {"local": 1, "persistent": 1}
    text = format_report(report)
    assert "(in-process restart, local checkpoint)" in text and "(requeue restart, persistent checkpoint)" in text
    assert "recovery 2.0 s, checkpoint load 1.0 s" in text and "in total: 1 iteration redone" in text
    as_json = report.to_dict()
    assert as_json["disruptions"][0]["mechanism"] == "in-process"
    assert as_json["disruptions_total"]["by_checkpoint"] == {"local": 1, "persistent": 1}


def test_a_restart_without_kind_or_mechanism_still_reads(tmp_path):
    path = str(tmp_path / "job.db")
    clock = FakeClock(0.0, 0.0)
    recorder = GoodputRecorder(path, rank=0, world=1, clock=clock)
    recorder.job_start()
    recorder.iteration_start(1)
    clock.t = 1.0
    recorder.disruption("RuntimeError", "x")
    recorder.restart(0)
    recorder.job_end()
    (d,) = goodput_report(path).disruptions
    assert d.checkpoint is None and d.mechanism is None


def test_checkpoint_kind_follows_megatrons_choice(tmp_path):
    load, local = tmp_path / "ckpt", tmp_path / "local"
    load.mkdir()
    local.mkdir()
    (load / "latest_checkpointed_iteration.txt").write_text("20")
    persistent = Namespace(load=str(load), non_persistent_ckpt_type=None)
    assert resume.checkpoint_kind(persistent, 20) == "persistent"
    with_local = Namespace(load=str(load), non_persistent_ckpt_type="local", non_persistent_local_ckpt_dir=str(local))
    assert resume.checkpoint_kind(with_local, 24) == "local"
    assert resume.checkpoint_kind(with_local, 20) == "persistent"  # no local checkpoint there
    (local / "iter_0000020").mkdir()
    assert resume.checkpoint_kind(with_local, 20) == "local"  # Megatron prefers local at the same iteration
    assert resume.persistent_iteration(str(tmp_path / "none")) is None


def test_restart_mechanism_is_the_innermost_layer():
    assert resume.restart_mechanism(Namespace(iteration=2), {"SLURM_RESTART_COUNT": "1"}) == "in-process"
    assert resume.restart_mechanism(Namespace(iteration=0), {"TORCHELASTIC_RESTART_COUNT": "1"}) == "in-job"
    assert resume.restart_mechanism(None, {"TORCHELASTIC_RESTART_COUNT": "0", "SLURM_RESTART_COUNT": "2"}) == "requeue"
    assert resume.restart_mechanism(None, {}) == "relaunch"


class CallWrapper:  # what NVRx's inprocess.CallWrapper is to the injection: a class named in an annotation
    iteration = 0


def test_the_call_wrapper_annotation_is_repaired_where_megatron_names_any(monkeypatch):
    monkeypatch.setattr(inprocess, "call_wrapper_class", lambda: CallWrapper)

    def pretrain_019(cfg, store=None, inprocess_call_wrapper: Optional[Any] = None):  # core_v0.18+
        return inprocess_call_wrapper

    def entry(*args, **kwargs):
        return pretrain_019(*args, **kwargs)

    pretrain_019.__annotations__["inprocess_call_wrapper"] = Optional[Any]  # a real annotation, not this file's string
    entry.__wrapped__ = pretrain_019
    assert inprocess.inject_call_wrapper(entry)
    annotation = inspect.signature(entry).parameters["inprocess_call_wrapper"].annotation
    assert CallWrapper in annotation.__args__
    assert not inprocess.inject_call_wrapper(entry)  # once

    def pretrain_016(cfg, inprocess_call_wrapper: Optional[CallWrapper] = None):  # already right
        return None

    pretrain_016.__annotations__["inprocess_call_wrapper"] = Optional[CallWrapper]
    assert not inprocess.inject_call_wrapper(pretrain_016)


def test_node_granularity_is_refused_where_a_host_runs_another_number_of_ranks_than_devices(monkeypatch):
    import torch

    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(torch.cuda.device_count() + 2))
    with pytest.raises(ValueError, match="use --inprocess-granularity rank"):
        inprocess.check_granularity(Namespace(inprocess_restart=True, inprocess_granularity="node"))
    inprocess.check_granularity(Namespace(inprocess_restart=True, inprocess_granularity="rank"))
    assert inprocess.prepare(Namespace(inprocess_restart=False), None, cpu=True) == []


def _conflict_in(tmp_path, nvrx_version: str, with_init: bool, min_version: Optional[str]) -> Optional[str]:
    """nvrx_conflict() in a fresh interpreter that finds a planted NVRx and megatron tree first."""
    site = tmp_path / "site"
    (site / "nvidia_resiliency_ext").mkdir(parents=True)
    if with_init:
        (site / "nvidia_resiliency_ext" / "__init__.py").write_text("__version__ = 'x'\n")
    info = site / f"nvidia_resiliency_ext-{nvrx_version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: nvidia-resiliency-ext\nVersion: {nvrx_version}\n")
    strategies = tmp_path / "tree" / "megatron" / "core" / "dist_checkpointing" / "strategies"
    strategies.mkdir(parents=True)
    (tmp_path / "tree" / "megatron" / "__init__.py").write_text("")
    if min_version is not None:
        (strategies / "nvrx.py").write_text(f'NVRX_MIN_VERSION = "{min_version}"\n')
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(tmp_path / "tree")!r}, {str(site)!r}]
        from megatron_rrfp.megatron_lm.inprocess import nvrx_conflict
        print(nvrx_conflict())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    text = out.stdout.strip()
    return None if text == "None" else text


def test_an_nvrx_the_megatron_core_about_to_be_imported_rejects_is_named_before_the_import(tmp_path):
    message = _conflict_in(tmp_path / "a", "0.4.1", with_init=False, min_version="0.6.0")
    assert message is not None and "nvidia-resiliency-ext 0.4.1 is installed" in message
    assert "pip install 'nvidia-resiliency-ext>=0.6.0'" in message
    assert _conflict_in(tmp_path / "b", "0.7.0", with_init=True, min_version="0.6.0") is None
    assert _conflict_in(tmp_path / "c", "0.4.1", with_init=False, min_version=None) is None  # 0.16-like tree


def test_the_parsed_flags_come_back_to_a_pretrain_that_does_not_parse_them(monkeypatch):
    global_vars = pytest.importorskip("megatron.training.global_vars",
                                      reason="megatron.training ships with megatron-core 0.19's wheel only")
    keeper = inprocess.ArgsOnReentry()
    given = []  # what set_global_variables (tokenizer, timers, writers from the args) was handed
    monkeypatch.setattr(global_vars, "set_global_variables",
                        lambda args: (given.append(args), global_vars.set_args(args)))

    def pretrain(cfg_container, store=None):  # core_v0.18+: parsed before pretrain
        return None

    def pretrain_parsing(extra_args_provider=None, args_defaults=None):  # 0.16.x: parses them itself
        return None

    args = Namespace(inprocess_restart=True, vocab_size=8)
    global_vars.destroy_global_vars()
    global_vars.set_args(args)
    try:
        assert not keeper.enter(pretrain) and keeper.snapshot is not args and keeper.snapshot == args
        global_vars.destroy_global_vars()  # Megatron's finalize after a fault
        assert not keeper.enter(pretrain_parsing) and given == []  # left alone: it parses
        assert keeper.enter(pretrain)
        assert given == [args] and given[0] is not args and global_vars.get_args() is given[0]
        global_vars.get_args().vocab_size = 9  # the run changes its args; a second restart still gets the first call's
        global_vars.destroy_global_vars()
        assert keeper.enter(pretrain) and global_vars.get_args().vocab_size == 8
    finally:
        global_vars.destroy_global_vars()
