"""Recording goodput from a training loop, and RRFP's breakdown in Megatron's timers.

Every rank makes the same calls; only ``rank == 0`` owns a ``LedgerWriter``. No call
raises or blocks for long (a broken ledger gives one ``LedgerWarning``) -- except the
constructor, which raises ``LedgerBusyError`` before training starts when another live
process already writes this job's ledger. ``iteration()`` is COLLECTIVE when world > 1:
it all-gathers 8 floats per rank (``breakdown_vector``) over the default process group
so rank 0 records [min, median, mean, max] across ranks; every rank must call it, in the
same order (pass ``gather=False`` to record rank 0's own breakdown only, no collective).
With ``ledger_path=None`` (flag not given) every method is a no-op on every rank.

The call sites -- ``megatron-rrfp train``'s driver (``megatron_rrfp/train/driver.py``) and the
Megatron-LM hooks (``megatron_rrfp/megatron_lm/training_loop.py``) -- are sketched in docs/goodput.md.

A data wait outside any iteration (e.g. the first prefetch): ``recorder.data_wait(seconds)``
right after it ended. Inside an iteration, pass it as ``data_wait_s`` instead (not both).
``disruption()`` is written only from rank 0 (the one writer); a rank that dies alone
shows up as rank 0's own error, or -- when the whole job is killed -- as the
"unclean-exit" the report infers from a process that never wrote ``job_end``.

``peak_memory_line`` is the log line (global rank 0, every --log-interval) with the peak
activation memory and forwards in flight, max over ranks: bytes are not times, so they
stay out of Megatron's timers.
``publish_to_timers`` adds the breakdown to timers 'rrfp-compute', 'rrfp-bubble',
'rrfp-backpressure', 'rrfp-tp-agreement', 'rrfp-flush' (the integrations use log level 0,
so they exist at every ``--timing-log-level``). Megatron-LM's ``training_log`` logs and
writes to TensorBoard (``--log-timers-to-tensorboard``, as ``rrfp-*-time``) a fixed list of
names; ``extend_timer_logging(timers)`` appends the rrfp-* names whenever that list is
logged (it contains 'forward-backward', or is empty at level 0), identically on all ranks
as those collective calls require.
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable
from typing import Optional, Union

from .accounting import BREAKDOWN_FIELDS, MEMORY_FIELDS, summarize_ranks
from .schema import Clock, LedgerBusyError, LedgerWarning, system_clock
from .writer import LedgerWriter

TIMER_NAMES = {"compute_s": "rrfp-compute", "wait_s": "rrfp-bubble", "backpressure_s": "rrfp-backpressure",
               "agree_s": "rrfp-tp-agreement", "flush_s": "rrfp-flush"}
"""IterationReport field -> Megatron timer name."""

Gather = Callable[[list], list]


def breakdown_vector(report, data_wait_s: float = 0.0, memory: Optional[tuple] = None) -> list[float]:
    """This rank's iteration as floats in ``BREAKDOWN_FIELDS`` order, then 1.0 if measured,
    then ``MEMORY_FIELDS`` (-1: not measured). ``report``: an ``executor.IterationReport``
    (seconds) or None (a non-RRFP schedule); ``memory``: (peak activation bytes, peak in
    flight) measured around a schedule without a report (default: the report's)."""
    if memory is None and report is not None:  # -1: a report that does not carry them
        memory = (getattr(report, "peak_activation_bytes", -1), getattr(report, "peak_in_flight", -1))
    tail = [float(v) for v in memory] if memory is not None else [-1.0] * len(MEMORY_FIELDS)
    if report is None:
        return [0.0] * (len(BREAKDOWN_FIELDS) - 2) + [float(data_wait_s), 0.0, 0.0] + tail
    return [float(report.compute_s), float(report.wait_s), float(report.backpressure_s), float(report.agree_s),
            float(report.flush_s), float(data_wait_s), float(report.wall_s), 1.0] + tail


def all_gather_vectors(vector: list[float], group=None) -> list[list[float]]:
    """Every rank's vector, by rank (torch.distributed all_gather; CUDA tensors on NCCL)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [vector]
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor(vector, dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return [t.tolist() for t in everyone]


class GoodputRecorder:
    """The training loop's goodput hooks; see the module docstring for the calls."""

    def __init__(self, ledger_path: Optional[str], *, rank: int, world: int, job: Optional[str] = None,
                 gather: Union[bool, Gather] = True, writer_rank: int = 0, since_wall: Optional[float] = None,
                 close_timeout_s: float = 5.0, clock: Optional[Clock] = None, info: Optional[dict] = None) -> None:
        self.rank, self.world = rank, world
        self.enabled = bool(ledger_path)
        self.close_timeout_s = close_timeout_s
        self._clock = clock or system_clock
        self._warned: set[str] = set()
        self.writer: Optional[LedgerWriter] = None
        if self.enabled and rank == writer_rank:
            self.writer = LedgerWriter(ledger_path, job=job, clock=self._clock, since_wall=since_wall,
                                       info={"world": world, **(info or {})})
        if gather is True:
            self._gather: Optional[Gather] = all_gather_vectors if self.enabled and world > 1 else None
        else:
            self._gather = gather or None

    # -- job ------------------------------------------------------------------------

    def job_start(self, **info) -> None:
        self._write("job_start", data={"world": self.world, **info})

    def job_end(self) -> None:
        """Record a clean end and close (waits at most ``close_timeout_s``)."""
        self._write("job_end")
        self.close()

    def close(self, timeout_s: Optional[float] = None) -> None:
        if self.writer is not None:
            self.writer.close(self.close_timeout_s if timeout_s is None else timeout_s)

    # -- iterations -----------------------------------------------------------------

    def iteration_start(self, iteration: int) -> None:
        self._write("iteration_start", iteration=iteration)

    def iteration(self, iteration: int, tokens: int, report=None, data_wait_s: float = 0.0,
                  memory: Optional[tuple] = None) -> None:
        """Iteration ``iteration`` completed, processing ``tokens`` tokens (whole job).
        ``memory``: (peak activation bytes, peak in flight) of a schedule without a report.
        Collective when gathering (see the module docstring)."""
        if not self.enabled:
            return
        at = self._clock()  # the end is now, not after the all-gather
        vector = breakdown_vector(report, data_wait_s, memory)
        vectors = [vector]
        if self._gather is not None:
            try:
                vectors = self._gather(vector)
            except Exception as exc:  # every rank keeps calling, so the collectives stay matched
                self._warn("gather", f"goodput: per-rank breakdown not gathered ({exc}); recording rank "
                                     f"{self.rank}'s own")
        if self.writer is not None:
            self._write("iteration_end", iteration=iteration, at=at, data=summarize_ranks(vectors, tokens))

    def data_wait(self, seconds: float) -> None:
        """A data-loading wait outside any iteration, of ``seconds``, that ended just now."""
        self._write("data_wait", data={"seconds": float(seconds)})

    # -- checkpoints ----------------------------------------------------------------

    def checkpoint_save_start(self, iteration: int) -> None:
        self._write("checkpoint_save_start", iteration=iteration)

    def checkpoint_save_end(self, iteration: int, *, ok: bool = True) -> None:
        """``ok=False``: the save failed, so ``iteration`` is no resume point."""
        self._write("checkpoint_save_end", iteration=iteration, data={"ok": ok})

    @contextlib.contextmanager
    def checkpoint_save(self, iteration: int):
        self.checkpoint_save_start(iteration)
        ok = False
        try:
            yield
            ok = True
        finally:
            self.checkpoint_save_end(iteration, ok=ok)

    def checkpoint_load_start(self) -> None:
        self._write("checkpoint_load_start")

    def checkpoint_load_end(self, iteration: Optional[int] = None, *, ok: bool = True) -> None:
        self._write("checkpoint_load_end", iteration=iteration, data={"ok": ok})

    @contextlib.contextmanager
    def checkpoint_load(self):
        self.checkpoint_load_start()
        ok = False
        try:
            yield
            ok = True
        finally:
            self.checkpoint_load_end(ok=ok)

    # -- failures -------------------------------------------------------------------

    def disruption(self, kind: str, message: str = "", rank: Optional[int] = None) -> None:
        """Something stopped training (exception, stall, lost peer). Flushed at once: the
        process is probably about to die."""
        self._write("disruption", rank=rank, data={"kind": kind, "message": message[:4000], "rank": rank})
        if self.writer is not None:
            self.writer.flush(timeout_s=2.0)

    def restart(self, resumed_from: int, *, checkpoint: Optional[str] = None, mechanism: Optional[str] = None) -> None:
        """This process resumed from the checkpoint of iteration ``resumed_from``: ``checkpoint``, its
        kind ("persistent", "local", ...); ``mechanism``, what restarted training ("in-process",
        "in-job", "requeue", "relaunch"); either None when not known."""
        data = {"resumed_from": int(resumed_from)}
        data.update({k: v for k, v in (("checkpoint", checkpoint), ("mechanism", mechanism)) if v is not None})
        self._write("restart", iteration=resumed_from, data=data)

    # -- internals ------------------------------------------------------------------

    def _write(self, kind: str, **fields) -> None:
        if self.writer is not None:
            self.writer.write(kind, **fields)  # never raises

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, LedgerWarning, stacklevel=3)


