"""``megatron-rrfp ARGS`` as a user runs it, without the fresh interpreter's imports.

A ``train`` subprocess spent ~6 s of CPU importing torch and megatron-core before it parsed
a flag, and the suite started a dozen of them. Here the command runs in a fork of the
launcher's fork server (``megatron_rrfp.launch.function``: one per test worker, torch and
megatron-core imported once, no thread, never a tensor op), with its own environment,
working directory and stdout / stderr files: ``cli.main(ARGS)``, then what the interpreter
does at exit (non-daemon threads joined, atexit handlers run), and its status as the exit
status. ``train --cpu --nproc N`` then forks its ranks from that process as it always does.

What a fresh interpreter does and this does not, so a test that asserts it starts a real
subprocess instead: megatron-core's import-time notes are said in the fork server, not in
the command's output; ``PYTHONWARNINGS`` is applied only as ``ignore`` (anything else is
refused here; unset, the fork server's filters stay: Python's defaults and the caller's).
``PYTHONPATH``'s folders go first on ``sys.path`` and a ``sitecustomize`` there is imported,
as at start-up.

The command dies with the fork server, which exits with the test worker; ``Command.kill``
stops it, and its ranks die with it (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Optional

from megatron_rrfp.launch.function import start_fork_server  # one server (CUDA hidden), whoever starts it

FOLLOW_INTERVAL_S = 0.02


class Command:
    """A started command: ``pid``, ``poll()``, ``wait(timeout)``, ``kill()``, its output files."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], merge_stderr: bool) -> None:
        self.argv = list(argv)
        self._dir = tempfile.mkdtemp(prefix="rrfp-cli-")
        self.stdout_path = os.path.join(self._dir, "stdout")
        self.stderr_path = self.stdout_path if merge_stderr else os.path.join(self._dir, "stderr")
        for path in {self.stdout_path, self.stderr_path}:
            open(path, "w").close()  # there to be read from the start
        start_fork_server()
        ctx = multiprocessing.get_context("forkserver")
        self._process = ctx.Process(target=_command_main, name="rrfp-cli",
                                    args=(self.argv, dict(env), os.getcwd(), self.stdout_path, self.stderr_path))
        self._lock = threading.Lock()
        self._process.start()
        self.pid = self._process.pid

    def poll(self) -> Optional[int]:
        with self._lock:  # the exit status is read once from the server's pipe: one reader at a time
            return self._process.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        """The exit status (negative: the signal that killed it, as ``subprocess``)."""
        multiprocessing.connection.wait([self._process.sentinel], timeout)
        status = self.poll()
        if status is None:
            raise subprocess.TimeoutExpired(self.argv, timeout)
        return status

    def kill(self) -> None:
        if self.poll() is None:
            self._process.kill()
            self.wait()

    def read(self, which: str = "stdout") -> str:
        path = self.stdout_path if which == "stdout" else self.stderr_path
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()

    def follow(self, on_line: Callable[[str], None]) -> threading.Thread:
        """A thread calling ``on_line`` with each stdout line as it is written, until the
        command has ended and every line is read."""

        def read_lines() -> None:
            with open(self.stdout_path, encoding="utf-8", errors="replace") as handle:
                partial = ""
                while True:
                    ended = self.poll() is not None
                    chunk = handle.read()
                    if chunk:
                        *lines, partial = (partial + chunk).split("\n")
                        for line in lines:
                            on_line(line + "\n")
                    elif ended:
                        if partial:
                            on_line(partial)
                        return
                    else:
                        time.sleep(FOLLOW_INTERVAL_S)

        thread = threading.Thread(target=read_lines, name="rrfp-cli-follow", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self._dir, ignore_errors=True)


def start(argv: Sequence[str], *, env: Optional[Mapping[str, str]] = None, merge_stderr: bool = False) -> Command:
    """Start ``megatron-rrfp ARGV`` with ``env`` (default: this process's environment)."""
    env = dict(os.environ if env is None else env)
    if env.get("PYTHONWARNINGS", "ignore") != "ignore":
        raise ValueError(f"PYTHONWARNINGS={env['PYTHONWARNINGS']!r}: only 'ignore' applies after start-up; "
                         "run the command as a subprocess to test warnings")
    return Command(argv, env, merge_stderr)


def run(argv: Sequence[str], *, timeout: float, env: Optional[Mapping[str, str]] = None) -> subprocess.CompletedProcess:
    """``subprocess.run(..., capture_output=True, text=True, timeout=...)`` for ``megatron-rrfp ARGV``."""
    command = start(argv, env=env)
    try:
        returncode = command.wait(timeout)
        return subprocess.CompletedProcess(command.argv, returncode, command.read("stdout"), command.read("stderr"))
    except subprocess.TimeoutExpired as expired:
        expired.output, expired.stderr = command.read("stdout"), command.read("stderr")
        raise
    finally:
        command.close()


def _command_main(argv: list[str], env: dict, cwd: str, stdout_path: str, stderr_path: str) -> None:
    """The fork server's child: the interpreter's ``python -m megatron_rrfp.cli ARGV``, after its imports."""
    import sys
    import warnings

    from megatron_rrfp.launch.env import die_with_parent
    from megatron_rrfp.launch.forked import exit_as_the_interpreter_would

    def run() -> Optional[int]:
        die_with_parent()  # the fork server, which exits with the test worker
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.stdout.flush()
        sys.stderr.flush()  # nothing the server buffered is written into the command's output
        for fd, path in ((1, stdout_path), (2, stderr_path)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(target, fd)  # fd level: the ranks it forks and C++ (gloo) write there too
            os.close(target)
        if env.get("PYTHONWARNINGS") == "ignore":
            warnings.simplefilter("ignore")
        _run_site_hooks(env.get("PYTHONPATH", ""))
        from megatron_rrfp import cli

        sys.argv = [cli.__file__, *argv]
        try:
            return cli.main(argv)
        except SystemExit as exc:  # argparse's usage errors
            return exc.code if isinstance(exc.code, int) or exc.code is None else 1

    exit_as_the_interpreter_would(run)


def _run_site_hooks(pythonpath: str) -> None:
    """What start-up does with ``PYTHONPATH``: its folders first on ``sys.path``, and a
    ``sitecustomize`` found there imported (tests/helpers/fault_site: a hook in every rank,
    which the ranks, forked from this process, inherit)."""
    import importlib
    import sys

    folders = [folder for folder in pythonpath.split(os.pathsep) if folder and folder not in sys.path]
    sys.path[:0] = folders
    if any(os.path.isfile(os.path.join(folder, "sitecustomize.py")) for folder in folders):
        sys.modules.pop("sitecustomize", None)
        importlib.import_module("sitecustomize")
