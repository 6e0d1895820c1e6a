"""Goodput: where did the job's time go?

    megatron-rrfp goodput run/goodput.db --json goodput.json --png goodput.png

Throughput counts every token pushed through the model; goodput counts only work that
moved training forward. From the ledger of one job (``writer.py`` writes it, ``reader.py``
reads it) -- all its processes, disruptions and restarts -- this module splits the job's
wall time into productive time and nine badput categories that add up to it exactly:

    wall_s = productive_s + startup + checkpoint_save + checkpoint_load + data_loading
             + wasted_progress + recovery + pipeline_bubble + tp_coordination + other

    goodput               = productive_s / wall_s                              (fraction)
    goodput tokens/s      = tokens of kept iterations / wall_s
    throughput tokens/s   = tokens of all completed iterations / their summed duration

How each second is attributed (sessions on one time axis, iterations and their breakdown,
wasted progress, overlapping spans): docs/goodput.md. The calls a training loop makes to
record a job: ``recorder.py``.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Optional

from ..runtime.report import BREAKDOWN_FIELDS as EXECUTOR_FIELDS
from .reader import Ledger, load_ledger

CATEGORIES = ("startup", "checkpoint_save", "checkpoint_load", "data_loading", "wasted_progress",
              "recovery", "pipeline_bubble", "tp_coordination", "other")
BREAKDOWN_FIELDS = (*EXECUTOR_FIELDS, "data_wait_s", "schedule_s")
"""Per-rank, per-iteration breakdown; stats in the ledger are [min, median, mean, max] over ranks."""
MEMORY_FIELDS = ("peak_activation_bytes", "peak_in_flight")
"""Per-rank peak activation memory of the iteration's schedule call and its peak forwards in
flight; stats over the ranks that measured them (absent when none did)."""

_SAVE, _LOAD, _DATA, _ITER, _BASE = range(5)  # span priorities: lower wins


def summarize_ranks(vectors: list[list[float]], tokens: int) -> dict:
    """The ``iteration_end`` payload from each rank's ``breakdown_vector``: [min, median, mean, max]."""
    stats = {}
    for i, name in enumerate(BREAKDOWN_FIELDS):
        values = [float(v[i]) for v in vectors]
        stats[name] = [min(values), statistics.median(values), statistics.fmean(values), max(values)]
    measured = sum(1 for v in vectors if v[len(BREAKDOWN_FIELDS)] > 0)
    for i, name in enumerate(MEMORY_FIELDS, start=len(BREAKDOWN_FIELDS) + 1):
        values = [float(v[i]) for v in vectors if len(v) > i and v[i] >= 0]
        if values:
            stats[name] = [min(values), statistics.median(values), statistics.fmean(values), max(values)]
    return {"tokens": int(tokens), "ranks": len(vectors), "measured_ranks": measured, "stats": stats}


@dataclass(slots=True)
class IterationRecord:
    session: int
    iteration: int
    start: float  # seconds since the job started
    end: float
    tokens: int = 0
    stats: dict = field(default_factory=dict)
    measured: bool = False
    fate: str = "kept"  # kept | wasted | incomplete
    _shares: Optional[tuple] = field(default=None, repr=False)

    @property
    def duration(self) -> float:
        return max(0.0, self.end - self.start)

    def shares(self) -> dict[str, float]:
        """Fractions of this iteration per category (productive + badput), summing to 1."""
        if self._shares is None or self._shares[0] != self.fate:
            self._shares = (self.fate, self._compute_shares())
        return self._shares[1]

    def _compute_shares(self) -> dict[str, float]:
        if self.fate != "kept":
            return {"wasted_progress": 1.0}
        d = self.duration
        if d <= 0:
            return {"productive": 1.0}
        mean = lambda name: self.stats[name][2] if name in self.stats else 0.0  # noqa: E731  (mean over ranks)
        bubble = mean("wait_s") + mean("backpressure_s") + mean("flush_s")
        tp, data = mean("agree_s"), mean("data_wait_s")
        idle = bubble + tp + data
        scale = min(1.0, d / idle) if idle > 0 else 1.0
        shares = {"pipeline_bubble": bubble * scale / d, "tp_coordination": tp * scale / d,
                  "data_loading": data * scale / d}
        productive = max(0.0, 1.0 - sum(shares.values()))
        compute = min(mean("compute_s") / d, productive) if self.measured else 0.0  # unknown: not split
        shares["productive"] = productive
        shares["fb_compute"] = compute  # sub-share of productive, not added to the sum
        return shares


