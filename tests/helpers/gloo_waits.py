"""Rank body for tests/distributed/test_gloo_sliced_waits.py: Megatron's blocking gloo collectives
under the launcher's sliced waits (``megatron_lm.inprocess.wait_in_slices_on_gloo``), on 2 ranks.

A peer that joins late still gives the right sums (a plain and a coalesced all-reduce, the path of
Megatron's gradient all-reduce); an asynchronous exception raised as NVRx's monitor thread raises it
reaches rank 0 while it waits in an all-reduce that rank 1 never joins; the interrupted group is kept;
a new group works afterwards and both ranks return.
"""
from __future__ import annotations

import ctypes
import gc
import threading
import time

import torch


class Restart(BaseException):
    """What NVRx raises in the main thread (its RankShouldRestart is a BaseException too)."""


def _raise_in(thread_id: int) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(Restart))


def sliced_waits() -> dict:
    import torch.distributed as dist

    from megatron_rrfp.megatron_lm import inprocess

    changed = inprocess.wait_in_slices_on_gloo()
    rank = dist.get_rank()
    group = dist.new_group([0, 1], backend="gloo")
    out = {"rank": rank, "changed": changed, "sliced": getattr(dist.all_reduce, "_rrfp_sliced", False)}

    if rank == 1:
        time.sleep(1.5)  # rank 0 waits for this rank through several slices
    late = torch.full((4,), float(rank + 1))
    dist.all_reduce(late, group=group)
    first, second = torch.full((3,), float(rank + 1)), torch.full((5,), 10.0 * (rank + 1))
    with dist._coalescing_manager(group):
        dist.all_reduce(first, group=group)
        dist.all_reduce(second, group=group)
    out["sums"] = (late.tolist(), first.tolist(), second.tolist())

    if rank == 0:
        threading.Timer(1.0, _raise_in, (threading.get_ident(),)).start()
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1 << 16), group=group)  # rank 1 never joins it
            out["interrupted_after_s"] = None
        except Restart:
            out["interrupted_after_s"] = time.monotonic() - start
        out["kept"] = len(inprocess._KEPT)
    dist.barrier()

    fresh = dist.new_group([0, 1], backend="gloo")
    again = torch.ones(2)
    dist.all_reduce(again, group=fresh)
    out["fresh_sum"] = again.tolist()
    del group
    gc.collect()
    dist.barrier()
    return out


def megatron_p2p_waits() -> dict:
    """megatron-core's p2p module under the CPU redirection, then the launcher's sliced waits: its
    requests are waited on a helper thread. A late send still arrives whole (irecv and
    batch_isend_irecv); rank 0's wait for a receive rank 1 never sends is interrupted by an
    asynchronous exception within a slice, and the request is kept."""
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import p2p_communication

    from megatron_rrfp.cpu import enable_cpu_reference_schedules
    from megatron_rrfp.megatron_lm import inprocess

    enable_cpu_reference_schedules()
    inprocess.wait_in_slices_on_gloo()
    mdist = p2p_communication.torch.distributed  # what megatron-core's p2p code calls
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    out = {"rank": rank, "wrapped": [getattr(getattr(mdist, n), "_rrfp_thread_waited", False)
                                     for n in ("isend", "irecv", "batch_isend_irecv")]}
    if rank == 1:
        time.sleep(1.5)  # rank 0 waits for this send through several slices
        mdist.isend(torch.full((4,), 7.0), peer).wait()
    else:
        late = torch.zeros(4)
        mdist.irecv(late, peer).wait()
        out["late"] = late.tolist()
    box = torch.zeros(3)
    ops = [mdist.P2POp(mdist.isend, torch.full((3,), float(rank + 1)), peer),
           mdist.P2POp(mdist.irecv, box, peer)]
    for request in mdist.batch_isend_irecv(ops):
        request.wait()
    out["batched"] = box.tolist()
    if rank == 0:
        threading.Timer(1.0, _raise_in, (threading.get_ident(),)).start()
        start = time.monotonic()
        try:
            mdist.irecv(torch.zeros(2), peer).wait()  # rank 1 never sends it
            out["interrupted_after_s"] = None
        except Restart:
            out["interrupted_after_s"] = time.monotonic() - start
        out["kept"] = len(inprocess._KEPT)
    dist.barrier()
    return out
