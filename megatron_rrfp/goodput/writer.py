"""The goodput ledger's writer: a durable SQLite event log, written off the training thread.

    writer = LedgerWriter("run/goodput.db", job="gpt-tiny")   # LedgerBusyError if another live writer has it
    writer.write("iteration_end", iteration=12, data={"tokens": 4096})   # returns at once
    writer.close(timeout_s=5.0)                                # flushes for at most 5 s, then gives up


Never in training's way. ``write`` stamps the event with ``time.time()`` (wall clock,
places processes relative to each other) and ``time.monotonic()`` (durations within one
process, immune to clock steps), then ``put_nowait``s it on a bounded queue; a daemon
thread commits batches. Any I/O error (disk full, read-only directory, locked database,
a foreign file at the path) gives one ``LedgerWarning`` and the thread keeps the events
in memory (bounded) and retries with back-off (1 s doubling to 60 s); a full queue drops
events (counted, warned once) -- except ``disruption`` and ``job_end``, the events that say
how the job ended: room is reserved for them, and if even that is taken they wait up to
``CRITICAL_WAIT_S``. ``write`` never raises and never blocks (beyond that); ``close`` waits
at most ``timeout_s``; the process never waits on the daemon thread at exit.

Durability: ``journal_mode=WAL`` + ``synchronous=FULL``. A record is *committed* when its
transaction returns; in WAL mode that means its frames were appended to the ``-wal`` file.
Killing the writer process (SIGKILL, OOM killer) loses nothing committed with either
NORMAL or FULL -- the bytes are in the OS page cache, and the next opener replays the
WAL; a torn last transaction has no commit frame and is ignored, so the file is never
corrupt. NORMAL would skip the fsync at commit and could lose the last transactions on a
*node* crash or power loss -- exactly the disruption this ledger must describe (its
last iterations are the wasted progress). FULL fsyncs the WAL once per batch, on the
background thread, so training never pays for it. A file system without working WAL
(no shared memory for the ``-shm`` index, e.g. some network file systems) gets a rollback
journal instead (``journal_mode=DELETE``, still FULL: the same durability, readers may
wait briefly for a commit), with one ``LedgerWarning``.

One writer per job (= per ledger file): the writer holds an exclusive ``flock`` on
``LEDGER.lock`` for its lifetime; the kernel drops it when the process dies, however it
dies, so a restarted job takes over at once with no stale-lock heuristics. The lock file
names the holder (host, pid, since) for the error message. Paths are resolved first
(symlinks), so every name of one file shares one lock. A reader's liveness probe takes a
shared lock for microseconds; a starting writer that meets one retries for
``lock_wait_s`` rather than mistaking it for another job. SQLite's WAL mode needs all
openers on one host anyway (shared memory), so the file lock is as local as the ledger.
(Schema: ``schema.py``; reading: ``reader.py``.)
"""
from __future__ import annotations

import atexit
import fcntl
import json
import os
import queue
import socket
import sqlite3
import threading
import time
import uuid
import warnings
from typing import Optional

from .schema import (
    APPLICATION_ID,
    EVENT_KINDS,
    SCHEMA_SQL,
    SCHEMA_VERSION,
    Clock,
    LedgerBusyError,
    LedgerError,
    LedgerWarning,
    check_identity,
    system_clock,
)

_STOP = object()
CRITICAL_KINDS = frozenset({"disruption", "job_end"})
"""Never dropped for lack of room: how the job ended is what the report needs most."""
CRITICAL_RESERVE = 64
"""Queue slots only critical events may take."""
CRITICAL_WAIT_S = 2.0
"""How long a critical event may wait for room when even the reserve is full."""


