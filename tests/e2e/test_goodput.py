"""Goodput ledger, accounting, recorder hooks and the ``goodput`` command.

    python -m pytest tests/e2e/test_goodput.py -q

Synthetic ledgers use a fake clock, so every expected second is exact. The failure
tests use a real tmpfs when the test runs as root (``mount -t tmpfs``: a read-only one,
a 64 KiB one that fills up) and otherwise fall back to chmod / a simulated
``sqlite3.OperationalError('database or disk is full')``.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import time
import warnings
from types import SimpleNamespace

import pytest

from megatron_rrfp.goodput import (
    CATEGORIES,
    GoodputRecorder,
    LedgerBusyError,
    LedgerError,
    LedgerWarning,
    LedgerWriter,
    goodput_report,
    load_ledger,
)
from megatron_rrfp.goodput import writer as ledger_module
from megatron_rrfp.goodput.recorder import TIMER_NAMES, extend_timer_logging, publish_to_timers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class FakeClock:
    """(wall, monotonic) = (wall0 + t, mono0 + t); tests move ``t``."""

    def __init__(self, wall0: float, mono0: float) -> None:
        self.wall0, self.mono0, self.t = wall0, mono0, 0.0

    def __call__(self):
        return self.wall0 + self.t, self.mono0 + self.t


def breakdown(**fields):
    """An executor.IterationReport stand-in (the recorder reads these attributes only)."""
    values = dict(wall_s=0.9, compute_s=0.6, wait_s=0.2, backpressure_s=0.05, agree_s=0.05, flush_s=0.0)
    values.update(fields)
    return SimpleNamespace(**values)


def assert_sums_to_wall(report) -> None:
    assert report.accounted_s == pytest.approx(report.wall_s, rel=1e-9, abs=1e-9)
    assert set(report.badput) == set(CATEGORIES)
    assert all(v >= -1e-12 for v in report.badput.values())


def write_disrupted_job(path: str) -> None:
    """Process 1: 5 s startup, iterations 1-4 (1 s each), save of 4 (2 s), iterations 5-7,
    iteration 8 cut by a disruption at 14.5 s. Process 2 starts at 20 s: 1 s startup, 3 s
    checkpoint load, restart(4), 1 s, iterations 5-8, 1 s, job_end at 30 s."""
    clock = FakeClock(1000.0, 500.0)
    recorder = GoodputRecorder(path, rank=0, world=1, job="demo", clock=clock)
    recorder.job_start()
    clock.t = 5.0
    for it in range(1, 8):
        recorder.iteration_start(it)
        clock.t += 1.0
        recorder.iteration(it, tokens=1000, report=breakdown(), data_wait_s=0.05)
        if it == 4:
            with recorder.checkpoint_save(4):
                clock.t += 2.0
    recorder.iteration_start(8)
    clock.t = 14.5
    recorder.disruption("PipelineStallError", "rank 2: no progress for 600 s", rank=2)
    recorder.close()  # the process dies here: no job_end

    clock = FakeClock(1020.0, 9000.0)  # a new process: its own monotonic origin
    recorder = GoodputRecorder(path, rank=0, world=1, job="demo", clock=clock)
    recorder.job_start()
    clock.t = 1.0
    with recorder.checkpoint_load():
        clock.t = 4.0
    recorder.restart(4)
    clock.t = 5.0
    for it in range(5, 9):
        recorder.iteration_start(it)
        clock.t += 1.0
        recorder.iteration(it, tokens=1000, report=breakdown(), data_wait_s=0.05)
    clock.t = 10.0
    recorder.job_end()


# -- accounting ------------------------------------------------------------------------

def test_categories_sum_to_wall_time_with_disruption_and_restart(tmp_path):
    path = str(tmp_path / "goodput.db")
    write_disrupted_job(path)
    report = goodput_report(path)
    assert_sums_to_wall(report)
    assert report.wall_s == pytest.approx(30.0)
    # 8 kept iterations x (1 s - bubble 0.25 - TP 0.05 - data 0.05)
    assert report.productive_s == pytest.approx(8 * 0.65)
    assert report.fb_compute_s == pytest.approx(8 * 0.60)
    expected = {"startup": 5.0, "checkpoint_save": 2.0, "checkpoint_load": 3.0, "data_loading": 0.4,
                "wasted_progress": 3.0 + 0.5,  # iterations 5-7 redone + iteration 8 cut short
                "recovery": 5.5 + 1.0 + 1.0,  # gap to process 2, its startup, restart -> first iteration
                "pipeline_bubble": 2.0, "tp_coordination": 0.4, "other": 1.0}
    assert report.badput == pytest.approx(expected)
    assert report.goodput == pytest.approx(5.2 / 30)
    assert report.goodput_tokens_per_s == pytest.approx(8000 / 30)
    assert report.throughput_tokens_per_s == pytest.approx(1000.0)
    assert (report.count("kept"), report.count("wasted"), report.count("incomplete")) == (8, 3, 1)
    (d,) = report.disruptions
    assert (d.kind, d.rank, d.resumed_from, d.inferred) == ("PipelineStallError", 2, 4, False)
    assert d.time_to_resume_s == pytest.approx(10.5) and d.wasted_s == pytest.approx(3.5)
    assert sum(sum(b[k] for k in ("productive", *CATEGORIES)) for b in report.timeline) == pytest.approx(30.0)


def test_killed_process_and_silent_restart_are_inferred(tmp_path):
    """No disruption event, no restart(): the first process just stops; the second starts at
    iteration 4, so iterations 4-5 of the first were redone."""
    path = str(tmp_path / "goodput.db")
    clock = FakeClock(50.0, 7.0)
    recorder = GoodputRecorder(path, rank=0, world=1, clock=clock)
    recorder.job_start()
    for it in range(1, 6):
        clock.t += 1.0
        recorder.iteration(it, tokens=10)  # no iteration_start, no breakdown (Megatron's 1F1B)
        if it == 3:
            with recorder.checkpoint_save(3):
                clock.t += 0.5
    recorder.close()  # last event at 5.5 s
    clock = FakeClock(60.0, 123.0)
    recorder = GoodputRecorder(path, rank=0, world=1, clock=clock)
    recorder.job_start()
    clock.t = 2.0
    for it in range(4, 7):
        recorder.iteration_start(it)
        clock.t += 1.0
        recorder.iteration(it, tokens=10)
    recorder.job_end()
    report = goodput_report(path)
    assert_sums_to_wall(report)
    assert report.wall_s == pytest.approx(15.0)
    (d,) = report.disruptions
    assert d.inferred and d.kind == "unclean-exit" and d.resumed_from == 3 and d.wasted_iterations == 2
    assert report.badput["wasted_progress"] == pytest.approx(2.0)
    assert report.badput["recovery"] == pytest.approx(4.5 + 2.0)  # 5.5 s -> 10 s gap, then 2 s to iteration 4
    assert report.badput["startup"] == 0.0  # without iteration_start, iteration 1 began at the previous event
    assert report.productive_s == pytest.approx(6.0) and report.unmeasured_iterations == 6


def test_last_process_died_unresumed_loses_work_after_last_checkpoint(tmp_path):
    path = str(tmp_path / "goodput.db")
    clock = FakeClock(0.0, 0.0)
    recorder = GoodputRecorder(path, rank=0, world=1, clock=clock)
    for it in range(1, 6):
        recorder.iteration_start(it)
        clock.t += 1.0
        recorder.iteration(it, tokens=1, report=breakdown(wait_s=0.0, backpressure_s=0.0, agree_s=0.0))
        if it == 2:
            recorder.checkpoint_save_start(2)
            clock.t += 1.0
            recorder.checkpoint_save_end(2)
    recorder.iteration_start(6)
    clock.t += 0.25
    recorder.checkpoint_save_start(6)  # the crash hits mid-save: save 6 never completes
    clock.t += 0.25
    recorder.writer.write("data_wait", data={"seconds": 0.0})
    recorder.close()
    report = goodput_report(path)
    assert_sums_to_wall(report)
    assert not report.live and report.disruptions[0].resumed_at_s is None
    assert report.count("wasted") == 3 and report.count("incomplete") == 1
    assert report.badput["wasted_progress"] == pytest.approx(3.0 + 0.25)
    assert report.badput["checkpoint_save"] == pytest.approx(1.0 + 0.25)


def test_live_job_is_not_called_disrupted(tmp_path):
    path = str(tmp_path / "goodput.db")
    writer = LedgerWriter(path)
    writer.write("job_start")
    writer.write("iteration_start", iteration=1)
    writer.write("iteration_end", iteration=1, data={"tokens": 5})
    assert writer.flush(10)
    report = goodput_report(path)
    assert report.live and report.disruptions == [] and report.count("kept") == 1
    assert_sums_to_wall(report)
    writer.close()
    assert not load_ledger(path).live


def test_rank_breakdowns_are_recorded_as_min_median_max(tmp_path):
    path = str(tmp_path / "goodput.db")
    per_rank = [breakdown(wait_s=w, compute_s=c) for w, c in ((0.1, 0.5), (0.4, 0.2), (0.2, 0.3))]
    vectors = None

    def gather(vector):  # what all_gather_vectors returns on 3 ranks
        nonlocal vectors
        from megatron_rrfp.goodput.recorder import breakdown_vector
        vectors = [breakdown_vector(r, 0.01 * i) for i, r in enumerate(per_rank)]
        return vectors

    clock = FakeClock(0.0, 0.0)
    recorder = GoodputRecorder(path, rank=0, world=3, clock=clock, gather=gather)
    recorder.iteration_start(1)
    clock.t = 1.0
    recorder.iteration(1, tokens=64, report=per_rank[0], data_wait_s=0.0)
    recorder.job_end()
    (event,) = [e for e in load_ledger(path).events if e.kind == "iteration_end"]
    stats = event.data["stats"]
    assert event.data["ranks"] == 3 and event.data["measured_ranks"] == 3
    assert stats["wait_s"] == pytest.approx([0.1, 0.2, 0.7 / 3, 0.4])
    assert stats["compute_s"] == pytest.approx([0.2, 0.3, 1.0 / 3, 0.5])
    assert stats["data_wait_s"] == pytest.approx([0.0, 0.01, 0.01, 0.02])
    report = goodput_report(path)
    assert report.badput["pipeline_bubble"] == pytest.approx(0.7 / 3 + 0.05)  # mean wait + backpressure
    assert report.breakdown["wait_s"] == pytest.approx({"min": 0.1, "median": 0.2, "max": 0.4})
    assert_sums_to_wall(report)


class _Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())


def _rrfp_job_with_recorder(path: str):
    """2 ranks, PP=2: three real RRFP iterations (stage 1 is slow, so stage 0 waits), a
    checkpoint save, and Megatron-LM's timers.log with the rrfp-* names appended."""
    import torch.distributed as dist
    from megatron.core.timers import Timers

    from helpers import mlp
    from megatron_rrfp.bench.around_schedules import sleep_before_tasks
    from megatron_rrfp.cpu import enable_cpu_reference_schedules
    from megatron_rrfp.goodput.recorder import breakdown_vector
    from megatron_rrfp.mcore.config import RRFPConfig
    from megatron_rrfp.mcore.schedule import forward_backward_rrfp, last_iteration_report
    from megatron_rrfp.mcore.session import shutdown
    from megatron_rrfp.train import models

    enable_cpu_reference_schedules()  # CPU stand-ins for megatron.core.timers' CUDA calls
    rank = dist.get_rank()
    model = mlp.build_mlp_stage(models.tiny_gpt_config(), seed=3)
    timers = Timers(log_level=1, log_option="minmax")
    extend_timer_logging(timers)
    recorder = GoodputRecorder(path, rank=rank, world=dist.get_world_size(), job="rrfp-e2e")
    recorder.job_start()
    options = RRFPConfig(around_task=sleep_before_tasks(lambda task: 0.02 if rank == 1 else 0.0))
    vectors = []
    for it in (1, 2, 3):
        recorder.iteration_start(it)
        data = mlp.synthetic_mlp_batches(seed=it, micro_batch_size=2, seq_length=8, hidden_size=32)
        forward_backward_rrfp(forward_step_func=mlp.mlp_forward_step, data_iterator=data, model=model,
                              num_microbatches=4, seq_length=8, micro_batch_size=2, rrfp_config=options)
        report = last_iteration_report()
        vectors.append(breakdown_vector(report))
        recorder.iteration(it, tokens=4 * 2 * 8, report=report)
        publish_to_timers(timers, report)
        if it == 2:
            with recorder.checkpoint_save(2):
                time.sleep(0.05)
    captured = _Captured()
    logging.getLogger("megatron.core.timers").addHandler(captured)
    logging.getLogger("megatron.core.timers").setLevel(logging.INFO)
    timers.log(["forward-backward"], rank=0, normalizer=3)  # what training_log does: collective
    recorder.job_end()
    shutdown()
    return vectors, captured.lines