def open_recorder(ledger_path: Optional[str], *, rank: int, world: int, writer_rank: int = 0,
                  exchange: Optional[Callable[[Optional[str]], list]] = None, **options) -> GoodputRecorder:
    """A ``GoodputRecorder`` on every rank, agreed on by all of them (COLLECTIVE with a
    ledger and world > 1: every rank must call it).

    Another live job writing the ledger raises ``LedgerBusyError`` on *every* rank, before
    training: the writer rank alone raising would leave the others waiting for it in their
    first collective. Any other ledger problem only warns (``LedgerWarning``): the recorder
    then writes nothing but still joins the per-iteration gathers. ``exchange``: each rank's
    busy message (or None) -> every rank's, in rank order; default an all-gather over the
    default process group."""
    busy = None
    try:
        recorder = GoodputRecorder(ledger_path, rank=rank, world=world, writer_rank=writer_rank, **options)
    except LedgerBusyError as exc:
        recorder, busy = None, str(exc)
    except Exception as exc:  # noqa: BLE001 - a ledger problem must not stop training
        warnings.warn(f"goodput ledger {ledger_path}: not recorded ({type(exc).__name__}: {exc}); training continues",
                      LedgerWarning, stacklevel=2)
        recorder = GoodputRecorder(ledger_path, rank=rank, world=world, writer_rank=-1,
                                   **{k: v for k, v in options.items() if k in ("gather", "clock", "close_timeout_s")})
    if ledger_path and world > 1:
        everyone = (exchange or _all_gather_objects)(busy)
        busy = busy or next((b for b in everyone if b), None)
        if busy and recorder is not None:
            recorder.close(timeout_s=0.0)
    if busy:
        if rank == writer_rank:
            raise LedgerBusyError(busy)
        raise LedgerBusyError(f"rank {writer_rank} cannot write --rrfp-goodput-ledger {ledger_path} (see rank "
                              f"{writer_rank}): {busy}")
    return recorder


