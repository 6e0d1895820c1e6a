"""What a failed schedule call must not leave behind, so the next call starts clean.

An exception anywhere in ``forward_backward_rrfp`` (a forward step that raises, a stalled
or dead peer, a refused message) leaves state that would poison the next iteration in the
same process: an entered ``no_sync`` (gradient reductions stay off), started Megatron
timers (the next ``start()`` asserts), and the per-process runtime with messages and
receive expectations of the failed iteration. ``after_failure`` undoes each of them; each
step is guarded, so cleaning up never hides the exception that caused it.

    @recovery.cleans_up_on_failure          # on the schedule function
    def forward_backward_rrfp(...):
        ...checks: a bad option raises here, nothing to undo...
        recovery.track(config, grad_sync)   # the iteration starts using the runtime
        ...

Only a call that got as far as ``track`` is cleaned up: one refused up front (a bad option,
the same on every rank) leaves the runtime as it was.
"""
from __future__ import annotations

import functools
import logging
import threading

from . import session as session_module

log = logging.getLogger(__name__)

SCHEDULE_TIMERS = ("forward-backward", "forward-compute", "backward-compute")
"""The Megatron timers a schedule call (or megatron-core's forward/backward step) starts."""


_in_flight = threading.local()


def track(config, grad_sync) -> None:
    """The running schedule call's Megatron config and gradient-sync controller."""
    _in_flight.call = (config, grad_sync)


def cleans_up_on_failure(schedule):
    """Decorate a schedule function: on any exception after ``track``, ``after_failure``."""

    @functools.wraps(schedule)
    def run(**kwargs):
        _in_flight.call = None
        try:
            return schedule(**kwargs)
        except BaseException:
            tracked, _in_flight.call = getattr(_in_flight, "call", None), None
            if tracked is not None:
                after_failure(*tracked)
            raise
        finally:
            _in_flight.call = None

    return run


def after_failure(config, grad_sync) -> None:
    """Exit ``no_sync``, stop the schedule's running timers, discard the runtime."""
    for step, action in (("exit no_sync", lambda: grad_sync is not None and grad_sync.enable()),
                         ("stop timers", lambda: stop_running_timers(getattr(config, "timers", None))),
                         ("discard the runtime", session_module.discard)):
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


__all__ = ["SCHEDULE_TIMERS", "after_failure", "cleans_up_on_failure", "stop_running_timers", "track"]
