"""Known dependency noise, hidden by the command line (never by the library).

On a CPU host megatron-core says at import, once per module and once per process, that
Apex / Transformer Engine are missing and it falls back to torch; 0.19 adds deprecation
and "experimental" notes of its own defaults, and a CUDA build of torch logs that it found
no CUDA runtime. Every rank printed its own copies, over the progress bar. The CLI entry
points (``megatron-rrfp ...``, ``python -m megatron_rrfp.train``) hide exactly these,
for their own process and for the ranks they start, and print one line instead (rank 0,
just before ranks start: ``announce``).

How the ranks learn it: the entry point sets ``MEGATRON_RRFP_QUIET_DEPENDENCIES=1`` in
its environment, which every rank inherits (torchrun's children, the local launcher's
fork server and its ranks); each of them calls ``from_environment()`` before it imports
megatron-core (the fork server imports ``megatron_rrfp.launch.rank_filters`` first).

``import megatron_rrfp`` and its library calls touch no filter. A user's own choice wins:
with ``PYTHONWARNINGS`` or ``-W`` set nothing is hidden (``PYTHONWARNINGS=default``
shows every copy).
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import warnings
from collections.abc import Iterator

ENV = "MEGATRON_RRFP_QUIET_DEPENDENCIES"

_MEGATRON = r"megatron\."
_WARNINGS = (  # (message regex, category, module regex of the warning's origin)
    (r"(Transformer Engine and Apex are|Apex is|Transformer Engine is) not installed", UserWarning, _MEGATRON),
    (r"full scope is deprecated", UserWarning, _MEGATRON),  # megatron-core's own cuda_graph_scope default
    (r"\w+ is experimental and still under active development", UserWarning, _MEGATRON),
    ("", DeprecationWarning, _MEGATRON),
    ("", FutureWarning, _MEGATRON),
    # torch 2.13's deprecation of the names megatron-core's timers, DDP and TP layers call (attributed to torch's
    # c10d_logger wrapper, not to megatron); the project's own collectives use the new names (ranks.py)
    (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated", FutureWarning,
     r"torch\.distributed\."),
)
_LOGS = {  # logger -> message prefixes
    "torch.utils.cpp_extension": ("No CUDA runtime is found",),  # a CUDA build of torch on a CPU host
    "megatron.core.models.gpt.gpt_model": ("GPTModel IS DEPRECATED",),
}


class _DropKnown(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


_installed: list[tuple[logging.Logger, logging.Filter]] = []


def _user_chose() -> bool:
    return bool(sys.warnoptions) or bool(os.environ.get("PYTHONWARNINGS"))


def hide_known() -> None:
    """Add the filters to this process (idempotent); nothing where the user set -W / PYTHONWARNINGS."""
    if _installed or _user_chose():
        return
    for message, category, module in _WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, prefixes in _LOGS.items():
        logger, drop = logging.getLogger(name), _DropKnown(prefixes)
        logger.addFilter(drop)
        _installed.append((logger, drop))


def from_environment() -> None:
    """A rank (or the fork server) started by a CLI entry point: the same filters."""
    if os.environ.get(ENV) == "1":
        hide_known()


def note() -> str | None:
    """The one line that replaces the hidden warnings (None where nothing is missing)."""
    missing = [name for name, module in (("Transformer Engine", "transformer_engine"), ("Apex", "apex"))
               if _absent(module)]
    if not missing or _user_chose():
        return None
    verb = "are" if len(missing) > 1 else "is"
    return (f"megatron-rrfp: {' and '.join(missing)} {verb} not installed: megatron-core uses its torch fallbacks "
            "(expected on CPU); its per-rank warnings about it and its deprecation notes are hidden "
            "(PYTHONWARNINGS=default shows them)")


def _absent(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


_pending: list[bool] = []  # the entry point of this process has a line to say


def announce() -> None:
    """Print the one line, if this process's entry point has one to say: called just before
    ranks start or megatron-core is imported (launcher, torchrun, train setup, bench before
    its progress bar), so a bad flag's error stays the only line, and the progress bar is
    never written over. Once per process, rank 0 only."""
    if _pending:
        _pending.clear()
        if int(os.environ.get("RANK", "0") or 0) == 0:
            line = note()
            if line:
                print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def for_entry_point(*, announce: bool) -> Iterator[None]:
    """Around a CLI command: filters on for this process and (by the environment) every rank
    it starts, restored on the way out (a command run in-process, e.g. by tests, leaves the
    caller's filters and environment as they were). ``announce``: the command runs
    megatron-core, so its one line is due (``announce()``), unless a parent entry point
    already said it (its ranks inherit ``ENV``)."""
    previous = os.environ.get(ENV)
    with warnings.catch_warnings():
        if not _user_chose():
            os.environ[ENV] = "1"
        fresh = not _installed
        hide_known()
        if announce and previous != "1":
            _pending[:] = [True]
        try:
            yield
        finally:
            _pending.clear()
            if previous is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = previous
            if fresh:
                while _installed:
                    logger, drop = _installed.pop()
                    logger.removeFilter(drop)