def _all_gather_objects(value) -> list:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


# -- Megatron timers -------------------------------------------------------------------

def publish_to_timers(timers, report, *, log_level: int = 1) -> dict[str, float]:
    """Add one iteration's RRFP breakdown (seconds) to Megatron ``Timers``; returns what was
    added. Accumulates like a timer started and stopped, so Megatron-LM's per-interval
    normalisation gives seconds per iteration. Never raises; a no-op for ``timers=None``,
    ``report=None`` or timers below the timing log level (Megatron's DummyTimer)."""
    added: dict[str, float] = {}
    if timers is None or report is None:
        return added
    try:
        for attr, name in TIMER_NAMES.items():
            seconds = float(getattr(report, attr))
            if _add_elapsed(timers(name, log_level=log_level), seconds):
                added[name] = seconds
    except Exception as exc:
        warnings.warn(f"goodput: RRFP timers not published ({exc})", LedgerWarning, stacklevel=2)
    return added


def peak_memory_line(report, iteration: int, *, world: int) -> Optional[str]:
    """"megatron-rrfp: iteration N | peak activation memory X MB (max over ranks) | ...", for
    global rank 0 to print (None elsewhere, or when no rank measured). COLLECTIVE when
    world > 1 (a 2-float all-gather): every rank calls it at the same iterations. Never raises."""
    mine = [float(getattr(report, name, -1)) for name in ("peak_activation_bytes", "peak_in_flight")]
    try:
        everyone = all_gather_vectors(mine) if world > 1 else [mine]
    except Exception as exc:
        warnings.warn(f"goodput: peak activation memory not gathered ({exc})", LedgerWarning, stacklevel=2)
        return None
    import torch.distributed as dist

    if (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0) or max(v[0] for v in everyone) < 0:
        return None
    limit = getattr(report, "buffer_limit", 0)
    limit = f" | buffer limit {limit} on rank 0" if limit else ""
    return (f"megatron-rrfp: iteration {iteration} | peak activation memory {max(v[0] for v in everyone) / 1e6:.1f} "
            f"MB (max over ranks) | peak forwards in flight {max(v[1] for v in everyone):.0f}{limit}")


def _add_elapsed(timer, seconds: float) -> bool:
    if getattr(timer, "_started", False):
        return False  # someone times it live: leave it alone
    if hasattr(timer, "set_elapsed"):  # megatron-core >= 0.16
        timer.set_elapsed(timer.elapsed(reset=False) + seconds)
        return True
    if hasattr(timer, "_elapsed"):
        timer._elapsed += seconds
        return True
    return False  # DummyTimer: this log level is switched off


class _WithRRFPNames:
    """``timers.log`` / ``timers.write`` that append the rrfp-* names to training_log's list."""

    def __init__(self, original: Callable, names: Iterable[str], trigger: str) -> None:
        self.original, self.names, self.trigger = original, list(names), trigger

    def __call__(self, names, *args, **kwargs):
        # training_log's list: it holds 'forward-backward' at --timing-log-level >= 1 and is
        # empty at level 0 (other callers always name their timers)
        if self.trigger in names or len(names) == 0:
            names = list(names) + [n for n in self.names if n not in names]
        return self.original(names, *args, **kwargs)


def extend_timer_logging(timers, *, names: Iterable[str] = TIMER_NAMES.values(),
                         trigger: str = "forward-backward") -> None:
    """Make Megatron-LM's training_log print / TensorBoard-write the rrfp-* timers. Call once
    on every rank (those calls are collective and need the same names everywhere)."""
    if timers is None or isinstance(getattr(timers, "write", None), _WithRRFPNames):
        return
    for method in ("log", "write"):
        setattr(timers, method, _WithRRFPNames(getattr(timers, method), names, trigger))


__all__ = ["GoodputRecorder", "TIMER_NAMES", "all_gather_vectors", "breakdown_vector", "extend_timer_logging",
           "open_recorder", "peak_memory_line", "publish_to_timers"]
