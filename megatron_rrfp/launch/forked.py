"""N local CPU ranks of a module forked from this process, which imported torch and megatron-core
once (``train --cpu --nproc N``).

Why not torch's launcher here: each rank it starts is a fresh interpreter that imports torch
and megatron-core (~6 s of CPU, 1.7 s of it megatron-core's ``torch.compile``-decorated
fusions), so on the small CPU hosts ``--cpu`` runs on, a short job was mostly imports
(a 4-rank run: ~25 s of CPU before the first step). A fork of a process that has imported
them but never run a tensor op, started no Python thread (the one native thread importing
torch starts is idle) and never touched CUDA (``--cpu`` empties CUDA_VISIBLE_DEVICES before
the imports) starts at once and is safe, as torch.multiprocessing's 'fork' start method and
the fork server of ``function.py`` rely on. GPU runs keep torch's launcher
(``torchrun.py``): a fork must not inherit a CUDA driver, and GPU hosts have the cores.

What the ranks see and what happens on failure are torch's launcher's (``torchrun.py``):
- torchrun's variables: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
  MASTER_ADDR, MASTER_PORT, with TORCHELASTIC_USE_AGENT_STORE=True: this process hosts the
  rendezvous TCPStore (port chosen by the OS, after the forks so that no store thread is
  forked) and every rank joins it as a client, as under torch's agent;
- as soon as one rank fails the others get SIGTERM, and SIGKILL 30 s later; each failed
  rank is named and the status of the first rank killed by a signal (else of the first
  failure) is returned shell-style;
- SIGTERM, SIGINT or SIGHUP sent to this process is passed on to every rank (same grace,
  then SIGKILL), and this process then exits 128 + that signal;
- a rank dies with this process (PR_SET_PDEATHSIG), and ends as the interpreter would:
  ``python -m MODULE`` run to its exit status, then the non-daemon threads joined and the
  atexit handlers run.
"""
from __future__ import annotations

import atexit
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import NoReturn, Optional

from .env import LOOPBACK, die_with_parent
from .torchrun import exit_status, prepare_launching_process, report_failures

STOP_GRACE_S = 30.0  # SIGTERM, then SIGKILL this much later (torch's launcher's default)
MONITOR_INTERVAL_S = 0.1
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def run_module_forked(nproc: int, module: str, args: Sequence[str], *, env: Optional[dict] = None,
                      preload: Iterable[str] = ()) -> int:
    """Run ``python -m module args`` as ranks 0..nproc-1 forked from this process (import
    ``preload`` first: what every rank imports anyway); 0, or the first failure's status."""
    import importlib

    prepare_launching_process(env)  # before the imports read it
    for name in preload:
        importlib.import_module(name)
    sys.stdout.flush()
    sys.stderr.flush()  # nothing buffered here is written again by a rank

    parent, ranks, port_pipes = os.getpid(), {}, []
    for rank in range(nproc):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the rank; never returns
            os.close(write_end)
            for _, other_write in port_pipes:
                os.close(other_write)
            _rank_main(rank, nproc, parent, read_end, module, args)
        os.close(read_end)
        ranks[pid] = rank
        port_pipes.append((rank, write_end))

    from torch.distributed import TCPStore

    store = TCPStore(LOOPBACK, 0, nproc, is_master=True, wait_for_workers=False)
    for _, write_end in port_pipes:
        os.write(write_end, f"{store.port}\n".encode())
        os.close(write_end)
    return _monitor(ranks, nproc)


# --------------------------------------------------------------------------- rank side


def _rank_main(rank: int, nproc: int, parent: int, port_pipe: int, module: str, args: Sequence[str]) -> None:
    def run() -> int:
        die_with_parent(parent)
        for signum in _FORWARDED:
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
        with os.fdopen(port_pipe) as pipe:
            port = pipe.readline().strip()
        if not port:
            os._exit(1)  # the launcher died before the rendezvous store was up
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(nproc),
                          LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR=LOOPBACK, MASTER_PORT=port,
                          TORCHELASTIC_USE_AGENT_STORE="True")
        if "torch" in sys.modules and os.environ.get("OMP_NUM_THREADS", "").isdigit():
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # read at torch's import
        sys.argv = [module, *args]
        return _run_module(module)

    exit_as_the_interpreter_would(run)


def exit_as_the_interpreter_would(run: Callable[[], Optional[int]]) -> NoReturn:
    """A forked child's whole life: ``run()``, its result the exit status, then what the
    interpreter's exit does (the non-daemon threads joined, the atexit handlers run, the
    streams flushed) and ``os._exit``. An exception is printed as an uncaught one is (status
    1): a child must never return or raise into the frames of the process it was forked from."""
    code = 1
    try:
        code = run() or 0
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - see above
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _run_module(module: str) -> int:
    """``python -m module``'s exit status."""
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        traceback.print_exc()
        return 1
    return 0


# --------------------------------------------------------------------------- launcher side


class _Failure:
    __slots__ = ("pid", "exitcode", "timestamp")

    def __init__(self, pid: int, exitcode: int) -> None:
        self.pid, self.exitcode, self.timestamp = pid, exitcode, time.time()


def _monitor(ranks: dict[int, int], nproc: int) -> int:
    """Wait for every rank; stop the others at the first failure or forwarded signal."""
    received: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, _frame: received.append(signum))
                for signum in _FORWARDED}
    live, failures, sent, kill_at = dict(ranks), {}, set(), None
    try:
        while live:
            for pid in list(live):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    rank = live.pop(pid)
                    exitcode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                    if exitcode and -exitcode not in sent:  # a rank we stopped is not a failure of its own
                        failures[rank] = _Failure(pid, exitcode)
            if live and kill_at is None and (failures or received):
                sent.add(_signal_all(live, received[0] if received else signal.SIGTERM))
                kill_at = time.monotonic() + STOP_GRACE_S
            if live and kill_at is not None and time.monotonic() >= kill_at:
                sent.add(_signal_all(live, signal.SIGKILL))
                kill_at = float("inf")
            if live:
                time.sleep(MONITOR_INTERVAL_S)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if failures:
        return report_failures(failures, nproc, stopped_by="the launcher")
    return 128 + received[0] if received else 0


def _signal_all(live: dict[int, int], signum: int) -> int:
    for pid in live:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    return signum


__all__ = ["STOP_GRACE_S", "exit_status", "run_module_forked"]
