"""From a hint spec to a ``Hint``: a built-in name (``make_hint``), or a file — a per-stage
task list as JSON, or a torch.distributed.pipelining action CSV — read into an ``OrderedHint``."""
from __future__ import annotations

import json
import os
import re
from typing import Optional

from .actions import Kind, Task
from .hints import BUILTIN_HINTS, Hint, HintError, OrderedHint, builtin_hint

MAX_HINT_FILE_BYTES = 64 * 2**20
"""A hint file is a list of task names; anything larger is not one."""


def _read_hint_text(path: str) -> str:
    """The file's text (UTF-8, an optional BOM); HintError naming the file otherwise."""
    try:
        size = os.path.getsize(path)
        if size > MAX_HINT_FILE_BYTES:
            raise HintError(f"hint file {path!r} is {size} bytes; a hint file lists task names and is at most "
                            f"{MAX_HINT_FILE_BYTES} bytes")
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as exc:
        raise HintError(f"cannot read hint file {path!r}: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise HintError(f"hint file {path!r} is not UTF-8 text (byte {exc.start}: {data[exc.start:exc.start + 1]!r})"
                        "; save it as UTF-8") from None
    if "\x00" in text:
        raise HintError(f"hint file {path!r} contains NUL characters: not a text file (UTF-16? save it as UTF-8)")
    return text


def load_hint_file(path: str) -> OrderedHint:
    """JSON: ``{"stages": [["0F0", "0F1", "0B0", ...], ...]}`` or a bare list of lists;
    each entry a task string or one comma-separated string per stage."""
    text = _read_hint_text(path)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise HintError(f"hint file {path!r} is not valid JSON: {str(exc).splitlines()[0][:200]}") from None
    stages = data.get("stages") if isinstance(data, dict) else data
    if not isinstance(stages, list) or not stages:
        raise HintError(f"hint file {path!r}: expected {{\"stages\": [[task, ...], ...]}} with one list per stage")
    orders = []
    for index, entry in enumerate(stages):
        if isinstance(entry, str):
            tasks = entry.split(",")
        elif isinstance(entry, list) and all(isinstance(t, str) for t in entry):
            tasks = entry
        else:
            raise HintError(f"hint file {path!r}, stage {index}: expected a list of task strings or one "
                            f"comma-separated string (e.g. \"0F0,0B0\"), got {_short(entry)}")
        try:
            orders.append([Task.parse(t) for t in tasks if t.strip()])
        except ValueError as exc:
            raise HintError(f"hint file {path!r}, stage {index}: {_short(exc, 200)}") from None
    return OrderedHint(os.path.basename(path), orders)


def _short(value: object, limit: int = 60) -> str:
    text = value if isinstance(value, (str, BaseException)) else json.dumps(value, default=str)
    text = " ".join(str(text).split()).encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 3] + "..."


_PIPELINING_ACTION = re.compile(r"^\s*(\d+)\s*([A-Z_]+?)\s*(\d+)\s*$")
# torch.distributed.pipelining computation types -> ours. "I" (backward input) is our B of
# a split backward; "B" (full backward) our unsplit B; communication actions are dropped
# (the transport is message-driven).
_PIPELINING_KINDS = {"F": Kind.F, "I": Kind.B, "W": Kind.W, "B": Kind.B}
_PIPELINING_COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD")


def load_pipelining_csv(path: str, num_stages: Optional[int] = None) -> OrderedHint:
    """torch.distributed.pipelining's CSV: one row per rank, cells ``{stage}{F|I|W|B}{mb}``
    (e.g. ``0F0,0I0,0W0``), stage = global (virtual) stage. Megatron places virtual stage v
    on rank v % PP as chunk v // PP ("loop" placement); a schedule written for another
    placement (e.g. ZBV's V shape) is rejected with the offending cell."""
    rows = [[c.strip() for c in line.strip().split(",") if c.strip()]
            for line in _read_hint_text(path).splitlines() if line.strip()]
    if not rows:
        raise HintError(f"hint file {path!r} is empty: expected one row of actions per rank")
    pp = num_stages or len(rows)
    if len(rows) != pp:
        raise HintError(f"hint file {path!r} has {len(rows)} rows but the pipeline has {pp} stages; one row per rank")
    orders, kinds_seen = [], set()
    for rank, row in enumerate(rows):
        order = []
        for cell in row:
            if cell.upper() in ("NONE", "") or any(comm in cell for comm in _PIPELINING_COMM):
                continue
            match = _PIPELINING_ACTION.match(cell)
            if match is None or match.group(2) not in _PIPELINING_KINDS:
                raise HintError(f"hint file {path!r}, rank {rank}: unknown action {_short(cell)!r} "
                                "(expected e.g. 0F0, 1I2, 0W1 or 0B3)")
            stage, kind, mb = int(match.group(1)), match.group(2), int(match.group(3))
            if stage % pp != rank:
                raise HintError(f"hint file {path!r}, rank {rank}: action {cell!r} belongs to stage {stage}, which "
                                f"Megatron places on rank {stage % pp}; only loop placement is supported")
            kinds_seen.add(kind)
            order.append(Task(_PIPELINING_KINDS[kind], mb, stage // pp))
        orders.append(order)
    if "B" in kinds_seen and kinds_seen & {"I", "W"}:
        raise HintError(f"hint file {path!r} mixes full backwards (B) with split ones (I/W); use one form")
    return OrderedHint(os.path.basename(path), orders)


def make_hint(spec: str | Hint) -> Hint:
    if isinstance(spec, Hint):
        return spec
    if spec in BUILTIN_HINTS:
        return builtin_hint(spec)
    if isinstance(spec, str) and os.path.isfile(spec):
        return load_pipelining_csv(spec) if spec.lower().endswith(".csv") else load_hint_file(spec)
    if isinstance(spec, str) and (os.sep in spec or spec.lower().endswith((".json", ".csv")) or os.path.exists(spec)):
        what = "is not a file" if os.path.exists(spec) else "does not exist"
        raise HintError(f"hint file {spec!r} {what} (option hint= / --rrfp-hint): give the path of a JSON hint "
                        f"file or a torch.distributed.pipelining CSV, or one of {', '.join(BUILTIN_HINTS)}")
    raise HintError(
        f"unknown hint {spec!r} (option hint= / --rrfp-hint): use one of "
        f"{', '.join(BUILTIN_HINTS)}, or the path of a JSON hint file or a torch.distributed.pipelining CSV"
    )


__all__ = ["MAX_HINT_FILE_BYTES", "load_hint_file", "load_pipelining_csv", "make_hint"]
