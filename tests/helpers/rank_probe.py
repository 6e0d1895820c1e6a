"""A rank for tests/distributed/test_forked_ranks.py: ``python -m helpers.rank_probe ACTION``.

Joins the job's process group through the environment it was given (env://, as
``train``'s ranks do), prints what it saw as one JSON line, then: ``exit`` leaves with 0,
``fail-rank-1`` makes rank 1 exit with status 3 and the others wait, ``wait`` waits (for a
signal) until killed, ``lines`` writes LINES lines of its own through ``print_line`` (as the
ranks of ``train`` print theirs), all ranks at once.
"""
import datetime
import json
import os
import sys
import time

import torch.distributed as dist

from megatron_rrfp.ranks import print_line

LINES = 3000

action = sys.argv[1]
dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, os.getpid())
print_line(json.dumps({"rank": dist.get_rank(), "world": dist.get_world_size(), "argv": sys.argv[1:],
                       "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                               "OMP_NUM_THREADS")},
                       "pids": gathered}))
if action == "lines":
    dist.barrier()  # every rank writes at once
    for i in range(LINES):
        print_line(f"rank {dist.get_rank()} line {i} " + "x" * 300)
if action == "fail-rank-1" and dist.get_rank() == 1:
    sys.exit(3)
if action in ("fail-rank-1", "wait"):
    time.sleep(120)
