"""What ends a gloo collective that a peer never joins: 2 CPU ranks under torchrun, one case per launch.

    python scripts/gloo_wait_probe.py [--cases abort-peer,abort-self,shutdown-peer,set-timeout,sliced-free,sliced-keep]

Rank 0 all-reduces on a two-rank group that rank 1 never joins; rank 1 stays alive for 15 s, then exits.

  abort-peer / shutdown-peer  rank 1 calls the group backend's abort() / shutdown() after 3 s
  abort-self                  rank 0 calls abort() from another thread after 3 s
  set-timeout                 rank 0 sets the group's timeout to 1 s from another thread after 3 s
  sliced-free / sliced-keep   rank 0 waits in slices (async_op=True, Work.wait(timeout=0.5 s)); another
                              thread raises an asynchronous exception in its main thread after 2 s (as
                              NVRx's monitor thread does); then both ranks drop the group (free) or rank 0
                              keeps a reference (keep), collect garbage, and all-reduce on a new group

Prints, per case, when rank 0's all-reduce ended and how (or that the case did not finish in 60 s).
Measurements for docs/resilience.md; not part of the package.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import os
import subprocess
import sys
import threading
import time

CASES = ("abort-peer", "shutdown-peer", "abort-self", "set-timeout", "sliced-free", "sliced-keep")


class Restart(BaseException):
    """Stands for NVRx's asynchronous RankShouldRestart."""


def _wait_in_slices(work) -> None:
    while True:
        try:
            work.wait(timeout=datetime.timedelta(seconds=0.5))
            return
        except RuntimeError as exc:
            if "timed out" not in str(exc).lower():
                raise


def _say(*parts) -> None:
    print("probe:", *parts, flush=True)


def worker(case: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    warm = torch.ones(4)
    dist.all_reduce(warm, group=group)
    backend = group._get_backend(torch.device("cpu"))
    if case.startswith("sliced"):
        start = time.monotonic()
        if rank == 1:
            time.sleep(2)
        late = torch.ones(8)
        _wait_in_slices(dist.all_reduce(late, group=group, async_op=True))
        _say(f"rank {rank}: a peer 2 s late, sliced all-reduce gave {late[0].item():g} after "
             f"{time.monotonic() - start:.1f} s")
    if rank == 1:
        if case in ("abort-peer", "shutdown-peer"):
            time.sleep(3)
            getattr(backend, case.split("-")[0])()
        if not case.startswith("sliced"):
            time.sleep(12)
            os._exit(0)
        time.sleep(3)
    else:
        main = threading.get_ident()
        if case == "abort-self":
            threading.Timer(3, backend.abort).start()
        if case == "set-timeout":
            threading.Timer(3, backend.set_timeout, (datetime.timedelta(seconds=1),)).start()
        if case.startswith("sliced"):
            threading.Timer(2, ctypes.pythonapi.PyThreadState_SetAsyncExc,
                            (ctypes.c_ulong(main), ctypes.py_object(Restart))).start()
        start = time.monotonic()
        try:
            big = torch.ones(1 << 20)
            if case.startswith("sliced"):
                _wait_in_slices(dist.all_reduce(big, group=group, async_op=True))
            else:
                dist.all_reduce(big, group=group)
            _say(f"{case}: rank 0's all-reduce completed after {time.monotonic() - start:.1f} s")
        except Restart:
            _say(f"{case}: asynchronous exception reached rank 0 after {time.monotonic() - start:.1f} s")
        except RuntimeError as exc:
            _say(f"{case}: rank 0's all-reduce raised after {time.monotonic() - start:.1f} s: {str(exc)[:90]}")
        if not case.startswith("sliced"):
            os._exit(0)
    kept = [group] if case == "sliced-keep" and rank == 0 else []
    dist.barrier()
    if not kept:
        dist.destroy_process_group(group)
    del group, backend
    start = time.monotonic()
    gc.collect()
    _say(f"{case}: rank {rank} collected garbage in {time.monotonic() - start:.1f} s")
    fresh = dist.new_group([0, 1])
    again = torch.ones(4)
    dist.all_reduce(again, group=fresh)
    dist.barrier()
    _say(f"{case}: rank {rank} all-reduced {again[0].item():g} on a new group; exiting")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    opts = parser.parse_args()
    for case in opts.cases.split(","):
        if case not in CASES:
            parser.error(f"--cases: unknown {case!r}; choose from {','.join(CASES)}")
        env = {**os.environ, "RRFP_PROBE_CASE": case, "GLOO_SOCKET_IFNAME": "lo", "TORCH_CPP_LOG_LEVEL": "error",
               "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   os.path.abspath(__file__)]
        with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) as proc:
            try:
                out, _ = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)  # its own session: torchrun and its two ranks
                out, _ = proc.communicate()
                out += f"probe: {case}: did not finish within 60 s (killed)\n"
        print(f"== {case} (exit {proc.returncode})")
        print("".join(line + "\n" for line in out.splitlines() if line.startswith("probe:")), end="", flush=True)


if __name__ == "__main__":
    if os.environ.get("RRFP_PROBE_CASE"):
        worker(os.environ["RRFP_PROBE_CASE"])
    else:
        main()