@dataclass(slots=True)
class Disruption:
    time_s: float
    session: int
    kind: str
    message: str = ""
    rank: Optional[int] = None
    inferred: bool = False
    resumed_from: Optional[int] = None
    resumed_at_s: Optional[float] = None
    wasted_iterations: int = 0
    wasted_s: float = 0.0
    checkpoint: Optional[str] = None  # the kind resumed from: "persistent", "local", ... (restart event)
    mechanism: Optional[str] = None  # what restarted training: "in-process", "in-job", "requeue", "relaunch"
    load_s: float = 0.0  # checkpoint loading between the disruption and the resumed iteration

    @property
    def time_to_resume_s(self) -> Optional[float]:
        """Disruption -> first iteration start after it (recovery + checkpoint load + startup)."""
        return None if self.resumed_at_s is None else self.resumed_at_s - self.time_s

    @property
    def recovery_s(self) -> Optional[float]:
        """The time to resume less its checkpoint loading (restart, startup, re-initialisation)."""
        resume = self.time_to_resume_s
        return None if resume is None else max(0.0, resume - self.load_s)


@dataclass(slots=True)
class GoodputReport:
    path: str
    job: Optional[str]
    live: bool
    start_wall: float
    wall_s: float
    productive_s: float
    fb_compute_s: float
    badput: dict[str, float]
    tokens_total: int
    tokens_kept: int
    iteration_time_s: float
    iterations: list[IterationRecord]
    disruptions: list[Disruption]
    sessions: int
    checkpoint_saves: int
    timeline: list[dict]
    breakdown: dict[str, dict[str, float]]

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def goodput_tokens_per_s(self) -> float:
        return self.tokens_kept / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def throughput_tokens_per_s(self) -> float:
        return self.tokens_total / self.iteration_time_s if self.iteration_time_s > 0 else 0.0

    @property
    def accounted_s(self) -> float:
        """productive + every badput category; equals wall_s (up to float rounding)."""
        return self.productive_s + sum(self.badput.values())

    def count(self, fate: str) -> int:
        return sum(1 for r in self.iterations if r.fate == fate)

    def disruptions_total(self) -> dict:
        """Over every disruption: iterations lost, time to resume split into recovery and checkpoint
        load (of the resumed ones), and how many each restart mechanism / checkpoint kind resumed."""
        resumed = [d for d in self.disruptions if d.time_to_resume_s is not None]
        by = {"mechanism": {}, "checkpoint": {}}
        for d in resumed:
            for key in by:
                name = getattr(d, key) or "unknown"
                by[key][name] = by[key].get(name, 0) + 1
        return {"disruptions": len(self.disruptions), "resumed": len(resumed),
                "wasted_iterations": sum(d.wasted_iterations for d in self.disruptions),
                "wasted_s": sum(d.wasted_s for d in self.disruptions),
                "time_to_resume_s": sum(d.time_to_resume_s for d in resumed),
                "recovery_s": sum(d.recovery_s for d in resumed), "checkpoint_load_s": sum(d.load_s for d in resumed),
                "by_mechanism": by["mechanism"], "by_checkpoint": by["checkpoint"]}

    @property
    def unmeasured_iterations(self) -> int:
        return sum(1 for r in self.iterations if r.fate == "kept" and not r.measured)

    def to_dict(self) -> dict:
        return {
            "ledger": self.path, "job": self.job, "live": self.live, "start_wall": self.start_wall,
            "wall_s": self.wall_s, "productive_s": self.productive_s, "goodput": self.goodput,
            "productive_detail_s": {"fb_compute": self.fb_compute_s,
                                    "rest_of_step": self.productive_s - self.fb_compute_s},
            "badput_s": dict(self.badput), "categories_sum_s": self.accounted_s,
            "tokens": {"total": self.tokens_total, "kept": self.tokens_kept,
                       "goodput_tokens_per_s": self.goodput_tokens_per_s,
                       "throughput_tokens_per_s": self.throughput_tokens_per_s},
            "iterations": {"completed": self.count("kept") + self.count("wasted"), "kept": self.count("kept"),
                           "wasted": self.count("wasted"), "incomplete": self.count("incomplete"),
                           "without_breakdown": self.unmeasured_iterations,
                           "mean_s": self.iteration_time_s / max(1, self.count("kept") + self.count("wasted"))},
            "breakdown_across_ranks_s": {k: v for k, v in self.breakdown.items() if k not in MEMORY_FIELDS},
            "memory_across_ranks": {k: v for k, v in self.breakdown.items() if k in MEMORY_FIELDS},
            "sessions": self.sessions, "checkpoint_saves": self.checkpoint_saves,
            "disruptions": [{"time_s": d.time_s, "session": d.session, "kind": d.kind, "message": d.message,
                             "rank": d.rank, "inferred": d.inferred, "resumed_from": d.resumed_from,
                             "time_to_resume_s": d.time_to_resume_s, "recovery_s": d.recovery_s,
                             "checkpoint_load_s": d.load_s, "checkpoint": d.checkpoint, "mechanism": d.mechanism,
                             "wasted_iterations": d.wasted_iterations, "wasted_s": d.wasted_s}
                            for d in self.disruptions],
            "disruptions_total": self.disruptions_total(),
            "timeline": self.timeline,
        }


