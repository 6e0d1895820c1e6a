"""The signals a training rank gets from its launcher or scheduler, and what the driver does.

SIGTERM. torchrun stops the other ranks with SIGTERM as soon as one fails; SLURM sends it
when a job is cancelled, requeued or out of time (then SIGKILL after KillWait). Its default
action kills a rank on the spot, before it can say why the job failed (a surviving rank is
usually about to raise the diagnosis of its dead peer) and before the goodput ledger records
the disruption. So the handler lets the rank run on for at most ``grace_s`` seconds: a rank
that fails meanwhile reports and records its own failure (``failing()`` cancels the grace
timer, the recording has its own bounds); otherwise ``JobTerminated`` is raised in the
training thread when the grace ends and is recorded as the disruption. A second SIGTERM
raises at once.

Exit signal (``--exit-signal-handler``, Megatron-LM's flag; ``--exit-signal``, default
SIGTERM as in Megatron-LM; the SLURM scripts use SIGUSR1 with ``#SBATCH --signal=USR1@120``):
the signal only sets a flag. After every iteration the ranks agree on it (``exit_requested``,
one all-reduce, only with the handler on) and, if any rank got it, save a checkpoint and
exit 0: the job can be requeued and resumes from there. With SIGTERM as the exit signal
there is no grace timer (the save decides how long it takes; the scheduler's SIGKILL bounds it).

Handlers are installed on the main thread only (Python delivers signals there) and
restored by ``uninstall``.
"""
from __future__ import annotations

import signal
import sys
import threading
from typing import Optional

from ..ranks import print_line

GRACE_S = 2.0
EXIT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT")


class JobTerminated(RuntimeError):
    """The launcher or the scheduler stopped this rank (SIGTERM) and it had no failure of its own to report."""


class Signals:
    def __init__(self, *, rank: int, exit_signal: Optional[str] = None, grace_s: float = GRACE_S) -> None:
        self.rank, self.grace_s = rank, grace_s
        self.exit_signal = getattr(signal, exit_signal) if exit_signal else None
        self.terminating = False
        self.exit_signal_received = False
        self._failing = False
        self._expired = False
        self._previous: dict[int, object] = {}

    def install(self) -> Signals:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal.signal works on the main thread only; leave defaults elsewhere
        handlers = {signal.SIGTERM: self._on_term, signal.SIGALRM: self._on_alarm}
        if self.exit_signal is not None:
            handlers[self.exit_signal] = self._on_exit_signal
        for signum, handler in handlers.items():
            self._previous[signum] = signal.signal(signum, handler)
        return self

    def uninstall(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def failing(self) -> None:
        """This rank is handling a failure of its own: let it finish recording it."""
        self._failing = True
        if self._previous:
            signal.setitimer(signal.ITIMER_REAL, 0)

    def exit_requested(self) -> bool:
        """COLLECTIVE with an exit signal configured: whether any rank got it (one all-reduce)."""
        if self.exit_signal is None:
            return False
        from ..ranks import max_over_ranks

        return max_over_ranks([float(self.exit_signal_received)])[0] > 0

    # -- handlers (main thread, between bytecodes) ---------------------------------------

    def _on_exit_signal(self, signum, frame) -> None:
        if not self.exit_signal_received:
            _say(f"rank {self.rank}: {signal.Signals(signum).name}: saving a checkpoint after this iteration, "
                 "then exiting")
        self.exit_signal_received = True

    def _on_term(self, signum, frame) -> None:
        if self.terminating:
            raise JobTerminated(f"rank {self.rank}: stopped by a second SIGTERM")
        self.terminating = True
        if self._failing:
            return  # already reporting its own failure
        _say(f"rank {self.rank}: SIGTERM (the launcher or scheduler is stopping the job); finishing what is in "
             f"flight for at most {self.grace_s:g} s")
        signal.setitimer(signal.ITIMER_REAL, self.grace_s)

    def _on_alarm(self, signum, frame) -> None:
        if self.terminating and not self._failing:
            self._expired = True  # raised again after the iteration if code below swallows it
            raise self._terminated()

    def raise_if_expired(self) -> None:
        """After each iteration: the grace ended while a catch-all (e.g. the never-raising
        goodput recorder) was running, which swallowed the handler's exception."""
        if self._expired and not self._failing:
            raise self._terminated()

    def _terminated(self) -> JobTerminated:
        return JobTerminated(f"rank {self.rank}: stopped by SIGTERM from the launcher or scheduler "
                             f"({self.grace_s:g} s after it arrived)")


def _say(message: str) -> None:
    print_line(f"megatron-rrfp: {message}", file=sys.stderr)


__all__ = ["EXIT_SIGNALS", "GRACE_S", "JobTerminated", "Signals"]
