"""The self-check's steps on every rank, never waiting on a failed rank beyond the timeout.

A step that spans ranks stops being possible for everyone once one rank of it fails: the
others would wait in its next collective (and then in the final gather) until NCCL's own
timeout, and say nothing about who failed. So every rank reports through the job's store
(the rendezvous ``TCPStore``, no collective): a rank whose multi-rank step raised posts
its error at once, and skips the later multi-rank steps; a watchdog thread on each rank
sees a peer's post during a step, prints which rank failed and why, posts its own results
and leaves (exit 1); a step still unfinished after ``--step-timeout`` names the ranks
that did not finish it, dumps this rank's threads and leaves the same way. Rank 0 collects
every rank's results from the store, waiting at most the timeout for each missing one.
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Optional

from ..ranks import print_line
from .result import Result

PREFIX = "rrfp-selfcheck"
POLL_S = 0.2


@dataclass
class Outcome:
    results: list[Result]  # this rank's
    gathered: list[list[dict]]  # rank 0: every rank's (a rank that never reported: one FAIL row)
    failed: list[tuple[int, str]]  # (rank, step) of every FAIL


def _key(*parts) -> str:
    return "/".join([PREFIX, *map(str, parts)])


def _get(store, key: str) -> Optional[str]:
    try:
        return store.get(key).decode() if store.check([key]) else None
    except Exception:  # noqa: BLE001 - the store's host (rank 0) is gone: nobody to wait for
        return None


class _Watchdog:
    """During a multi-rank step: a peer's failure post or the step's timeout ends this rank."""

    def __init__(self, store, *, rank: int, world: int, timeout_s: float, leave: Callable[[Result], None]) -> None:
        self.store, self.rank, self.world, self.timeout_s, self.leave = store, rank, world, timeout_s, leave
        self._step: Optional[str] = None
        self._since = 0.0
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="rrfp-selfcheck-watchdog", daemon=True).start()

    def arm(self, step: Optional[str]) -> None:
        with self._lock:
            self._step, self._since = step, time.monotonic()

    def _watch(self) -> None:
        while True:
            time.sleep(POLL_S)
            with self._lock:
                step, since = self._step, self._since
            if step is None:
                continue
            for peer in range(self.world):
                error = None if peer == self.rank else _get(self.store, _key("failed", peer))
                if error is not None:
                    self.leave(Result(step, "FAIL", f"rank {peer} failed ({error}); not waiting for it"))
            if time.monotonic() - since > self.timeout_s:
                late = [r for r in range(self.world) if _get(self.store, _key("done", step, r)) is None]
                faulthandler.dump_traceback(all_threads=True)
                self.leave(Result(step, "FAIL", f"rank(s) {late} did not finish it within --step-timeout "
                                                f"{self.timeout_s:g} s (their stacks: their own output)"))


def run_steps(order: Sequence[str], functions: dict[str, Callable], ctx: dict, *, store, multi_rank: set[str],
              skip: Callable[[str], Optional[Result]], step_timeout_s: float,
              finish: Callable[[Outcome], None]) -> Outcome:
    """Run ``order`` on this rank (``skip(step)``: a SKIP result, or None to run it);
    ``finish(outcome)`` is called once on every rank, also by the watchdog before it
    leaves (rank 0 prints the verdict and writes the JSON there)."""
    rank, world = ctx["rank"], ctx["world"]
    results: list[Result] = []
    broken: list[str] = []  # a multi-rank step that failed here: the later ones cannot run
    leaving = threading.Lock()

    def leave(result: Result) -> None:  # the watchdog's exit
        if not leaving.acquire(blocking=False):
            return
        print_line(f"[rank {rank}] {result.status:4} {result.step}: {result.detail}")
        finish(collect(store, [*results, result], rank=rank, world=world, timeout_s=step_timeout_s))
        sys.stdout.flush()
        os._exit(1)

    watchdog = _Watchdog(store, rank=rank, world=world, timeout_s=step_timeout_s, leave=leave) if world > 1 else None
    for step in order:
        shared = step in multi_rank and world > 1
        result = skip(step)
        if result is None and shared and broken:
            result = Result(step, "SKIP", f"not run: {broken[0]} failed on this rank")
        if result is None:
            if shared and watchdog:
                watchdog.arm(step)
            faulthandler.dump_traceback_later(step_timeout_s + 30, exit=True)  # a wedged watchdog's backstop
            try:
                result = functions[step](ctx)
            except BaseException as exc:  # noqa: BLE001 - a failed step, reported
                where = traceback.extract_tb(exc.__traceback__)[-1]
                result = Result(step, "FAIL", f"{type(exc).__name__}: {exc} (at {where.filename}:{where.lineno})")
            finally:
                faulthandler.cancel_dump_traceback_later()
            if shared and watchdog:
                if result.status == "FAIL":
                    broken.append(step)
                    store.set(_key("failed", rank), f"{step}: {result.detail}")
                store.set(_key("done", step, rank), result.status)
                watchdog.arm(None)
        results.append(result)
        if rank == 0 or not shared:
            print_line(f"[rank {rank}] {result.status:4} {result.step}: {result.detail}")
    with leaving:  # the watchdog no longer leaves for us
        outcome = collect(store, results, rank=rank, world=world, timeout_s=step_timeout_s)
        finish(outcome)
    return outcome


def collect(store, results: list[Result], *, rank: int, world: int, timeout_s: float) -> Outcome:
    """Post this rank's results; rank 0 gathers every rank's, waiting at most ``timeout_s``."""
    mine = [asdict(r) for r in results]
    gathered: list[list[dict]] = [mine]
    if world > 1:
        if rank != 0:
            try:
                store.set(_key("results", rank), json.dumps(mine))
            except Exception:  # noqa: BLE001 - rank 0 is gone; it reports nothing more
                pass
            deadline = time.monotonic() + timeout_s  # stay until rank 0 read it: torchrun stops every rank
            while time.monotonic() < deadline and _get(store, _key("verdict")) is None:  # once one exits non-zero
                time.sleep(POLL_S)
        else:
            deadline = time.monotonic() + timeout_s
            gathered = [mine] + [None] * (world - 1)
            while time.monotonic() < deadline and None in gathered:
                for peer in range(1, world):
                    if gathered[peer] is None and (posted := _get(store, _key("results", peer))) is not None:
                        gathered[peer] = json.loads(posted)
                time.sleep(POLL_S if None in gathered else 0)
            gathered = [xs if xs is not None else [{"step": "(results)", "status": "FAIL", "detail":
                                                    f"rank {r} did not report within {timeout_s:g} s"}]
                        for r, xs in enumerate(gathered)]
    failed = [(r, x["step"]) for r, xs in enumerate(gathered) for x in xs if x["status"] == "FAIL"]
    if world > 1 and rank == 0:
        try:
            store.set(_key("verdict"), "FAIL" if failed else "PASS")
        except Exception:  # noqa: BLE001 - a store error must not hide the verdict
            pass
    return Outcome(results=results, gathered=gathered, failed=failed)


def report(outcome: Outcome, *, rank: int, world: int, json_path) -> None:
    """Rank 0: the verdict line (naming each failed step and rank) and the JSON."""
    if rank != 0:
        return
    failed = outcome.failed
    print(f"gpu_selfcheck: {'FAIL' if failed else 'PASS'}"
          + (f" ({', '.join(f'{s} on rank {r}' for r, s in failed)})" if failed else ""), flush=True)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as handle:
            json.dump({"world": world, "ranks": outcome.gathered, "failed": bool(failed)}, handle, indent=1)


__all__ = ["Outcome", "Result", "collect", "report", "run_steps"]