@pytest.mark.timeout(300)
def test_real_rrfp_iterations_on_two_ranks_fill_ledger_and_megatron_timers(tmp_path):
    from megatron_rrfp.launch.function import launch

    path = str(tmp_path / "goodput.db")
    (vectors0, log0), (vectors1, _) = launch(_rrfp_job_with_recorder, world_size=2, timeout=270, args=(path,))
    ends = [e for e in load_ledger(path).events if e.kind == "iteration_end"]
    assert [e.iteration for e in ends] == [1, 2, 3]
    for event, mine, theirs in zip(ends, vectors0, vectors1):
        assert event.data["ranks"] == 2 and event.data["measured_ranks"] == 2
        for i, name in enumerate(("compute_s", "wait_s")):
            low, high = sorted((mine[i], theirs[i]))
            assert event.data["stats"][name] == pytest.approx([low, (low + high) / 2, (low + high) / 2, high])
    report = goodput_report(path)
    assert_sums_to_wall(report)
    assert report.badput["pipeline_bubble"] > 0 and report.badput["checkpoint_save"] >= 0.05
    assert report.count("kept") == 3 and report.disruptions == []
    assert sum(v[1] for v in vectors0) > 0.1  # stage 0 waited on the slow stage 1
    text = "\n".join(log0)  # Megatron leaves out timers that are 0 on every rank (no TP, no backpressure here)
    assert "rrfp-compute" in text and "rrfp-bubble" in text, text


