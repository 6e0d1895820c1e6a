"""Where this process sits in the job, its process group, and ``--nproc`` local launches.

The rank comes from, in order:
  torchrun (or any torch.distributed launcher): RANK, WORLD_SIZE, LOCAL_RANK,
      MASTER_ADDR, MASTER_PORT;
  srun starting the ranks itself: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the master
      is the first host of SLURM_JOB_NODELIST (``scontrol show hostnames``) unless
      MASTER_ADDR is set, the port MASTER_PORT or 20000 + job id mod 20000;
  nothing: a single process.
``spawn_local`` is what ``--nproc N`` does: N children on this host, like torchrun
(it hosts the rendezvous store itself, so no port can be taken in between).
"""
from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

GRACE_S = 10.0  # after the first rank fails, how long the others get to exit on their own


@dataclass(frozen=True, kw_only=True, slots=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str
    """torchrun | slurm | single."""


def detect(environ: Mapping[str, str] = os.environ) -> DistEnv:
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return DistEnv(rank=int(environ["RANK"]), world_size=int(environ["WORLD_SIZE"]),
                       local_rank=int(environ.get("LOCAL_RANK", 0)),
                       master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
                       master_port=int(environ.get("MASTER_PORT", 29500)), source="torchrun")
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        job = int(environ.get("SLURM_JOB_ID", "0"))
        return DistEnv(rank=int(environ["SLURM_PROCID"]), world_size=int(environ["SLURM_NTASKS"]),
                       local_rank=int(environ.get("SLURM_LOCALID", 0)),
                       master_addr=environ.get("MASTER_ADDR") or _first_slurm_host(environ),
                       master_port=int(environ.get("MASTER_PORT", 20000 + job % 20000)), source="slurm")
    return DistEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0, source="single")


def _first_slurm_host(environ: Mapping[str, str]) -> str:
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        return "127.0.0.1"
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=30, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"cannot expand SLURM_JOB_NODELIST={nodelist!r} with scontrol ({exc}); "
                           "set MASTER_ADDR to the first node's address") from exc
    return out[0]


def init_process_group(env: DistEnv, *, cpu: bool, timeout_s: float):
    """Initialise torch.distributed (gloo on CPU, NCCL on GPUs); return this rank's device."""
    import torch
    import torch.distributed as dist

    if cpu:
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise ValueError("no CUDA device is visible; pass --cpu to train on CPU with gloo")
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    if env.source == "single":  # still a process group: megatron's parallel_state needs one
        store = dist.HashStore()
        dist.init_process_group("gloo" if cpu else "nccl", store=store, rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return device
    os.environ.setdefault("MASTER_ADDR", env.master_addr)
    os.environ.setdefault("MASTER_PORT", str(env.master_port))
    dist.init_process_group("gloo" if cpu else "nccl", init_method="env://", rank=env.rank,
                            world_size=env.world_size, timeout=datetime.timedelta(seconds=timeout_s),
                            **({} if cpu else {"device_id": device}))
    return device


def spawn_local(nproc: int, command: Sequence[str], *, env: Optional[dict] = None,
                timeout_s: Optional[float] = None) -> int:
    """Run ``command`` as ranks 0..nproc-1 on this host; return the first failing rank's
    exit status (128 + N if signal N killed it; 124 on timeout) or 0. Children share this
    process's stdout/stderr; each failing rank is named on stderr. When one rank fails the
    others get GRACE_S seconds, then SIGKILL; children die with this process (Linux)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s or 3600))
    base = {**os.environ, **(env or {}), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True"}  # the children connect to our store
    if "GLOO_SOCKET_IFNAME" not in base and os.path.exists("/sys/class/net/lo"):
        base["GLOO_SOCKET_IFNAME"] = "lo"  # containers often resolve the hostname to no route
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(nproc):
            child_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            procs.append(subprocess.Popen(list(command), env=child_env, preexec_fn=die_with_parent))
        return _wait(procs, timeout_s)
    finally:
        for proc in procs:  # only alive here on an exception or timeout
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        del store


def _wait(procs: list, timeout_s: Optional[float]) -> int:
    """Poll the ranks; name each one that fails. Returns the first failure's exit status,
    124 on timeout, else 0. After the first failure the others get GRACE_S seconds."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    failed_at, code, reported = None, 0, set()
    while True:
        now = time.monotonic()
        for rank, proc in enumerate(procs):
            if proc.poll() not in (None, 0) and rank not in reported:
                reported.add(rank)
                _launcher_says(f"rank {rank} (pid {proc.pid}) {_describe_exit(proc.returncode)}")
                if failed_at is None:
                    failed_at, code = now, exit_status(proc.returncode)
        running = [rank for rank, proc in enumerate(procs) if proc.returncode is None]
        if not running:
            return code
        if failed_at is not None and now - failed_at > GRACE_S:
            _launcher_says(f"ranks {running} still running {GRACE_S:g} s after the first failure; killing them")
            return code
        if deadline is not None and now > deadline:
            _launcher_says(f"ranks {running} still running after {timeout_s:g} s; killing them")
            return code or 124
        time.sleep(0.1)


def exit_status(returncode: int) -> int:
    """A child's status as a shell reports it: 128 + N for a child killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def _launcher_says(message: str) -> None:
    print(f"megatron-rrfp: {message}", file=sys.stderr, flush=True)


def die_with_parent(parent_pid: Optional[int] = None) -> None:
    """Linux, in a child: SIGKILL it if the launching process dies (no orphaned ranks).
    With ``parent_pid``, also exit at once if that parent already died before prctl."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)
