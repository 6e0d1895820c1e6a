"""N local ranks of a module through torch's own launcher: in this process, or as a child process.

``run_module`` does exactly what ``torchrun --standalone --nnodes 1 --nproc-per-node N -m MODULE ARGS``
does (torch.distributed.run: an elastic agent in this process, a c10d rendezvous on a free local
port, no restarts), called in-process so that a failure ends in a short summary instead of
a traceback: the agent stops the other ranks (SIGTERM, SIGKILL 30 s later) as soon as one
fails; each failed rank is named (exit code, or the signal that killed it) and the status
of the first rank killed by a signal (else of the first failure) is returned shell-style
(128 + N for a rank killed by signal N). The agent installs signal handlers, which only the
main thread may: ``run_module_subprocess`` runs the same command as a child process instead.

The ranks inherit this process's stdout and stderr and see torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID, ...).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Optional

from ..ranks import print_line
from .env import gloo_on_loopback

MONITOR_INTERVAL_S = 0.1  # how often the agent checks its workers (torchrun's default)


def run_module(nproc: int, module: str, args: Sequence[str], *, env: Optional[dict] = None) -> int:
    """Run ``python -m module args`` as ranks 0..nproc-1; 0, or the first failure's status."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    prepare_launching_process(env)  # the agent's workers inherit it
    parsed = torchrun.parse_args(["--max-restarts", "0", "--monitor-interval", str(MONITOR_INTERVAL_S),
                                  *torchrun_args(nproc, module, args)])
    try:
        torchrun.run(parsed)
    except ChildFailedError as failed:
        return report_failures(failed.failures, nproc, stopped_by="torch's launcher")
    return 0


def run_module_subprocess(nproc: int, module: str, args: Sequence[str], *, env: dict, timeout_s: float) -> int:
    """``python -m torch.distributed.run`` (torchrun's defaults) running ``python -m module args`` as
    ranks 0..nproc-1 in a child process with environment ``env``; its exit status. After ``timeout_s``
    seconds, or if this thread is torn down, the launcher gets SIGTERM (SIGKILL 30 s later) and
    ``subprocess.TimeoutExpired`` is raised."""
    command = [sys.executable, "-m", "torch.distributed.run", *torchrun_args(nproc, module, args)]
    with subprocess.Popen(command, env=env) as launcher:
        try:
            return launcher.wait(timeout=timeout_s)
        finally:
            if launcher.poll() is None:
                launcher.terminate()
                try:
                    launcher.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    launcher.kill()


def torchrun_args(nproc: int, module: str, args: Sequence[str]) -> list[str]:
    """torchrun's command line for ``nproc`` ranks of ``python -m module args`` on this host."""
    return ["--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc), "--module", module, *args]


def prepare_launching_process(env: Optional[dict]) -> None:
    """What this process does before it starts local ranks that inherit its environment: the one
    line for megatron-core's notes (the ranks inherit the filter, quiet.ENV), ``env`` added to its
    environment, gloo over loopback."""
    from ..quiet import announce

    announce()
    os.environ.update({str(k): str(v) for k, v in (env or {}).items()})
    gloo_on_loopback()


def report_failures(failed: dict, nproc: int, *, stopped_by: str) -> int:
    """Name each failed rank (``failed``: rank -> record with ``pid``, ``exitcode`` and
    ``timestamp``, as torch's ChildFailedError holds them); the exit status of the first
    rank killed by a signal, else of the first failure."""
    failures = sorted(failed.items(), key=lambda item: item[1].timestamp)
    for rank, failure in failures:
        _say(f"rank {rank} (pid {failure.pid}) {describe_exit(failure.exitcode)}")
    stopped = sorted(set(range(nproc)) - {rank for rank, _ in failures})
    if stopped:
        _say(f"{stopped_by} stopped rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))} "
             "(SIGTERM) after that")
    # A rank killed by a signal (not the launcher's SIGTERM) is the cause: the others' errors
    # follow from it, and they may be recorded first (the agent stamps whole seconds).
    killed = [f for _, f in failures if f.exitcode < 0 and -f.exitcode != signal.SIGTERM]
    return exit_status((killed or [f for _, f in failures])[0].exitcode) if failures else 1


def exit_status(returncode: int) -> int:
    """A child's status as a shell reports it: 128 + N for a child killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def _say(message: str) -> None:
    print_line(f"megatron-rrfp: {message}", file=sys.stderr)


__all__ = ["describe_exit", "exit_status", "prepare_launching_process", "report_failures", "run_module",
           "run_module_subprocess", "torchrun_args"]
