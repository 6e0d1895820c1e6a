"""Goodput: how much of the wall time moved training forward, and where the rest went.

``writer.py`` (durable SQLite event ledger, off the training thread), ``reader.py``,
``schema.py``, ``recorder.py`` (the hooks a training loop calls, per rank),
``accounting.py`` (wall time split into productive time and badput categories that sum
to it, pipeline bubbles and TP coordination included) and ``cli.py`` (`megatron-rrfp
goodput`: table, JSON, PNG).
"""
from .accounting import CATEGORIES, GoodputReport, compute_goodput, goodput_report
from .reader import Ledger, load_ledger
from .recorder import GoodputRecorder
from .schema import LedgerBusyError, LedgerError, LedgerWarning
from .writer import LedgerWriter

__all__ = ["CATEGORIES", "GoodputRecorder", "GoodputReport", "Ledger", "LedgerBusyError", "LedgerError",
           "LedgerWarning", "LedgerWriter", "compute_goodput", "goodput_report", "load_ledger"]
