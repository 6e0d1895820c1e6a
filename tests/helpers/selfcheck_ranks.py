"""A rank of the self-check's runner on CPU (gloo), started by torch's launcher:

    python -m torch.distributed.run --standalone --nproc-per-node 2 selfcheck_ranks.py fail|hang

Steps: ``local`` (one rank's own work), then ``collective`` (multi-rank): rank 1 raises
before the all-reduce (``fail``) or sleeps past the step timeout (``hang``) while rank 0
waits in the all-reduce, then ``after`` (multi-rank). Rank 0 prints the verdict."""
import os
import sys
import time

import torch
import torch.distributed as dist

from megatron_rrfp.verify.selfcheck import report
from megatron_rrfp.verify.selfcheck_runner import Result, run_steps

MODE = sys.argv[1]


def local(ctx):
    return Result("local", "PASS", "ok")


def collective(ctx):
    if ctx["rank"] == 1:
        if MODE == "fail":
            raise ValueError("injected failure")
        time.sleep(3600)
    dist.all_reduce(torch.ones(1))  # waits for rank 1 (gloo's timeout: 30 min)
    return Result("collective", "PASS", "ok")


def after(ctx):
    dist.all_reduce(torch.ones(1))
    return Result("after", "PASS", "ok")


if __name__ == "__main__":
    store, rank, world = next(dist.rendezvous("env://"))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    ctx = {"rank": rank, "world": world}
    outcome = run_steps(["local", "collective", "after"], {"local": local, "collective": collective, "after": after},
                        ctx, store=store, multi_rank={"collective", "after"}, skip=lambda step: None,
                        step_timeout_s=float(os.environ.get("STEP_TIMEOUT_S", "5")),
                        finish=lambda o: report(o, rank=rank, world=world, json_path=None))
    sys.exit(1 if outcome.failed else 0)