# -- durability ---------------------------------------------------------------------------

_WRITER_LOOP = r"""
import sys
from megatron_rrfp.goodput import LedgerWriter
writer = LedgerWriter(sys.argv[1], job="killed")
i = 0
while True:
    for _ in range(1 + i % 37):
        writer.write("iteration_end", iteration=i, data={"tokens": i, "pad": "x" * (i % 500)})
        i += 1
    if writer.flush(30):
        print(i, flush=True)  # every event < i is committed
"""


@pytest.mark.timeout(120)
def test_sigkilled_writer_loses_no_committed_record(tmp_path):
    path = str(tmp_path / "goodput.db")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen([sys.executable, "-c", _WRITER_LOOP, path], stdout=subprocess.PIPE, text=True, env=env)
    try:
        committed = 0
        while committed < 3000:
            line = child.stdout.readline()
            assert line, f"writer process exited early with code {child.poll()}"
            committed = int(line)
        with pytest.raises(LedgerBusyError, match=f"pid {child.pid} "):
            LedgerWriter(path)  # the live child holds the job lock
        os.kill(child.pid, signal.SIGKILL)  # mid-write: its loop never pauses
        assert child.wait(30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
    ledger = load_ledger(path)  # runs quick_check
    iterations = [e.iteration for e in ledger.events]
    assert iterations == list(range(len(iterations))), "committed events must form a gap-free prefix"
    assert len(iterations) >= committed
    assert all(e.data == {"tokens": e.iteration, "pad": "x" * (e.iteration % 500)} for e in ledger.events)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    assert not ledger.live
    writer = LedgerWriter(path)  # the kernel dropped the dead writer's lock
    writer.write("restart", data={"resumed_from": 0})
    assert writer.close(10)
    assert [e.kind for e in load_ledger(path).events[-1:]] == ["restart"]


def test_second_writer_on_the_same_job_is_a_clear_error(tmp_path):
    path = str(tmp_path / "goodput.db")
    first = GoodputRecorder(path, rank=0, world=1)
    with pytest.raises(LedgerBusyError, match=rf"already being written by pid {os.getpid()} .*One writer per job"):
        GoodputRecorder(path, rank=0, world=1)
    assert GoodputRecorder(path, rank=1, world=2, gather=False).writer is None  # other ranks never write
    first.job_end()
    second = GoodputRecorder(path, rank=0, world=1)
    second.job_end()
    assert len(load_ledger(path).sessions) == 2


# -- reading bad files --------------------------------------------------------------------

def test_missing_corrupt_and_foreign_files_give_clear_errors(tmp_path):
    with pytest.raises(LedgerError, match="no such goodput ledger"):
        load_ledger(str(tmp_path / "absent.db"))
    with pytest.raises(LedgerError, match="is a directory"):
        load_ledger(str(tmp_path))
    (tmp_path / "empty.db").write_bytes(b"")
    with pytest.raises(LedgerError, match="an empty file"):
        load_ledger(str(tmp_path / "empty.db"))
    (tmp_path / "text.db").write_text("iteration,seconds\n1,0.5\n")
    with pytest.raises(LedgerError, match="not a SQLite database"):
        load_ledger(str(tmp_path / "text.db"))
    foreign = str(tmp_path / "foreign.db")
    with contextlib.closing(sqlite3.connect(foreign)) as conn:
        conn.execute("CREATE TABLE metrics(step INTEGER, loss REAL)")
        conn.commit()
    with pytest.raises(LedgerError, match="not a megatron-rrfp goodput ledger"):
        load_ledger(foreign)

    path = str(tmp_path / "goodput.db")
    write_disrupted_job(path)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA user_version = 99")
        conn.commit()
    with pytest.raises(LedgerError, match="schema version 99.*reads version 1"):
        load_ledger(path)

    corrupt = str(tmp_path / "corrupt.db")
    write_disrupted_job(corrupt)
    with contextlib.closing(sqlite3.connect(corrupt)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = bytearray(open(corrupt, "rb").read())
    page = 4096
    for offset in range(2 * page, len(data), page):  # scribble over every page but the header page
        data[offset:offset + 64] = os.urandom(64)
    open(corrupt, "wb").write(bytes(data))
    with pytest.raises(LedgerError, match="corrupt"):
        load_ledger(corrupt)

    # A writer never clobbers a foreign file: it warns and gives up, training goes on.
    with pytest.warns(LedgerWarning, match="not a megatron-rrfp goodput ledger"):
        writer = LedgerWriter(foreign, retry_s=(0.01, 0.05))
        writer.write("job_start")
        writer.close(5)
    with contextlib.closing(sqlite3.connect(foreign)) as conn:
        assert [r[0] for r in conn.execute("SELECT name FROM sqlite_master")] == ["metrics"]


# -- the writer never stops training ------------------------------------------------------

@contextlib.contextmanager
def tmpfs(directory, options: str):
    """Mount a tmpfs at ``directory``; yields False when that is impossible here."""
    os.makedirs(directory, exist_ok=True)
    if os.geteuid() != 0:
        yield False
        return
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True, timeout=30)


def run_training_loop(writer, iterations, payload: int = 0) -> list[float]:
    """A stand-in training loop over ``iterations``; returns the seconds each ledger call took."""
    costs = []
    for it in iterations:
        start = time.perf_counter()
        writer.write("iteration_end", iteration=it, data={"tokens": it, "pad": "y" * payload})
        costs.append(time.perf_counter() - start)
    return costs


# A blocking writer would show the 2 s busy timeout or the 1 s retry delay in one call.
MAX_CALL_S = 0.5
MAX_LOOP_S = 5.0


def assert_not_slowed(costs: list[float]) -> None:
    assert max(costs) < MAX_CALL_S, f"one ledger call took {max(costs):.3f} s"
    assert sum(costs) < MAX_LOOP_S, f"{len(costs)} ledger calls took {sum(costs):.3f} s"


def test_read_only_directory_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    directory = tmp_path / "ro"
    with tmpfs(directory, "ro,size=64k") as mounted:
        if not mounted:
            if os.geteuid() != 0:
                os.chmod(directory, 0o555)
            else:  # root without mount rights: a read-only directory as sqlite/os report it
                monkeypatch.setattr(ledger_module.os, "open", _raise(PermissionError(13, "Read-only file system")))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.perf_counter()
            recorder = GoodputRecorder(str(directory / "goodput.db"), rank=0, world=1)
            recorder.job_start()
            costs = run_training_loop(recorder.writer, range(2000))
            recorder.job_end()
            elapsed = time.perf_counter() - start
    ours = [w for w in caught if issubclass(w.category, LedgerWarning)]
    assert len(ours) == 1 and "training continues" in str(ours[0].message), [str(w.message) for w in ours]
    assert_not_slowed(costs)
    assert elapsed < MAX_LOOP_S + recorder.close_timeout_s + 1.0
    assert not recorder.writer.healthy


def _raise(exc):
    def fail(*args, **kwargs):
        raise exc
    return fail


class _FullDiskConnection:
    """A sqlite3 connection whose transactions fail as on a full disk while ``full``."""

    full = False

    def __init__(self, conn):
        self._conn = conn

    def execute(self, sql, *args):
        if sql.startswith("BEGIN IMMEDIATE") and _FullDiskConnection.full:
            raise sqlite3.OperationalError("database or disk is full")
        return self._conn.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self._conn, name)


