"""One Python function on N local gloo ranks: ``launch(fn, ...)``.

It runs ``fn`` on every rank (benchmarks, the self-check, tests) and turns any failure or hang
into one readable error. (The other ways ranks get started are listed in ``launch/__init__.py``.)

    from megatron_rrfp.launch.function import launch
    values = launch(check_ranks, world_size=4, tp=2, timeout=60)   # pp = 4 // (2*1) = 2

Each rank is a fresh process that inherits nothing from the launching process's state, and
sees no CUDA device: the ranks are gloo ranks, and on a GPU host megatron-core would otherwise
put its buffers on CUDA (``env.hide_cuda``). Each is forked from multiprocessing's fork server,
which imported torch and megatron-core once (``_PRELOAD``): importing megatron-core costs
~10 s of CPU per process (it pulls in torch._dynamo and torch._inductor), which made
start-up, not work, most of a short 4-rank run on a 2-core machine. The server is a fresh,
single-threaded interpreter started with CUDA hidden (``start_fork_server``), which has never
run a tensor op nor counted CUDA devices, so forking it is safe whatever the launching
process did with its own GPU; it is started on the first launch and exits after the
launching process. The children get the launcher's environment as it is at each call; only
modules the server preloaded saw the environment of the first launch.
It joins a gloo process group through a TCPStore that *this* process hosts on 127.0.0.1
(port chosen by the OS, so concurrent launches never race for a port), optionally calls
megatron-core's ``initialize_model_parallel``, runs ``fn(*args, **kwargs)`` and sends
back its return value. A rank that raises, dies, or is still running when the run is
over is reported in one ``DistributedTestFailure`` that lists every rank: its traceback,
or its live Python stacks (dumped by faulthandler on SIGUSR1 just before it is killed),
and the tails of its captured stdout/stderr.

Only processes started here are ever signalled, by pid, and no rank outlives ``launch``.
This module imports torch lazily so a child can set OMP_NUM_THREADS and friends first.
"""
from __future__ import annotations

import dataclasses
import datetime
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
import traceback

from .env import HIDDEN_CUDA, LOOPBACK, die_with_parent, for_gloo_ranks, hide_cuda

__all__ = ["DistributedTestFailure", "RankOutcome", "launch", "start_fork_server"]

# How long the other ranks get to finish (usually: fail too) after the first rank fails.
GRACE_PERIOD_S = 10.0
# How long a SIGUSR1'd rank gets to write its stacks before SIGKILL.
STACK_DUMP_WAIT_S = 2.0
_TAIL_LINES = 30
_TAIL_CHARS = 4000
# What the fork server imports once for all ranks: what every rank imports anyway.
_PRELOAD = ("megatron_rrfp.launch.rank_filters", "torch", "torch.distributed", "megatron.core",
            "megatron.core.parallel_state", "megatron.core.pipeline_parallel.schedules", "megatron.core.models.gpt",
            "megatron.core.distributed", "megatron.core.optimizer")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RankOutcome:
    """What happened to one rank of a ``launch``."""

    rank: int
    """Global rank."""
    pid: int | None
    """OS pid of the child process (already reaped when you see this)."""
    status: str
    """'ok', 'raised' (traceback in ``detail``), 'died' (exited without a result) or
    'killed' (still running at the end; its stacks are in ``stacks``)."""
    exitcode: int | None
    """Process exit code; negative for a signal (-9: killed by us)."""
    detail: str = ""
    """Traceback of the exception for 'raised'; why it was killed for 'killed'."""
    stacks: str = ""
    """faulthandler dump of all threads, taken just before a 'killed' rank was killed."""
    stdout_tail: str = ""
    stderr_tail: str = ""

    def render(self) -> str:
        head = f"--- rank {self.rank} (pid {self.pid}): {self.status}, exit code {self.exitcode}"
        parts = [head]
        if self.detail:
            parts.append(self.detail.rstrip())
        if self.status != "ok":
            if self.stacks:
                parts.append("Python stacks at kill time:\n" + self.stacks.rstrip())
            if self.stderr_tail:
                parts.append("stderr (tail):\n" + self.stderr_tail.rstrip())
            if self.stdout_tail:
                parts.append("stdout (tail):\n" + self.stdout_tail.rstrip())
        return "\n".join(parts)


