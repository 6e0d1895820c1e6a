"""The goodput ledger under a careless operator: a liveness probe racing a starting writer,
a queue full when the job ends, a ledger reached through a symlink, a file system
without SQLite WAL, and a busy ledger in a multi-rank Megatron-LM run."""
from __future__ import annotations

import os
import sqlite3
import threading
import time
import warnings
from urllib.parse import quote

import pytest

from megatron_rrfp.goodput import LedgerBusyError, LedgerWarning, LedgerWriter, load_ledger
from megatron_rrfp.goodput import reader as ledger_reader
from megatron_rrfp.goodput import recorder as goodput_recorder
from megatron_rrfp.goodput import writer as ledger_writer

pytestmark = pytest.mark.timeout(120)


def test_the_liveness_probe_never_fails_a_starting_writer(tmp_path):
    path = str(tmp_path / "goodput.db")
    LedgerWriter(path).close()  # the lock file exists, as after any earlier run
    stop = threading.Event()
    probes = [0]

    def probe_forever():  # `megatron-rrfp goodput` polled in a loop on a live job
        while not stop.is_set():
            ledger_reader._lock_held(path + ".lock")
            probes[0] += 1

    thread = threading.Thread(target=probe_forever, daemon=True)
    thread.start()
    try:
        for _ in range(40):  # a restarting job: every start must win the lock
            LedgerWriter(path).close()
    finally:
        stop.set()
        thread.join(5)
    assert probes[0] > 100  # the probe really raced the writers


def test_a_probe_descheduled_while_holding_its_shared_lock_does_not_fail_the_writer(tmp_path):
    import fcntl

    path = str(tmp_path / "goodput.db")
    LedgerWriter(path).close()
    fd = os.open(path + ".lock", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # the probe, stopped between its two flock calls
    threading.Timer(0.3, lambda: (fcntl.flock(fd, fcntl.LOCK_UN), os.close(fd))).start()
    start = time.monotonic()
    writer = LedgerWriter(path)  # waits for the probe instead of reporting another job
    assert 0.2 < time.monotonic() - start < 1.0
    writer.close()


def test_a_live_writer_is_still_a_clear_error_after_the_brief_retry(tmp_path):
    path = str(tmp_path / "goodput.db")
    holder = LedgerWriter(path)
    holder.write("job_start")
    assert holder.flush(10)
    try:
        start = time.monotonic()
        with pytest.raises(LedgerBusyError, match="already being written by pid"):
            LedgerWriter(path, lock_wait_s=0.3)
        assert 0.3 <= time.monotonic() - start < 3
        assert load_ledger(path).live
    finally:
        holder.close()


def test_disruption_and_job_end_are_kept_when_the_queue_is_full(tmp_path):
    path = str(tmp_path / "goodput.db")
    writer = LedgerWriter(path, queue_size=20, busy_timeout_s=0.1, retry_s=(0.05, 0.2))
    writer.write("job_start")
    assert writer.flush(10)
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # writes fail and are retried; events pile up
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LedgerWarning)
        for i in range(2000):
            writer.write("iteration_end", iteration=i)
        writer.write("disruption", data={"kind": "RuntimeError", "message": "stage 3 lost"})
        writer.write("job_end")
        time.sleep(0.5)  # the writer retries (and trims what it holds) meanwhile
        for i in range(2000, 2100):
            writer.write("iteration_end", iteration=i)
        blocker.execute("ROLLBACK")
        blocker.close()
        assert writer.flush(30)
        writer.close(5)
    kinds = [e.kind for e in load_ledger(path).events]
    assert writer.dropped > 1000  # ordinary events were dropped ...
    assert kinds.count("disruption") == 1 and kinds.count("job_end") == 1  # ... these never


def test_every_name_of_one_ledger_file_shares_one_lock(tmp_path):
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    (tmp_path / "linked-dir").symlink_to(real_dir)
    path = str(real_dir / "goodput.db")
    holder = LedgerWriter(path)
    try:
        (tmp_path / "link.db").symlink_to(path)
        for alias in (tmp_path / "link.db", tmp_path / "linked-dir" / "goodput.db"):
            with pytest.raises(LedgerBusyError, match="already being written"):
                LedgerWriter(str(alias), lock_wait_s=0.05)
        holder.write("job_start")
        assert holder.flush(10)
        ledger = load_ledger(str(tmp_path / "link.db"))  # read through the link: same file, same lock
        assert ledger.live and [e.kind for e in ledger.events] == ["job_start"]
    finally:
        holder.close()
    assert not os.path.exists(str(tmp_path / "link.db.lock"))