class _Disk:
    """Fill and free the file system under the ledger: a real tmpfs, or a simulation."""

    def __init__(self, directory, mounted: bool, monkeypatch) -> None:
        self.filler = os.path.join(directory, "filler")
        self.mounted = mounted
        if not mounted:
            connect = sqlite3.connect
            monkeypatch.setattr(ledger_module.sqlite3, "connect", lambda *a, **k: _FullDiskConnection(connect(*a, **k)))

    def fill(self) -> None:
        if not self.mounted:
            _FullDiskConnection.full = True
            return
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:  # ENOSPC: the disk is full
            pass
        finally:
            os.close(fd)

    def free(self) -> None:
        _FullDiskConnection.full = False
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.filler)


def wait_until(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_full_disk_warns_training_goes_on_and_writes_resume_when_space_returns(tmp_path, monkeypatch):
    directory = tmp_path / "tiny"
    with tmpfs(directory, "size=1m") as mounted:
        disk = _Disk(directory, mounted, monkeypatch)
        path = str(directory / "goodput.db")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            writer = LedgerWriter(path, retry_s=(0.05, 0.2))
            costs = run_training_loop(writer, range(20), payload=100)
            assert writer.flush(30)
            disk.fill()
            costs += run_training_loop(writer, range(20, 220), payload=1000)  # 200 KB into a full disk
            assert wait_until(lambda: not writer.healthy), "the writer never noticed the full disk"
            costs += run_training_loop(writer, range(220, 240), payload=1000)  # training goes on
            disk.free()
            assert writer.flush(30), "the writer did not resume once space was back"
            assert writer.close(5)
        messages = [str(w.message) for w in caught if issubclass(w.category, LedgerWarning)]
        assert len(messages) == 2, messages
        assert "database or disk is full" in messages[0] and "training continues" in messages[0]
        assert "writing again (lost so far: 0)" in messages[1]
        assert_not_slowed(costs)
        ledger = load_ledger(path)
        assert [e.iteration for e in ledger.events] == list(range(240))
        assert ledger.events[-1].data["pad"] == "y" * 1000


def test_locked_database_is_retried_without_blocking_and_small_queue_drops(tmp_path):
    path = str(tmp_path / "goodput.db")
    writer = LedgerWriter(path, busy_timeout_s=2.0, retry_s=(0.05, 0.2), queue_size=100)
    writer.write("job_start")
    assert writer.flush(10)
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # e.g. an admin tool holding the write lock
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        costs = run_training_loop(writer, range(50))
        assert wait_until(lambda: not writer.healthy), "the insert should fail after the 2 s busy timeout"
        costs += run_training_loop(writer, range(50, 1050))  # more than the queue + pending can hold
        blocker.execute("ROLLBACK")
        blocker.close()
        assert writer.flush(30)
        assert writer.healthy
    messages = [str(w.message) for w in caught if issubclass(w.category, LedgerWarning)]
    assert any("locked" in m for m in messages) and any("writing again" in m for m in messages), messages
    assert any("dropping new events" in m for m in messages), messages
    assert_not_slowed(costs)
    writer.close(5)
    iterations = [e.iteration for e in load_ledger(path).events if e.kind == "iteration_end"]
    assert iterations[:50] == list(range(50)) and len(iterations) == 1050 - writer.dropped


def test_close_does_not_block_job_exit_when_writes_hang(tmp_path, monkeypatch):
    path = str(tmp_path / "goodput.db")
    writer = LedgerWriter(path)
    monkeypatch.setattr(writer, "_insert", lambda conn, rows: time.sleep(30))
    writer.write("job_start")
    time.sleep(0.2)
    start = time.perf_counter()
    with pytest.warns(LedgerWarning, match="not waiting longer"):
        assert writer.close(timeout_s=0.5) is False
    assert time.perf_counter() - start < 0.5 + MAX_CALL_S


def test_disabled_recorder_is_a_no_op():
    recorder = GoodputRecorder(None, rank=0, world=8)
    recorder.job_start()
    recorder.iteration(1, tokens=1, report=breakdown())  # no collective without a ledger
    with recorder.checkpoint_save(1):
        pass
    recorder.disruption("x")
    recorder.job_end()
    assert recorder.writer is None


# -- Megatron timers ------------------------------------------------------------------------

def test_breakdown_in_megatron_timers_and_training_log_names():
    from megatron.core.timers import Timers

    timers = Timers(log_level=1, log_option="minmax")
    report = breakdown(compute_s=0.5, wait_s=0.25, backpressure_s=0.125, agree_s=0.0625, flush_s=0.03125)
    assert publish_to_timers(timers, report) == {
        "rrfp-compute": 0.5, "rrfp-bubble": 0.25, "rrfp-backpressure": 0.125, "rrfp-tp-agreement": 0.0625,
        "rrfp-flush": 0.03125}
    publish_to_timers(timers, report)  # accumulates over iterations, like start/stop
    assert timers("rrfp-bubble").elapsed(reset=False) == pytest.approx(0.5)
    assert publish_to_timers(Timers(log_level=0, log_option="minmax"), report) == {}  # level off: DummyTimer
    assert publish_to_timers(None, report) == {} and publish_to_timers(timers, None) == {}

    seen = []
    timers.write = lambda names, writer, iteration, **kw: seen.append(list(names))
    timers.log = lambda names, **kw: seen.append(list(names))
    extend_timer_logging(timers)
    extend_timer_logging(timers)  # idempotent
    timers.write(["forward-backward", "optimizer"], None, 10, normalizer=10)
    timers.log(["save-checkpoint"])
    assert seen == [["forward-backward", "optimizer", *TIMER_NAMES.values()], ["save-checkpoint"]]


# -- the command --------------------------------------------------------------------------

def test_goodput_command_prints_table_and_writes_json_and_png(tmp_path, capsys):
    from megatron_rrfp.cli import main

    path = str(tmp_path / "goodput.db")
    write_disrupted_job(path)
    out_json, out_png = tmp_path / "out" / "goodput.json", tmp_path / "out" / "goodput.png"
    assert main(["goodput", path, "--json", str(out_json), "--png", str(out_png), "--bins", "30"]) == 0
    text = capsys.readouterr().out
    for needle in ("goodput 17.3%", "pipeline bubbles", "TP coordination", "wasted progress", "recovery",
                   "total (= wall time)", "30.00 100.0%", "PipelineStallError on rank 2", "from iteration 4"):
        assert needle in text, text
    figures = json.loads(out_json.read_text())
    assert figures["wall_s"] == pytest.approx(30.0) and figures["categories_sum_s"] == pytest.approx(30.0)
    assert set(figures["badput_s"]) == set(CATEGORIES) and len(figures["timeline"]) == 30
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert main(["goodput", str(tmp_path / "absent.db")]) == 2
    assert "no such goodput ledger" in capsys.readouterr().err
