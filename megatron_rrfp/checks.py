"""Value checks shared by the configs and the command lines (standard library only).

Each config declares the range of each numeric option once, as a ``Bound``; the same
object checks the dataclass (``Bound.check``: ValueError naming the option) and types the
command-line flag (``Bound.parse``: argparse rejects ``nan``, ``inf``, ``1e999`` and
out-of-range values while parsing, before anything is built or started). ``OneLineParser``
reports a bad flag as one line instead of the usage dump.

Upper limits exist where a larger value is a typo rather than a plan and would otherwise
overflow (timeouts become ``datetime.timedelta`` and ``threading`` waits; a log-normal
sigma of 1e3 makes every duration infinite) or start an absurd amount of work.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import NoReturn, Optional, Union

Number = Union[int, float]

MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""A week: the longest timeout any option accepts (larger values overflow timers)."""


@dataclass(frozen=True, slots=True)
class Bound:
    """An accepted range: ``low``/``high`` (None: unbounded), open or closed, integer or
    finite real. ``optional``: None is accepted too (the option was not given)."""

    low: Optional[Number] = None
    high: Optional[Number] = None
    integer: bool = False
    low_open: bool = False
    high_open: bool = False
    optional: bool = False

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        low, high = _fmt(self.low), _fmt(self.high)
        if self.low is not None and self.high is not None:
            return f"{kind} in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{kind} {'>' if self.low_open else '>='} {low}"
        if self.high is not None:
            return f"{kind} {'<' if self.high_open else '<='} {high}"
        return kind

    def accepts(self, value) -> bool:
        if value is None:
            return self.optional
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.integer and not isinstance(value, int):
            return False
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return not (self.high is not None and (value >= self.high if self.high_open else value > self.high))

    def check(self, name: str, value):
        """``value`` if accepted, else ValueError: '<name> must be <range>, got <value>'."""
        if not self.accepts(value):
            raise ValueError(f"{name} must be {self.describe()}, got {value!r}")
        return value

    def parse(self, text: str):
        """argparse ``type=``: the value, or ArgumentTypeError naming the range."""
        try:
            value = int(text, 10) if self.integer else float(text)
        except (TypeError, ValueError):
            value = None
        if value is None or not self.accepts(value):
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {text!r}")
        return value


def _fmt(value: Optional[Number]) -> str:
    if value is None:
        return ""
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:g}"


def bound(low: Optional[Number] = None, high: Optional[Number] = None, **kwargs) -> Bound:
    return Bound(low, high, **kwargs)


def integer(low: Optional[int] = None, high: Optional[int] = None, **kwargs) -> Bound:
    return Bound(low, high, integer=True, **kwargs)


@dataclass(frozen=True, slots=True)
class LimitBound:
    """The buffer-limit option: an integer >= 1, a positive multiple of Megatron's own peak
    in flight ("1x", "1.5x") or "auto" (policy/budget.py); same interface as ``Bound``."""

    def describe(self) -> str:
        return "an integer >= 1, a multiple of Megatron's memory such as 1x or 1.5x, or auto"

    def accepts(self, value) -> bool:
        from .policy.budget import BufferLimitError, check_limit_spec

        try:
            check_limit_spec(value)
        except BufferLimitError:
            return False
        return True

    def check(self, name: str, value):
        if not self.accepts(value):
            raise ValueError(f"{name} must be {self.describe()}, got {value!r}")
        return value

    def parse(self, text: str):
        """argparse ``type=``: 8 (int), "1.5x" or "auto", else ArgumentTypeError."""
        value = int(text) if str(text).strip().isdigit() else str(text).strip()
        if not self.accepts(value):
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {text!r}")
        return value


class LimitListBound(LimitBound):
    """`bench --buffer-limit`: one limit, or a comma list of distinct ones (a speedup-vs-memory
    sweep); parses to the single value, or to a list when several are given."""

    def describe(self) -> str:
        return f"{super().describe()}; or a comma list of distinct ones such as 1x,1.5x,2x"

    def accepts(self, value) -> bool:
        if isinstance(value, (list, tuple)):
            return bool(value) and len({str(v) for v in value}) == len(value) and all(
                LimitBound.accepts(self, v) for v in value)
        return super().accepts(value)

    def parse(self, text: str):
        values = []
        for part in str(text).split(","):
            try:
                values.append(LimitBound.parse(self, part))
            except argparse.ArgumentTypeError:
                raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {text!r}") from None
        if not self.accepts(values):
            raise argparse.ArgumentTypeError(f"must be {self.describe()} (each limit once), got {text!r}")
        return values[0] if len(values) == 1 else values


BUFFER_LIMIT = LimitBound()
BUFFER_LIMITS = LimitListBound()
"""`bench`'s: ``BUFFER_LIMIT`` or a list of distinct limits."""
FINITE = Bound()
POSITIVE = Bound(0, low_open=True)
NON_NEGATIVE = Bound(0)
TIMEOUT_S = Bound(0, MAX_TIMEOUT_S, low_open=True)
"""Seconds of a timeout: > 0 and at most a week."""


def check_fields(config, bounds: dict[str, Bound], flags: Optional[dict[str, str]] = None) -> None:
    """Check ``config.<field>`` against ``bounds[field]``; errors name ``flags[field]``
    (a command-line flag) when given, else the field."""
    for name, limit in bounds.items():
        label = (flags or {}).get(name) or name
        limit.check(label, getattr(config, name))


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (and exit status 2), naming
    the flag and what it accepts; ``--help`` still shows the full usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def report_error(prog: str, error: BaseException) -> int:
    """``prog: error: <first line>`` on stderr (a diagnosis after it, indented, e.g. a
    strict hint's stalled stages); returns 2, the exit status of a user error."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    print(f"{prog}: error: {lines[0]}", file=sys.stderr)
    for line in lines[1:]:
        print(f"    {line}", file=sys.stderr)
    return 2


__all__ = ["FINITE", "MAX_TIMEOUT_S", "NON_NEGATIVE", "POSITIVE", "TIMEOUT_S", "Bound", "OneLineParser", "bound",
           "check_fields", "integer", "report_error"]