class LedgerWriter:
    """Append-only event writer of one process. Thread-safe ``write``; see the module doc."""

    def __init__(self, path: str, *, job: Optional[str] = None, info: Optional[dict] = None,
                 queue_size: int = 10_000, busy_timeout_s: float = 2.0,
                 retry_s: tuple[float, float] = (1.0, 60.0), clock: Optional[Clock] = None,
                 since_wall: Optional[float] = None, lock_wait_s: float = 1.0) -> None:
        """``since_wall``: the process's own start (e.g. Megatron-LM's ``_TRAIN_START_TIME``) when
        the writer is created late; the time before it then counts too. Default: now.
        ``lock_wait_s``: how long a held job lock is retried before it counts as another job's."""
        self.path = os.path.realpath(path)  # one file, one lock, however it is reached
        self.lock_path = self.path + ".lock"
        self._clock = clock or system_clock
        self._busy_timeout_s, self._retry_s, self._lock_wait_s = busy_timeout_s, retry_s, lock_wait_s
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size + CRITICAL_RESERVE)
        self._queue_size = queue_size
        self._max_pending = queue_size
        self._pid = os.getpid()
        wall, mono = self._clock()
        if since_wall is not None and since_wall < wall:
            wall, mono = since_wall, mono - (wall - since_wall)
        self._session_row = (uuid.uuid4().hex, job, socket.gethostname(), self._pid, wall, mono,
                             json.dumps(info or {}, default=str))
        self._session_id: Optional[int] = None
        self._lock_fd: Optional[int] = None
        self._disabled: Optional[str] = None  # set once the ledger is given up for good
        self._warned: set[str] = set()
        self._failing = False
        self._stop = threading.Event()
        self._progress = threading.Condition()
        self._enqueued = self._done = self.dropped = 0
        self._closed = False
        self._acquire_lock(raise_busy=True)
        os.register_at_fork(after_in_child=self._after_fork_in_child)
        self._thread = threading.Thread(target=self._run, name="rrfp-goodput-ledger", daemon=True)
        self._thread.start()
        atexit.register(self._at_exit)

    # -- the caller's side: never raises, never blocks -------------------------------

    def write(self, kind: str, *, iteration: Optional[int] = None, rank: Optional[int] = None,
              data: Optional[dict] = None, at: Optional[tuple[float, float]] = None) -> None:
        """Queue one event stamped now (or ``at`` = (wall, mono) taken earlier by the caller)."""
        try:
            if self._closed or self._disabled or os.getpid() != self._pid:
                return
            if kind not in EVENT_KINDS:
                raise ValueError(f"unknown ledger event kind {kind!r}; known: {', '.join(EVENT_KINDS)}")
            wall, mono = at or self._clock()
            row = (kind, float(wall), float(mono), iteration, rank, json.dumps(data or {}, default=str))
            with self._progress:
                self._enqueued += 1
            try:
                if kind in CRITICAL_KINDS:
                    self._queue.put(row, timeout=CRITICAL_WAIT_S)
                elif self._queue.qsize() >= self._queue_size:  # the rest is reserved for critical events
                    raise queue.Full
                else:
                    self._queue.put_nowait(row)
            except queue.Full:
                self._count_lost(1)
                self._warn("queue", f"goodput ledger {self.path}: {self._queue_size} events waiting to be "
                                    "written; dropping new events (is the disk very slow or failing?)")
        except Exception as exc:  # a ledger problem must never become a training problem
            self._warn("write", f"goodput ledger {self.path}: event {kind!r} not recorded: {exc}")

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every event queued so far is committed (or dropped). True if done in time."""
        with self._progress:
            target = self._enqueued
            return self._progress.wait_for(lambda: self._done >= target or not self._thread.is_alive(),
                                           timeout=timeout_s) and self._done >= target

    def close(self, timeout_s: float = 5.0) -> bool:
        """Commit what is queued, waiting at most ``timeout_s``. True if everything was written."""
        if self._closed or os.getpid() != self._pid:
            return True
        self._closed = True
        self._stop.set()
        try:
            self._queue.put(_STOP, timeout=max(0.0, timeout_s))
        except queue.Full:
            pass  # the thread sees _stop once it has room to look
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            with self._progress:
                left = self._enqueued - self._done
            self._warn("close", f"goodput ledger {self.path}: {left} events not written after {timeout_s:.1f} s; "
                                "not waiting longer so the job can exit")
            return False
        self._release_lock()
        return self.dropped == 0

    @property
    def healthy(self) -> bool:
        """False while writes fail (or after the ledger was given up)."""
        return not (self._failing or self._disabled)

    # -- the background thread -------------------------------------------------------

    def _run(self) -> None:
        conn: Optional[sqlite3.Connection] = None
        pending: list = []
        delay = self._retry_s[0]
        stopping = False
        while True:
            if self._failing and not self._stop.is_set():
                self._stop.wait(delay)  # back-off; close() wakes us for one last attempt
            block = not pending and not self._failing and not self._stop.is_set()
            stopping = self._collect(pending, block=block) or stopping or self._stop.is_set()
            if self._disabled:  # given up for good (foreign file, another writer): stop here
                self._count_lost(len(pending))
                break
            if pending:
                try:
                    if conn is None:
                        conn = self._open()
                    self._insert(conn, pending)
                    self._count_done(len(pending))
                    pending.clear()
                    if self._failing:
                        self._failing = False
                        self._warned.discard("io")
                        warnings.warn(f"goodput ledger {self.path}: writing again (lost so far: {self.dropped})",
                                      LedgerWarning, stacklevel=1)
                    delay = self._retry_s[0]
                except Exception as exc:  # sqlite3.Error, OSError, LedgerError
                    if conn is not None:
                        _close_quietly(conn)
                        conn = None
                    self._failing = True
                    self._warn("io", f"goodput ledger {self.path}: cannot write ({exc}); training continues, "
                                     f"retrying every <= {self._retry_s[1]:.0f} s")
                    if isinstance(exc, (LedgerError, LedgerBusyError)):
                        self._disabled = str(exc)
                        self._count_lost(len(pending))
                        break
                    if len(pending) > self._max_pending:
                        self._trim(pending)
                    if stopping:
                        self._count_lost(len(pending))
                        break
                    delay = min(delay * 2, self._retry_s[1])
                    continue
            if stopping and self._queue.empty():
                break
        if conn is not None:
            _close_quietly(conn)
        leftover: list = []
        self._collect(leftover, block=False)
        self._count_lost(len(leftover))

    def _trim(self, pending: list) -> None:
        """Keep at most ``_max_pending`` events in memory while writes fail, dropping the
        newest ordinary ones first; critical events are kept."""
        extra = pending[self._max_pending:]
        kept = [row for row in extra if row[0] in CRITICAL_KINDS]
        self._count_lost(len(extra) - len(kept))
        pending[self._max_pending:] = kept

    def _collect(self, pending: list, *, block: bool) -> bool:
        """Move queued events into ``pending``; True when the stop marker was seen."""
        try:
            item = self._queue.get() if block else self._queue.get_nowait()
        except queue.Empty:
            return False
        while True:
            if item is _STOP:
                return True
            pending.append(item)
            if len(pending) >= 4096:
                return False
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return False

    def _open(self) -> sqlite3.Connection:
        if self._lock_fd is None:
            self._acquire_lock(raise_busy=False)
            if self._disabled:
                raise LedgerBusyError(self._disabled)
            if self._lock_fd is None:
                raise OSError(f"cannot lock {self.lock_path}")
        conn = sqlite3.connect(self.path, timeout=self._busy_timeout_s, isolation_level=None)
        try:
            self._set_journal_mode(conn)
            conn.execute("PRAGMA synchronous=FULL")  # see the module docstring
            self._ensure_schema(conn)
            if self._session_id is None:
                cursor = conn.execute("INSERT INTO sessions(uid, job, host, pid, started_wall, started_mono, info) "
                                      "VALUES (?, ?, ?, ?, ?, ?, ?)", self._session_row)
                self._session_id = cursor.lastrowid
        except BaseException:
            _close_quietly(conn)
            raise
        return conn

    def _set_journal_mode(self, conn: sqlite3.Connection) -> None:
        """WAL where the file system supports it, else a rollback journal (one warning)."""
        try:
            mode = str(conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]).lower()
            problem = None if mode == "wal" else f"journal_mode stayed {mode!r}"
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise  # another connection holds the database: retried like any write
            problem = str(exc)
        if problem is not None:
            conn.execute("PRAGMA journal_mode=DELETE")
            self._warn("wal", f"goodput ledger {self.path}: SQLite's WAL mode does not work on this file system "
                              f"({problem}); using a rollback journal (journal_mode=DELETE) instead: commits are "
                              "as durable, readers may wait briefly for a commit")

    def _ensure_schema(self, conn: sqlite3.Connection) -> None:
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
        if app_id == 0 and version == 0 and tables == 0:
            conn.execute("BEGIN IMMEDIATE")
            try:
                for statement in filter(str.strip, SCHEMA_SQL.split(";")):
                    conn.execute(statement)
                conn.executemany("INSERT INTO meta VALUES (?, ?)", [
                    ("schema_version", str(SCHEMA_VERSION)), ("created_wall", repr(time.time())),
                    ("writer", "megatron_rrfp.ledger")])
                conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                conn.execute("COMMIT")
            except BaseException:
                _rollback_quietly(conn)
                raise
            return
        check_identity(self.path, app_id, version, tables)

    def _insert(self, conn: sqlite3.Connection, rows: list) -> None:
        session = self._session_id
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany("INSERT INTO events(session, kind, wall, mono, iteration, rank, data) "
                             "VALUES (?, ?, ?, ?, ?, ?, ?)", [(session, *row) for row in rows])
            conn.execute("COMMIT")
        except BaseException:
            _rollback_quietly(conn)  # keep the original error (e.g. "database or disk is full")
            raise

    # -- the job lock ----------------------------------------------------------------

    def _acquire_lock(self, *, raise_busy: bool) -> None:
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            self._failing = True
            self._warn("io", f"goodput ledger {self.path}: cannot create the lock file ({exc}); training "
                             f"continues without a ledger, retrying every <= {self._retry_s[1]:.0f} s")
            return
        try:
            _lock_exclusive(fd, self._lock_wait_s)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            error = LedgerBusyError(
                f"goodput ledger {self.path} is already being written by {holder}. One writer per job: give "
                "this job its own --rrfp-goodput-ledger path, or stop the other process first.")
            if raise_busy:
                raise error from None
            self._disabled = str(error)
            self._warn("busy", str(error) + " Training continues without a ledger.")
            return
        except OSError as exc:  # e.g. ENOLCK on a file system without locks
            os.close(fd)
            self._failing = True
            self._warn("io", f"goodput ledger {self.path}: cannot lock {self.lock_path} ({exc}); retrying later")
            return
        try:
            holder = json.dumps({"host": socket.gethostname(), "pid": self._pid, "since": time.time()}).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder, 0)
        except OSError:
            pass  # the holder note is for error messages only
        self._lock_fd = fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            try:
                os.close(self._lock_fd)  # closing the descriptor drops the flock
            except OSError:
                pass
            self._lock_fd = None

    def _after_fork_in_child(self) -> None:
        # A forked child (a DataLoader worker) must not keep the job lock alive after the
        # trainer died, nor write: its copy of this object goes quiet.
        self._closed = True
        if self._lock_fd is not None:
            try:
                os.close(self._lock_fd)
            except OSError:
                pass
            self._lock_fd = None

    def _at_exit(self) -> None:
        self.close(timeout_s=2.0)

    # -- bookkeeping -----------------------------------------------------------------

    def _count_done(self, n: int) -> None:
        with self._progress:
            self._done += n
            self._progress.notify_all()

    def _count_lost(self, n: int) -> None:
        if n:
            with self._progress:
                self.dropped += n
                self._done += n
                self._progress.notify_all()

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, LedgerWarning, stacklevel=3)


def _rollback_quietly(conn: sqlite3.Connection) -> None:
    try:
        conn.execute("ROLLBACK")
    except sqlite3.Error:
        pass  # SQLite already rolled back (it does on SQLITE_FULL)


def _close_quietly(conn: sqlite3.Connection) -> None:
    try:
        conn.close()
    except Exception:
        pass


def _lock_exclusive(fd: int, wait_s: float) -> None:
    """``flock(LOCK_EX)``, retried for ``wait_s``: a reader's liveness probe holds a shared
    lock for microseconds and must not be mistaken for another writer. BlockingIOError
    if the lock is still held after that."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.005)


def _read_holder(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"]))
        return f"pid {holder['pid']} on host {holder['host']} (since {since})"
    except Exception:
        return "another process"