class DistributedTestFailure(RuntimeError):
    """A launched run failed; the message shows every rank's outcome.

    ``outcomes`` holds the same information as ``RankOutcome`` objects (index = rank).
    """

    def __init__(self, summary: str, outcomes: list[RankOutcome]):
        self.summary = summary
        self.outcomes = outcomes
        body = "\n".join(o.render() for o in outcomes)
        super().__init__(f"{summary}\n{body}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _RankSpec:
    """Everything a child needs; plain data so it pickles under 'spawn'."""

    rank: int
    world_size: int
    parent_pid: int
    store_port: int
    tp: int
    pp: int
    cp: int
    vpp: int | None
    init_megatron: bool
    ep: int
    seed: int
    env: dict
    payload: bytes  # pickled (fn, args, kwargs): unpickled only after env is applied
    run_dir: str
    pg_timeout_s: float

    def path(self, kind: str) -> str:
        return _rank_path(self.run_dir, self.rank, kind)


def _rank_path(run_dir: str, rank: int, kind: str) -> str:
    return os.path.join(run_dir, f"rank{rank}.{kind}")


# --------------------------------------------------------------------------- parent side


def launch(fn, *, world_size: int, tp: int = 1, pp: int | None = None, cp: int = 1,
           vpp: int | None = None, ep: int = 1, timeout: float = 120.0, args: tuple = (),
           kwargs: dict | None = None, init_megatron: bool = True, seed: int = 1234,
           env: dict | None = None, start_method: str | None = None) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return values by rank.

    ``pp`` defaults to ``world_size // (tp * cp)``; data parallelism takes the rest.
    ``ep``: expert_model_parallel_size (it divides the data x context parallel ranks).
    ``env`` adds to the children's environment (which already has OMP_NUM_THREADS=1).
    Raises ``DistributedTestFailure`` if any rank raises, dies or outlives ``timeout``
    seconds; raises ``ValueError`` for an impossible layout before starting anything.
    ``start_method='spawn'`` starts each rank as a fresh interpreter instead of a fork of the
    fork server (slower; the ranks still see no CUDA device).
    """
    pp = _check_layout(world_size=world_size, tp=tp, pp=pp, cp=cp, vpp=vpp)
    if ep < 1 or (world_size // (tp * pp)) % ep:
        raise ValueError(f"ep={ep} must divide the data x context parallel size {world_size // (tp * pp)}")
    if start_method not in (None, "spawn", "forkserver"):
        raise ValueError(f"start_method={start_method!r}: use 'spawn', 'forkserver' or None (automatic)")
    payload = pickle.dumps((fn, tuple(args), dict(kwargs or {})))  # fail here, not in 4 children
    child_env = _child_env(env)
    from ..quiet import announce

    announce()  # a CLI command's one line for megatron-core's notes, which its ranks hide (quiet.py)

    import torch.distributed as dist  # lazy: see module docstring

    run_dir = tempfile.mkdtemp(prefix="rrfp-launch-")
    # The parent hosts the rendezvous store, so the port is bound before any child starts.
    store = dist.TCPStore(LOOPBACK, 0, None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout + 60))
    procs: list = []
    launcher_alive = None  # under 'forkserver': (read end for the ranks, our write end)
    try:
        start_method = start_method or "forkserver"
        ctx = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            start_fork_server()
            launcher_alive = ctx.Pipe(duplex=False)
        for rank in range(world_size):
            spec = _RankSpec(rank=rank, world_size=world_size, parent_pid=os.getpid(),
                             store_port=store.port, tp=tp, pp=pp, cp=cp, vpp=vpp, ep=ep,
                             init_megatron=init_megatron, seed=seed, env=child_env,
                             payload=payload, run_dir=run_dir, pg_timeout_s=timeout + 30)
            watch = None if launcher_alive is None else launcher_alive[0]
            proc = ctx.Process(target=_child_main, args=(spec, watch), name=f"rrfp-rank{rank}")
            proc.start()
            procs.append(proc)
        return _supervise(procs, run_dir=run_dir, timeout=timeout,
                          what=f"launch({_name(fn)}, world_size={world_size}, tp={tp}, "
                               f"pp={pp}, cp={cp}, vpp={vpp}" + (f", ep={ep})" if ep > 1 else ")"))
    finally:
        for proc in procs:  # only reached alive on an exception inside _supervise (e.g. ^C)
            if proc.exitcode is None:
                proc.kill()
            proc.join()
        for end in launcher_alive or ():
            end.close()
        del store
        shutil.rmtree(run_dir, ignore_errors=True)


def _check_layout(*, world_size: int, tp: int, pp: int | None, cp: int, vpp: int | None) -> int:
    if world_size < 1 or tp < 1 or cp < 1 or (pp is not None and pp < 1):
        raise ValueError(f"sizes must be >= 1: world_size={world_size}, tp={tp}, pp={pp}, cp={cp}")
    if pp is None:
        if world_size % (tp * cp):
            raise ValueError(f"world_size={world_size} is not divisible by tp*cp={tp}*{cp}")
        pp = world_size // (tp * cp)
    if world_size % (tp * pp * cp):
        raise ValueError(f"world_size={world_size} is not divisible by tp*pp*cp={tp}*{pp}*{cp}")
    if vpp is not None and (vpp < 1 or pp < 2):
        raise ValueError(f"vpp={vpp} needs vpp >= 1 and pp >= 2 (pp={pp})")
    return pp


def start_fork_server() -> None:
    """Start multiprocessing's fork server once per process, preloading ``_PRELOAD`` with CUDA
    hidden from it (and so from every process forked from it), whatever this process's own
    environment says; a no-op while it runs."""
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(list(_PRELOAD))
    saved = {name: os.environ.get(name) for name in HIDDEN_CUDA}
    hide_cuda()  # the server is exec'd with this process's environment at this moment
    try:
        forkserver.ensure_running()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _child_env(extra: dict | None) -> dict:
    # The whole environment: a forked rank would otherwise see the fork server's, which is
    # the launcher's as it was at the first launch.
    env = dict(os.environ)
    # 2-core CI machines run 4+ ranks: one intra-op thread each avoids oversubscription.
    env["OMP_NUM_THREADS"] = "1"
    env.update({str(k): str(v) for k, v in (extra or {}).items()})
    for_gloo_ranks(env)  # loopback unless ``extra`` or the environment chose an interface; CUDA hidden, always
    return env


def _name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _supervise(procs: list, *, run_dir: str, timeout: float, what: str) -> list:
    """Wait for all ranks; on failure or timeout dump and kill the rest; return or raise."""
    start = time.monotonic()
    deadline = start + timeout
    results: dict[int, tuple] = {}  # rank -> ("ok", value) | ("raised", traceback)
    first_failure: str | None = None
    grace_end: float | None = None
    while True:
        # Exit codes before results: a rank seen exited has already written any result.
        exitcodes = [p.exitcode for p in procs]
        _collect_results(results, run_dir, len(procs))
        alive = [p for p, code in zip(procs, exitcodes) if code is None]
        if first_failure is None:
            first_failure = _first_failure(exitcodes, results)
            if first_failure is not None:
                grace_end = time.monotonic() + GRACE_PERIOD_S
        if not alive:
            break
        now = time.monotonic()
        if now >= deadline or (grace_end is not None and now >= grace_end):
            break
        end = deadline if grace_end is None else min(deadline, grace_end)
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=min(0.2, end - now))

    elapsed = time.monotonic() - start
    timed_out = first_failure is None and any(p.exitcode is None for p in procs)
    if timed_out:
        why = f"still running at the {timeout:g} s timeout"
    else:
        why = f"still running {GRACE_PERIOD_S:g} s after the first failure ({first_failure})"
    stacks = _dump_and_kill([p for p in procs if p.exitcode is None], run_dir=run_dir, procs=procs)
    _collect_results(results, run_dir, len(procs))  # some may have finished meanwhile

    outcomes = [_outcome(rank, proc, results.get(rank), stacks.get(rank), run_dir, why)
                for rank, proc in enumerate(procs)]
    if all(o.status == "ok" for o in outcomes):
        return [results[rank][1] for rank in range(len(procs))]
    bad = ", ".join(f"rank {o.rank} {o.status}" for o in outcomes if o.status != "ok")
    cause = f"timed out after {timeout:g} s" if timed_out else f"failed after {elapsed:.1f} s"
    raise DistributedTestFailure(f"{what} {cause}: {bad}", outcomes)


def _collect_results(results: dict, run_dir: str, world_size: int) -> None:
    for rank in range(world_size):
        if rank not in results and os.path.exists(_rank_path(run_dir, rank, "result")):
            results[rank] = _read_result(run_dir, rank)


def _first_failure(exitcodes: list, results: dict) -> str | None:
    for rank, code in enumerate(exitcodes):
        if results.get(rank, ("ok",))[0] == "raised":
            return f"rank {rank} raised"
        if code is not None and rank not in results:
            return f"rank {rank} died with exit code {code}"
    return None


def _dump_and_kill(survivors: list, *, run_dir: str, procs: list) -> dict[int, str]:
    """SIGUSR1 each survivor (faulthandler dumps its stacks), then SIGKILL; rank -> stacks."""
    if not survivors:
        return {}
    ranks = {id(p): procs.index(p) for p in survivors}
    for proc in survivors:
        _signal(proc, signal.SIGUSR1)
    # Wait until each stack file has stopped growing (or the wait is over).
    end = time.monotonic() + STACK_DUMP_WAIT_S
    sizes: dict[int, int] = {}
    while time.monotonic() < end:
        time.sleep(0.1)
        now = {r: _size(_rank_path(run_dir, r, "stacks")) for r in ranks.values()}
        if all(now[r] > 0 for r in now) and now == sizes:
            break
        sizes = now
    for proc in survivors:
        _signal(proc, signal.SIGKILL)
    for proc in survivors:
        proc.join()
    return {r: _read_text(_rank_path(run_dir, r, "stacks")) for r in ranks.values()}


def _signal(proc, sig) -> None:
    if proc.exitcode is None:  # also reaps; never signal a pid we have already reaped
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass


def _outcome(rank, proc, result, stacks, run_dir, why) -> RankOutcome:
    common = dict(rank=rank, pid=proc.pid, exitcode=proc.exitcode,
                  stdout_tail=_tail(_rank_path(run_dir, rank, "out")),
                  stderr_tail=_tail(_rank_path(run_dir, rank, "err")))
    if result is not None and result[0] == "raised":
        return RankOutcome(status="raised", detail=result[1], **common)
    if stacks is not None:
        done = " (fn had returned)" if result is not None else ""
        return RankOutcome(status="killed", detail=f"killed: {why}{done}",
                           stacks=stacks or "(no stack dump: the rank did not answer SIGUSR1)",
                           **common)
    if result is None:
        return RankOutcome(status="died", detail="exited without reporting a result", **common)
    return RankOutcome(status="ok", **common)


def _read_result(run_dir: str, rank: int) -> tuple:
    with open(_rank_path(run_dir, rank, "result"), "rb") as f:
        return pickle.load(f)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _tail(path: str) -> str:
    lines = _read_text(path).splitlines()[-_TAIL_LINES:]
    return "\n".join(lines)[-_TAIL_CHARS:]


# --------------------------------------------------------------------------- child side

_KEEP_OPEN: list = []  # files faulthandler writes to must outlive _child_main's frames


def _child_main(spec: _RankSpec, launcher_alive) -> None:
    _redirect_stdio(spec)
    _die_with_launcher(spec, launcher_alive)
    os.environ.clear()
    os.environ.update(spec.env)
    from ..quiet import from_environment

    from_environment()  # started by a CLI command: its filter for known dependency warnings
    import faulthandler

    stacks = open(spec.path("stacks"), "w")
    _KEEP_OPEN.append(stacks)
    faulthandler.enable()  # fatal signals (segfault...) print stacks to the captured stderr
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        fn, args, kwargs = pickle.loads(spec.payload)
        _setup(spec)
        value = fn(*args, **kwargs)
    except BaseException:
        _write_result(spec, ("raised", traceback.format_exc()))
        _hard_exit(1)  # skip interpreter teardown: a wedged peer must not hang our exit
    try:
        _teardown(spec)
    except BaseException:
        _write_result(spec, ("raised", "fn returned, then teardown failed:\n"
                             + traceback.format_exc()))
        _hard_exit(1)
    _write_result(spec, ("ok", value))
    # Skip interpreter shutdown: on a loaded machine, garbage-collecting the destroyed
    # gloo groups at exit was seen to hang all ranks ("Garbage-collecting", no Python frame).
    _hard_exit(0)


def _die_with_launcher(spec: _RankSpec, launcher_alive) -> None:
    """SIGKILL this rank if the launcher (e.g. pytest) dies, however it dies.

    A 'spawn' rank is the launcher's child: the kernel's parent-death signal does it. A
    'forkserver' rank is the server's child, and the server outlives the launcher while
    any rank lives (each holds the server's keep-alive pipe), so a thread waits on a pipe
    whose only write end the launcher holds: end of file means the launcher is gone.
    """
    if launcher_alive is None:
        die_with_parent(spec.parent_pid)
        return

    def wait_for_launcher_exit() -> None:
        try:
            launcher_alive.recv_bytes()  # the launcher never writes
        except (EOFError, OSError):
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait_for_launcher_exit, name="rrfp-launcher-watch", daemon=True).start()


def _redirect_stdio(spec: _RankSpec) -> None:
    # dup2 at the fd level so C++ (gloo, torch) output is captured too.
    import sys

    for fd, kind, stream in ((1, "out", sys.stdout), (2, "err", sys.stderr)):
        target = os.open(spec.path(kind), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        stream.flush()
        os.dup2(target, fd)
        os.close(target)


def _setup(spec: _RankSpec) -> None:
    import random

    import torch
    import torch.distributed as dist

    random.seed(spec.seed)
    try:
        import numpy

        numpy.random.seed(spec.seed)
    except ImportError:
        pass
    torch.manual_seed(spec.seed)
    if "OMP_NUM_THREADS" in spec.env:  # torch may have been imported before env applied
        torch.set_num_threads(int(spec.env["OMP_NUM_THREADS"]))
    timeout = datetime.timedelta(seconds=spec.pg_timeout_s)
    store = dist.TCPStore(LOOPBACK, spec.store_port, spec.world_size, is_master=False,
                          timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=spec.rank, world_size=spec.world_size,
                            timeout=timeout)
    if spec.init_megatron:
        from megatron.core import parallel_state

        # No model_parallel_cuda_manual_seed: it needs CUDA (see megatron_rrfp.cpu).
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=spec.tp, pipeline_model_parallel_size=spec.pp,
            virtual_pipeline_model_parallel_size=spec.vpp, context_parallel_size=spec.cp,
            **({"expert_model_parallel_size": spec.ep} if spec.ep > 1 else {}))


def _teardown(spec: _RankSpec) -> None:
    import torch.distributed as dist

    # Nobody closes its sockets while a peer may still be reading from them.
    dist.barrier()
    if spec.init_megatron:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _write_result(spec: _RankSpec, result: tuple) -> None:
    try:
        data = pickle.dumps(result)
    except Exception:
        data = pickle.dumps(("raised", "fn's return value could not be pickled:\n"
                             + traceback.format_exc()))
    tmp = spec.path("result.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, spec.path("result"))  # the parent never sees a half-written result


def _hard_exit(code: int) -> None:
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
