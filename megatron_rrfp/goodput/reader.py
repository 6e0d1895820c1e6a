"""Reading a goodput ledger: every committed event, whether or not its writer is alive.

    ledger = load_ledger("run/goodput.db")   # LedgerError: missing / corrupt / foreign / other schema
"""
from __future__ import annotations

import fcntl
import json
import os
import sqlite3
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import quote

from .schema import SQLITE_MAGIC, LedgerError, check_identity


@dataclass(frozen=True, slots=True)
class Event:
    seq: int
    session: int
    kind: str
    wall: float
    mono: float
    iteration: Optional[int]
    rank: Optional[int]
    data: dict


@dataclass(frozen=True, slots=True)
class Session:
    id: int
    uid: str
    job: Optional[str]
    host: str
    pid: int
    started_wall: float
    started_mono: float
    info: dict


@dataclass(frozen=True, slots=True)
class Ledger:
    path: str
    schema_version: int
    sessions: list[Session]
    events: list[Event]
    live: bool = False
    """A writer holds the job lock right now: the last session is still running."""
    by_session: dict[int, list[Event]] = field(default_factory=dict)

    @property
    def job(self) -> Optional[str]:
        return next((s.job for s in self.sessions if s.job), None)


def load_ledger(path: str) -> Ledger:
    """Read every committed event. Raises ``LedgerError`` with the reason and the fix."""
    if not os.path.exists(path):
        raise LedgerError(f"{path}: no such goodput ledger (the job writes one when given --rrfp-goodput-ledger)")
    if os.path.isdir(path):
        raise LedgerError(f"{path}: is a directory, not a goodput ledger file")
    with open(path, "rb") as handle:
        head = handle.read(len(SQLITE_MAGIC))
    if head != SQLITE_MAGIC:
        what = "an empty file" if not head else f"not a SQLite database (starts with {head[:16]!r})"
        raise LedgerError(f"{path}: {what}; expected a megatron-rrfp goodput ledger")
    real = os.path.realpath(path)  # where the writer keeps its -wal file and lock
    try:
        conn = _connect_readonly(real)
    except sqlite3.Error as exc:
        raise LedgerError(f"{path}: cannot open as SQLite ({exc})") from exc
    try:
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
        check_identity(path, app_id, version, tables)
        problems = [row[0] for row in conn.execute("PRAGMA quick_check(5)")]
        if problems != ["ok"]:
            raise LedgerError(f"{path}: the database is corrupt: {'; '.join(problems)}")
        sessions = [Session(*row[:7], info=_json(row[7])) for row in conn.execute(
            "SELECT id, uid, job, host, pid, started_wall, started_mono, info FROM sessions ORDER BY id")]
        events = [Event(*row[:7], data=_json(row[7])) for row in conn.execute(
            "SELECT seq, session, kind, wall, mono, iteration, rank, data FROM events ORDER BY seq")]
    except sqlite3.DatabaseError as exc:
        raise LedgerError(f"{path}: the database is corrupt or not a goodput ledger ({exc})") from exc
    finally:
        conn.close()
    by_session: dict[int, list[Event]] = {s.id: [] for s in sessions}
    for event in events:
        by_session.setdefault(event.session, []).append(event)
    return Ledger(path=path, schema_version=version, sessions=sessions, events=events,
                  live=_lock_held(real + ".lock"), by_session=by_session)


def _connect_readonly(path: str) -> sqlite3.Connection:
    uri = "file:" + quote(os.path.abspath(path))
    try:
        conn = sqlite3.connect(uri + "?mode=ro", uri=True)
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return conn
    except sqlite3.OperationalError:
        # A read-only directory cannot hold the -shm file WAL readers need. Without a -wal
        # file there is nothing to replay, so an immutable open reads everything committed.
        wal = path + "-wal"
        if os.path.exists(wal) and os.path.getsize(wal) > 0:
            raise
        return sqlite3.connect(uri + "?immutable=1", uri=True)


def _lock_held(lock_path: str) -> bool:
    """Whether a writer holds the job lock: a non-blocking shared lock, released at once
    (a writer starting meanwhile retries its exclusive lock briefly; see writer.py)."""
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _json(text: str) -> dict:
    try:
        value = json.loads(text)
        return value if isinstance(value, dict) else {"value": value}
    except (TypeError, ValueError):
        return {"unparsed": text}