def test_a_file_system_without_wal_falls_back_to_a_rollback_journal_with_one_warning(tmp_path, monkeypatch):
    real_connect = sqlite3.connect

    def without_shared_memory(database, *args, uri=False, **kwargs):  # like a network file system
        if uri:
            return real_connect(database, *args, uri=True, **kwargs)
        return real_connect(f"file:{quote(str(database))}?vfs=unix-none", *args, uri=True, **kwargs)

    monkeypatch.setattr(ledger_writer.sqlite3, "connect", without_shared_memory)
    path = str(tmp_path / "goodput.db")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        writer = LedgerWriter(path)
        for i in range(5):
            writer.write("iteration_end", iteration=i)
        assert writer.flush(10)
        writer.write("job_end")
        assert writer.close(5)
    messages = [str(w.message) for w in caught if issubclass(w.category, LedgerWarning)]
    assert len(messages) == 1 and "journal_mode=DELETE" in messages[0], messages
    monkeypatch.undo()
    assert not os.path.exists(path + "-wal")
    with real_connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    assert [e.kind for e in load_ledger(path).events] == ["iteration_end"] * 5 + ["job_end"]


def _two_ranks(call):
    """Run ``call(rank, exchange)`` on two threads standing in for two ranks."""
    slots: list = [None, None]
    barrier = threading.Barrier(2, timeout=20)
    outcome: dict = {}

    def exchange_for(rank):
        def exchange(value):
            slots[rank] = value
            barrier.wait()
            everyone = list(slots)
            barrier.wait()
            return everyone
        return exchange

    def body(rank):
        try:
            outcome[rank] = call(rank, exchange_for(rank))
        except Exception as exc:  # noqa: BLE001 - inspected below
            outcome[rank] = exc

    threads = [threading.Thread(target=body, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return outcome


def test_a_busy_ledger_fails_every_rank_not_only_the_writer(tmp_path):
    path = str(tmp_path / "goodput.db")
    other_job = LedgerWriter(path, job="another job")
    try:
        outcome = _two_ranks(lambda rank, exchange: goodput_recorder.open_recorder(
            path, rank=rank, world=2, exchange=exchange))
    finally:
        other_job.close()
    assert isinstance(outcome[0], LedgerBusyError) and "already being written" in str(outcome[0])
    assert isinstance(outcome[1], LedgerBusyError)
    assert f"rank 0 cannot write --rrfp-goodput-ledger {path}" in str(outcome[1])
    free = _two_ranks(lambda rank, exchange: goodput_recorder.open_recorder(path, rank=rank, world=2,
                                                                             exchange=exchange))
    assert all(isinstance(r, goodput_recorder.GoodputRecorder) for r in free.values()), free
    assert free[0].writer is not None and free[1].writer is None
    free[0].close()


def test_megatron_lm_hooks_fail_a_non_writing_rank_on_a_busy_ledger(tmp_path, monkeypatch):
    """In a Megatron-LM run rank 1 learns from rank 0 (the all-gather, stood in here) and
    raises too, instead of waiting in its first collective for a rank 0 that left."""
    from megatron_rrfp.megatron_lm import training_loop as hooks

    busy = "goodput ledger x is already being written by pid 1 on host h"
    monkeypatch.setattr(hooks, "_rank_world", lambda: (1, 2))
    monkeypatch.setattr(goodput_recorder, "_all_gather_objects", lambda value: [busy, value])
    options = hooks.HookOptions(ledger_path=str(tmp_path / "goodput.db"))
    training = type("training", (), {"_TRAIN_START_TIME": time.time()})
    with pytest.raises(LedgerBusyError, match="rank 0 cannot write --rrfp-goodput-ledger .* already being written"):
        hooks._Run(options=options, margs=None, timers=None, training=training)
