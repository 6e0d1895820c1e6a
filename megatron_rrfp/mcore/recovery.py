"""What a failed schedule call must not leave behind, so the next call starts clean.

An exception while a schedule call runs (a forward step that raises, a stalled or dead
peer, a refused message) leaves state that would poison the next iteration in the same
process: an entered ``no_sync`` (gradient reductions stay off), started Megatron timers
(the next ``start()`` asserts), and the session with messages and receive expectations of
the failed iteration. ``ScheduleCall.abandon`` (mcore/call.py) calls ``after_failure``,
which undoes each of them; each step is guarded, so cleaning up never hides the exception
that caused it. A call refused while it is built (a bad option, the same on every rank)
has started nothing and leaves the state as it was.
"""
from __future__ import annotations

import logging

from .state import ScheduleState

log = logging.getLogger(__name__)

SCHEDULE_TIMERS = ("forward-backward", "forward-compute", "backward-compute")
"""The Megatron timers a schedule call (or megatron-core's forward/backward step) starts."""


def after_failure(config, grad_sync, state: ScheduleState) -> None:
    """Exit ``no_sync``, stop the schedule's running timers, discard ``state``'s session."""
    for step, action in (("exit no_sync", lambda: grad_sync is not None and grad_sync.enable()),
                         ("stop timers", lambda: stop_running_timers(getattr(config, "timers", None))),
                         ("discard the session", state.discard)):
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - the original exception is what the caller must see
            log.warning("megatron_rrfp: after a failed iteration, could not %s: %s: %s", step, type(exc).__name__, exc)


def stop_running_timers(timers, names=SCHEDULE_TIMERS) -> list[str]:
    """Stop those of ``names`` that are running (Megatron ``Timers``); returns them."""
    stopped = []
    if timers is None:
        return stopped
    existing = getattr(timers, "_timers", {})  # only look: timers(name) would create missing ones
    for name in names:
        timer = existing.get(name)
        if timer is not None and getattr(timer, "_started", False):
            timer.stop()
            stopped.append(name)
    return stopped


__all__ = ["SCHEDULE_TIMERS", "after_failure", "stop_running_timers"]
