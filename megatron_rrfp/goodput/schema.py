"""The goodput ledger's on-disk schema, event kinds and errors (shared by writer and reader).

Schema (version 1; ``PRAGMA application_id`` = 'RRFP', ``PRAGMA user_version`` = 1):
  meta(key, value)                       schema_version, created_wall, writer
  sessions(id, uid, job, host, pid, started_wall, started_mono, info)   one row per writer process
  events(seq, session, kind, wall, mono, iteration, rank, data)          data: JSON object
"""
from __future__ import annotations

import time
from collections.abc import Callable

APPLICATION_ID = 0x52524650  # "RRFP"
SCHEMA_VERSION = 1
SQLITE_MAGIC = b"SQLite format 3\x00"

EVENT_KINDS = (
    "job_start", "job_end",
    "iteration_start", "iteration_end",
    "checkpoint_save_start", "checkpoint_save_end",
    "checkpoint_load_start", "checkpoint_load_end",
    "data_wait",  # a standalone data-loading wait: data.seconds ended at this event's time
    "disruption",  # data: kind, message, rank
    "restart",  # data: resumed_from (the iteration whose checkpoint was loaded)
)

SCHEMA_SQL = """
CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE sessions(
    id INTEGER PRIMARY KEY AUTOINCREMENT, uid TEXT NOT NULL UNIQUE, job TEXT, host TEXT, pid INTEGER,
    started_wall REAL NOT NULL, started_mono REAL NOT NULL, info TEXT NOT NULL DEFAULT '{}');
CREATE TABLE events(
    seq INTEGER PRIMARY KEY AUTOINCREMENT, session INTEGER NOT NULL REFERENCES sessions(id),
    kind TEXT NOT NULL, wall REAL NOT NULL, mono REAL NOT NULL, iteration INTEGER, rank INTEGER,
    data TEXT NOT NULL DEFAULT '{}');
CREATE INDEX events_by_session ON events(session, seq);
"""

Clock = Callable[[], tuple]  # () -> (wall seconds since the epoch, monotonic seconds)


def system_clock() -> tuple[float, float]:
    return time.time(), time.monotonic()


class LedgerError(ValueError):
    """The ledger file cannot be read (missing, not SQLite, corrupt, other schema)."""


class LedgerBusyError(RuntimeError):
    """Another live process is writing this job's ledger."""


class LedgerWarning(RuntimeWarning):
    """The ledger could not be written; training goes on (events may be lost)."""


def check_identity(path: str, app_id: int, version: int, tables: int) -> None:
    if app_id != APPLICATION_ID:
        what = "an empty SQLite database" if tables == 0 else "a SQLite database but not a megatron-rrfp goodput ledger"
        raise LedgerError(f"{path}: {what} (application_id {app_id:#x}, expected {APPLICATION_ID:#x})")
    if version != SCHEMA_VERSION:
        raise LedgerError(f"{path}: goodput ledger schema version {version}, but this megatron-rrfp reads version "
                          f"{SCHEMA_VERSION}; read it with the megatron-rrfp release that wrote it")
