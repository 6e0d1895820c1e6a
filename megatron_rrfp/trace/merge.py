"""One trace file for every rank of an iteration, on one clock (collective, torch.distributed).

Each rank measures its spans from its own iteration start on its own host clock
(``IterationReport.started_at`` + span times). ``gather_merged_spans`` estimates every host's
clock offset from rank 0's (``clock_offsets``: all ranks read their clock right after a
barrier, a few times; a host's offset is the median difference to rank 0 over its ranks and
rounds, to about the barrier's exit skew; rank 0's host reads the same clock, offset 0, where
an estimate would add only that skew, milliseconds on a loaded host), moves every span onto
rank 0's clock with t = 0 at the earliest start, and returns them on rank 0 only.
``write_merged_trace`` writes them as one Perfetto/Chrome file (pid = rank), with an arrow
from each send to its receive (``chrome.py``).

Every rank must call these at the same point (they are collectives); without an
initialised process group they act on this process alone.
"""
from __future__ import annotations

import socket
import statistics
import time
from dataclasses import replace
from typing import Optional

from .chrome import Span, write_chrome_trace

CLOCK_ROUNDS = 3


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def clock_offsets(rounds: int = CLOCK_ROUNDS, group=None) -> list[float]:
    """Per rank (by group rank): its host's clock minus rank 0's, in seconds. Collective."""
    dist = _dist()
    if dist is None:
        return [0.0]
    host = socket.gethostname()
    differences: dict = {}  # host -> every reading's difference to rank 0's, over its ranks and rounds
    for _ in range(rounds):
        dist.barrier(group=group)
        readings: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(readings, (host, time.time()), group=group)
        hosts = [h for h, _ in readings]
        for h, reading in readings:
            differences.setdefault(h, []).append(reading - readings[0][1])
    offsets = {h: 0.0 if h == hosts[0] else statistics.median(d) for h, d in differences.items()}
    return [offsets[h] for h in hosts]


def gather_merged_spans(spans: list[Span], started_at: float, *, label: Optional[str] = None,
                        info: Optional[dict] = None, group=None, dst: int = 0
                        ) -> Optional[tuple[list[Span], dict, dict]]:
    """Collective. On ``dst``: (every rank's spans on one clock, {rank: label}, {rank: info});
    elsewhere None."""
    dist = _dist()
    rank = dist.get_rank(group) if dist is not None else 0
    offsets = clock_offsets(group=group)
    mine = (rank, started_at - offsets[rank], list(spans), (label or f"rank {rank}", info or {}))
    if dist is None:
        everyone = [mine]
    else:
        everyone = [None] * dist.get_world_size(group) if rank == dst else None
        dist.gather_object(mine, everyone, dst=dst, group=group)
        if rank != dst:
            return None
    origin = min(start for _, start, _, _ in everyone)
    merged = [replace(span, start=span.start + start - origin, end=span.end + start - origin)
              for _, start, rank_spans, _ in everyone for span in rank_spans]
    return merged, {r: meta[0] for r, _, _, meta in everyone}, {r: meta[1] for r, _, _, meta in everyone}


def write_merged_trace(spans: list[Span], started_at: float, path: str, *, label: Optional[str] = None,
                       info: Optional[dict] = None, metadata: Optional[dict] = None, group=None) -> Optional[str]:
    """Collective: gather every rank's spans (``gather_merged_spans``) and write them on
    rank 0 as one trace at ``path`` (each rank's ``info`` under ``otherData.ranks``);
    returns the path there, None elsewhere."""
    merged = gather_merged_spans(spans, started_at, label=label, info=info, group=group)
    if merged is None:
        return None
    spans, labels, infos = merged
    meta = {"clock": "common: every rank's spans shifted onto rank 0's host clock (barrier-aligned offsets)",
            **(metadata or {}), "ranks": {str(r): i for r, i in infos.items()}}
    return write_chrome_trace(spans, path, metadata=meta, rank_labels=labels)


__all__ = ["clock_offsets", "gather_merged_spans", "write_merged_trace"]