def goodput_report(path: str, *, bins: int = 60) -> GoodputReport:
    """Read a ledger and account for its time (``LedgerError`` if it cannot be read)."""
    return compute_goodput(load_ledger(path), bins=bins)


# -- the accounting -----------------------------------------------------------------

class _Walk:
    """One chronological pass over every session's events."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.records: list[IterationRecord] = []
        self.spans: list[tuple[float, float, int, object]] = []  # (start, end, priority, payload)
        self.disruptions: list[Disruption] = []
        self.pending: Optional[Disruption] = None  # not yet followed by an iteration start
        self.last_saved: Optional[int] = None
        self.saves = 0
        self.origin = ledger.sessions[0].started_wall if ledger.sessions else 0.0
        self.end = 0.0
        self._mode = "startup"  # the background category right now: startup | recovery | other
        self._marks: list[tuple[float, str]] = []
        self._resume_known = True

    def run(self) -> None:
        previous_end: Optional[float] = None
        sessions = [s for s in self.ledger.sessions if self.ledger.by_session.get(s.id)]
        for index, session in enumerate(sessions):
            events = self.ledger.by_session[session.id]
            start = session.started_wall - self.origin
            if previous_end is not None:
                start = max(start, previous_end)
                self._base(previous_end, start, "recovery" if self.pending else "other")
            end = self._session(session, events, start, first=index == 0,
                                last_live=self.ledger.live and index == len(sessions) - 1)
            previous_end = end
        self.end = previous_end or 0.0
        if self.pending is not None and not self.ledger.live:
            # The job's last process died and nothing resumed it: what was not saved is lost.
            self._restart(self.last_saved if self.last_saved is not None else -1, cause=self.pending)

    def _session(self, session, events, start: float, *, first: bool, last_live: bool) -> float:
        at = {e.seq: start + (e.mono - session.started_mono) for e in events}
        end = max([start, *at.values()])
        self._mode = "recovery" if self.pending else "startup"
        self._marks = [(start, self._mode)]  # where the background category changes
        # A new process without restart(): it resumed from its first iteration - 1.
        self._resume_known = first or any(e.kind == "restart" for e in events)
        open_iter: Optional[tuple[int, float]] = None
        open_save = open_load = None
        boundary = start  # the start of an iteration whose iteration_start is missing
        clean = False
        for e in events:
            t = at[e.seq]
            if e.kind == "iteration_start":
                if open_iter is not None:
                    self._incomplete(session.id, open_iter, t)
                self._iteration_begins(t, e.iteration)
                open_iter = (e.iteration, t)
            elif e.kind == "iteration_end":
                if open_iter is not None and open_iter[0] == e.iteration:
                    begin = open_iter[1]
                else:
                    if open_iter is not None:
                        self._incomplete(session.id, open_iter, t)
                    begin = boundary
                    self._iteration_begins(begin, e.iteration)
                open_iter = None
                record = IterationRecord(session.id, e.iteration, begin, t, tokens=int(e.data.get("tokens", 0)),
                                         stats=e.data.get("stats", {}), measured=e.data.get("measured_ranks", 0) > 0)
                self.records.append(record)
                self.spans.append((begin, t, _ITER, record))
                boundary = t
            elif e.kind == "checkpoint_save_start":
                open_save = t
            elif e.kind == "checkpoint_save_end":
                self.spans.append((open_save if open_save is not None else t, t, _SAVE, "checkpoint_save"))
                open_save, boundary = None, t
                if e.data.get("ok", True) and e.iteration is not None:
                    self.last_saved, self.saves = e.iteration, self.saves + 1
            elif e.kind == "checkpoint_load_start":
                open_load = t
            elif e.kind == "checkpoint_load_end":
                self.spans.append((open_load if open_load is not None else t, t, _LOAD, "checkpoint_load"))
                if self.pending is not None:  # loading to resume after it
                    self.pending.load_s += t - (open_load if open_load is not None else t)
                open_load, boundary = None, t
            elif e.kind == "data_wait":
                self.spans.append((max(start, t - float(e.data.get("seconds", 0.0))), t, _DATA, "data_loading"))
                boundary = t
            elif e.kind == "disruption":
                self.pending = Disruption(t, session.id, str(e.data.get("kind", "disruption")),
                                          str(e.data.get("message", "")), e.data.get("rank", e.rank))
                self.disruptions.append(self.pending)
                if open_iter is not None:
                    self._incomplete(session.id, open_iter, t)
                    open_iter = None
                self._set_mode(t, "recovery")
            elif e.kind == "restart":
                self._restart(int(e.data.get("resumed_from", e.iteration or 0)), cause=self.pending)
                if self.pending is not None:
                    self.pending.checkpoint = e.data.get("checkpoint", self.pending.checkpoint)
                    self.pending.mechanism = e.data.get("mechanism", self.pending.mechanism)
            elif e.kind == "job_end":
                clean = True
        for opened, priority, name in ((open_save, _SAVE, "checkpoint_save"), (open_load, _LOAD, "checkpoint_load")):
            if opened is not None:
                self.spans.append((opened, end, priority, name))
        if not clean and not last_live and self.pending is None:
            last = events[-1]
            self.pending = Disruption(end, session.id, "unclean-exit", inferred=True, message=(
                f"process {session.pid} on {session.host} stopped without job_end (killed, crashed or preempted); "
                f"last event: {last.kind}" + (f" of iteration {last.iteration}" if last.iteration is not None else "")))
            self.disruptions.append(self.pending)
        if open_iter is not None and not last_live:
            self._incomplete(session.id, open_iter, end)
        self._marks.append((end, self._mode))
        for (a, category), (b, _) in zip(self._marks, self._marks[1:]):
            self._base(a, b, category)
        return end

    def _iteration_begins(self, t: float, number: int) -> None:
        if not self._resume_known:
            self._restart(number - 1, cause=self.pending)
            self._resume_known = True
        if self.pending is not None:
            self.pending.resumed_at_s = t
            self.pending = None
        self._set_mode(t, "other")

    def _set_mode(self, t: float, mode: str) -> None:
        if mode != self._mode:
            self._marks.append((t, mode))
            self._mode = mode

    def _base(self, a: float, b: float, category: str) -> None:
        if b > a:
            self.spans.append((a, b, _BASE, category))

    def _incomplete(self, session: int, open_iter: tuple[int, float], t: float) -> None:
        record = IterationRecord(session, open_iter[0], open_iter[1], t, fate="incomplete")
        self.records.append(record)
        if self.pending is not None:  # cut short by this disruption
            self.pending.wasted_s += record.duration
        self.spans.append((record.start, record.end, _ITER, record))

    def _restart(self, resumed_from: int, *, cause: Optional[Disruption]) -> None:
        for record in self.records:
            if record.fate == "kept" and record.iteration > resumed_from:
                record.fate = "wasted"
                if cause is not None:
                    cause.wasted_iterations += 1
                    cause.wasted_s += record.duration
        if cause is not None and cause.resumed_from is None:
            cause.resumed_from = resumed_from if resumed_from >= 0 else None


def compute_goodput(ledger: Ledger, *, bins: int = 60) -> GoodputReport:
    walk = _Walk(ledger)
    walk.run()
    totals = {name: 0.0 for name in ("productive", "fb_compute", *CATEGORIES)}
    segments = _sweep(walk.spans, totals)
    completed = [r for r in walk.records if r.fate != "incomplete"]
    kept = [r for r in walk.records if r.fate == "kept"]
    return GoodputReport(
        path=ledger.path, job=ledger.job, live=ledger.live, start_wall=walk.origin, wall_s=walk.end,
        productive_s=totals["productive"], fb_compute_s=totals["fb_compute"],
        badput={name: totals[name] for name in CATEGORIES},
        tokens_total=sum(r.tokens for r in completed), tokens_kept=sum(r.tokens for r in kept),
        iteration_time_s=sum(r.duration for r in completed), iterations=walk.records,
        disruptions=walk.disruptions, sessions=sum(1 for s in ledger.sessions if ledger.by_session.get(s.id)),
        checkpoint_saves=walk.saves, timeline=_bin(segments, walk.end, bins),
        breakdown=_breakdown(kept))


def _sweep(spans: list, totals: dict) -> list[tuple[float, float, dict]]:
    """Cut the timeline at every span boundary; each piece goes to its highest-priority
    span. Returns the pieces (start, end, {category: seconds}) and adds them to totals."""
    points = sorted({p for s in spans for p in (s[0], s[1])})
    starts = sorted(range(len(spans)), key=lambda i: spans[i][0])
    active: list[dict[int, None]] = [dict() for _ in range(_BASE + 1)]
    ends: dict[float, list[int]] = {}
    segments = []
    k = 0
    for a, b in zip(points, points[1:]):
        for i in ends.pop(a, ()):
            active[spans[i][2]].pop(i, None)
        while k < len(starts) and spans[starts[k]][0] <= a:
            i = starts[k]
            if spans[i][1] > a:
                active[spans[i][2]][i] = None
                ends.setdefault(spans[i][1], []).append(i)
            k += 1
        chosen = next((next(reversed(level)) for level in active if level), None)
        if chosen is None:
            continue  # no span covers (a, b): cannot happen inside the job's timeline
        piece = _attribute(spans[chosen], b - a)
        for name, seconds in piece.items():
            totals[name] += seconds
        segments.append((a, b, piece))
    return segments


def _attribute(span, length: float) -> dict[str, float]:
    payload = span[3]
    if isinstance(payload, IterationRecord):
        return {name: share * length for name, share in payload.shares().items()}
    return {payload: length}


def _bin(segments, wall_s: float, bins: int) -> list[dict]:
    """Seconds per category in ``bins`` equal slices of the job (for the chart)."""
    if wall_s <= 0 or bins < 1:
        return []
    width = wall_s / bins
    out = [{"start_s": i * width, "end_s": (i + 1) * width, **{n: 0.0 for n in ("productive", *CATEGORIES)}}
           for i in range(bins)]
    for a, b, piece in segments:
        first, last = int(a // width), min(bins - 1, int(b // width))
        for i in range(max(0, first), last + 1):
            overlap = min(b, (i + 1) * width) - max(a, i * width)
            if overlap > 0:
                for name, seconds in piece.items():
                    if name in out[i]:
                        out[i][name] += seconds * overlap / (b - a)
    return out


def _breakdown(kept: list[IterationRecord]) -> dict[str, dict[str, float]]:
    """Mean over kept iterations of the per-iteration min / median / max across ranks."""
    measured = [r for r in kept if r.measured and r.stats]
    out: dict[str, dict[str, float]] = {}
    for name in BREAKDOWN_FIELDS:
        rows = [r.stats[name] for r in measured if name in r.stats]
        if rows:
            out[name] = {"min": statistics.fmean(v[0] for v in rows), "median": statistics.fmean(v[1] for v in rows),
                         "max": statistics.fmean(v[3] for v in rows)}
    for name in MEMORY_FIELDS:  # peaks: the largest per-iteration min / median / max across ranks
        rows = [r.stats[name] for r in kept if name in r.stats]
        if rows:
            out[name] = {"min": max(v[0] for v in rows), "median": max(v[1] for v in rows),
                         "max": max(v[3] for v in rows)}
    if kept:
        durations = [r.duration for r in kept]
        out["iteration_s"] = {"min": min(durations), "median": statistics.median(durations), "max": max(durations)}
    return out
