"""A rank of the GPU self-check's runner (megatron_rrfp/selfcheck/runner.py) on CPU, started by
``launch`` (gloo): steps ``local`` (one rank's own work), then ``collective`` (multi-rank):
rank 1 raises before the all-reduce (``fail``) or sleeps past the step timeout (``hang``)
while rank 0 waits in the all-reduce, then ``after`` (multi-rank). Rank 0 prints the
verdict. The ranks report through a FileStore, as the script's ranks do through the
rendezvous store."""
import time

import torch
import torch.distributed as dist

from megatron_rrfp.selfcheck.runner import Result, report, run_steps


def selfcheck_ranks(mode: str, store_path: str, step_timeout_s: float) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()

    def local(ctx):
        return Result("local", "PASS", "ok")

    def collective(ctx):
        if rank == 1:
            if mode == "fail":
                raise ValueError("injected failure")
            time.sleep(3600)
        dist.all_reduce(torch.ones(1))  # waits for rank 1 (gloo's timeout: 30 min)
        return Result("collective", "PASS", "ok")

    def after(ctx):
        dist.all_reduce(torch.ones(1))
        return Result("after", "PASS", "ok")

    outcome = run_steps(["local", "collective", "after"], {"local": local, "collective": collective, "after": after},
                        {"rank": rank, "world": world}, store=dist.FileStore(store_path, world),
                        multi_rank={"collective", "after"}, skip=lambda step: None, step_timeout_s=step_timeout_s,
                        finish=lambda o: report(o, rank=rank, world=world, json_path=None))
    return len(outcome.failed)
