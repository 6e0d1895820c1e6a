"""Where this process sits in the job, its process group, and the environment every launch sets up.

The rank comes from, in order:
  torchrun (or any torch.distributed launcher): RANK, WORLD_SIZE, LOCAL_RANK,
      MASTER_ADDR, MASTER_PORT;
  srun starting the ranks itself: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the master
      is the first host of SLURM_JOB_NODELIST (``scontrol show hostnames``) unless
      MASTER_ADDR is set, the port MASTER_PORT or 20000 + job id mod 20000;
  nothing: a single process.
(Local launches set the torchrun variables; the other modules of this folder start the ranks.)
"""
from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Optional

LOOPBACK = "127.0.0.1"
"""Where local ranks meet: the launching process's rendezvous store, the ranks' MASTER_ADDR."""
HIDDEN_CUDA = {"CUDA_VISIBLE_DEVICES": ""}
"""What a CPU run's processes get on a GPU host: no visible CUDA device (see ``hide_cuda``)."""


def hide_cuda(environ: MutableMapping[str, str] = os.environ) -> None:
    """Make this process (and every process it starts) see no CUDA device: a CPU run on a GPU host.

    Must happen before torch first asks the driver for the device count: torch keeps that
    count for the life of the process, and a fork inherits it, so a later empty
    CUDA_VISIBLE_DEVICES would not stop ``torch.cuda.is_available()`` from answering True
    and megatron-core from putting its buffers on CUDA."""
    environ.update(HIDDEN_CUDA)


def gloo_on_loopback(environ: MutableMapping[str, str] = os.environ) -> None:
    """Local gloo ranks talk over loopback unless the user chose an interface: gloo picks one by
    resolving the hostname, which containers often resolve to an address with no route."""
    if "GLOO_SOCKET_IFNAME" not in environ and os.path.exists("/sys/class/net/lo"):
        environ["GLOO_SOCKET_IFNAME"] = "lo"


def for_gloo_ranks(environ: MutableMapping[str, str]) -> None:
    """The environment of local gloo ranks: loopback (``gloo_on_loopback``) and no visible CUDA
    device (``hide_cuda``: a CUDA device they could see would draw megatron-core's buffers to it)."""
    gloo_on_loopback(environ)
    hide_cuda(environ)


def cuda_hidden(environ: Mapping[str, str] = os.environ) -> bool:
    """True where CUDA_VISIBLE_DEVICES hides every device (``hide_cuda``, or a user's empty value)."""
    return environ.get("CUDA_VISIBLE_DEVICES") == ""


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


RESTART_PREFIX = "rrfp/torchelastic-restart-{}"
"""Where a restarted attempt's ``env://`` keys go in torchrun's store (``keep_restart_keys_apart``)."""


def keep_restart_keys_apart(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """Give a worker that torchrun restarted its own keys in the agent's store; a line to print, or None.

    torch >= 2.5 shares the rendezvous TCPStore with the workers (TORCHELASTIC_USE_AGENT_STORE=True)
    and keeps it across restarts, without the per-attempt prefix it once had: a restarted worker's
    ``init_process_group`` (``env://``) reads the failed attempt's addresses and fails (gloo
    "connectFullMesh ... Connection refused"; NCCL a stale unique id). On one host every worker
    restarts with the same TORCHELASTIC_RESTART_COUNT, so ``env://``'s store gets the prefix
    RESTART_PREFIX of that count. Across hosts the count is the local agent's and may differ
    between hosts: nothing is changed and the line names torch's own switch,
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment (a new store every round)."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or int(environ.get("TORCHELASTIC_MAX_RESTARTS") or 0) < 1:
        return None
    if environ.get("LOCAL_WORLD_SIZE") != environ.get("WORLD_SIZE"):
        return ("megatron-rrfp: torchrun restarts workers on several hosts with its rendezvous store shared: set "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment, or the restarted workers meet "
                "the failed attempt's keys in init_process_group")
    attempt = int(environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    if attempt < 1:
        return None
    import importlib

    from torch.distributed import PrefixStore

    # torch's registry (the module, which torch.distributed's rendezvous function hides):
    # register_rendezvous_handler refuses a second "env"
    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    original = handlers["env"]
    if getattr(original, "rrfp_prefix", None) is None:
        prefix = RESTART_PREFIX.format(attempt)

        def env_handler(url, *args, **kwargs):
            for store, rank, world_size in original(url, *args, **kwargs):
                yield PrefixStore(prefix, store), rank, world_size

        env_handler.rrfp_prefix = prefix
        handlers["env"] = env_handler
    return (f"megatron-rrfp: torchrun restart {attempt}: init_process_group's keys go under "
            f"{handlers['env'].rrfp_prefix}/ in torchrun's store (the failed attempt's are still there)")


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
    restart = keep_restart_keys_apart()
    if restart and env.rank == 0:
        print(restart, file=sys.stderr, flush=True)
    dist.init_process_group("gloo" if cpu else "nccl", init_method="env://", rank=env.rank,
                            world_size=env.world_size, timeout=datetime.timedelta(seconds=timeout_s),
                            **({} if cpu else {"device_id": device}))
    return device


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
