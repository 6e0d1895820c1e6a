"""The benchmark's shared-memory send-time table (/dev/shm/rrfp-sendtimes-*.npy) is removed
however the local run ends: an error, Ctrl-C, SIGTERM; one left by a SIGKILLed run is
removed by the next. In process: the ranks are stood in for by a launch that misbehaves."""
from __future__ import annotations

import glob
import os
import signal
import time

import pytest

from megatron_rrfp.bench import emulation
from megatron_rrfp.bench import run as bench_run

pytestmark = pytest.mark.timeout(60)


def _tables() -> list[str]:
    base = os.path.dirname(emulation.shared_table_path("x"))
    return glob.glob(os.path.join(base, f"rrfp-sendtimes-{os.getpid()}-*.npy"))


def _launch_that(action):
    def launch(*args, **kwargs):
        assert _tables(), "the table exists while the ranks run"
        action()
        time.sleep(5)  # a rank still working when the signal arrives
        return []
    return launch


@pytest.mark.parametrize("ending, expected", [
    (lambda: os.kill(os.getpid(), signal.SIGINT), KeyboardInterrupt),  # Ctrl-C
    (lambda: os.kill(os.getpid(), signal.SIGTERM), SystemExit),  # scancel, kill, a job scheduler
    (lambda: (_ for _ in ()).throw(RuntimeError("rank 2 died")), RuntimeError),
])
def test_the_table_is_removed_on_any_exit(tmp_path, monkeypatch, ending, expected):
    monkeypatch.setattr("megatron_rrfp.launch.function.launch", _launch_that(ending))
    config = bench_run.BenchConfig(out_dir=str(tmp_path))
    # the bench takes SIGTERM / SIGHUP only where they are at their defaults (a caller's own handler
    # wins), and Ctrl-C is Python's KeyboardInterrupt; start from there, whatever an earlier test in
    # this worker process left installed
    previous = {sig: signal.signal(sig, signal.SIG_DFL) for sig in (signal.SIGTERM, signal.SIGHUP)}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        handlers = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP))
        with pytest.raises(expected) as info:
            bench_run._run_locally(config, world=4, progress=False)
        restored = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if expected is SystemExit:
        assert info.value.code == 128 + signal.SIGTERM
    assert _tables() == [] and not glob.glob(str(tmp_path / ".progress-*"))
    assert restored == handlers  # put back


def test_a_table_left_by_a_killed_run_is_removed_by_the_next(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    stale = emulation.shared_table_path(f"{int(dead.stdout)}-1")
    live = emulation.shared_table_path(f"{os.getppid()}-1")  # a running process's: kept
    for path in (stale, live):
        open(path, "wb").close()
    try:
        removed = emulation.remove_stale_tables()
        assert stale in removed and not os.path.exists(stale)
        assert os.path.exists(live)
    finally:
        for path in (stale, live):
            if os.path.exists(path):
                os.remove(path)
