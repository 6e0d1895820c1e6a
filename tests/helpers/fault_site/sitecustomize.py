"""Test-only fault injection for `megatron-rrfp train` ranks, installed from outside.

tests/e2e/test_train_failures.py puts this folder on PYTHONPATH of the job it launches, with
RRFP_FAULT_KILL_RANK=R and RRFP_FAULT_KILL_AT_ITER=N: rank R then SIGKILLs itself in its
2nd forward step of iteration N -- mid-pipeline, with no chance to clean up, like a node
that dies. Python imports ``sitecustomize`` at start-up in every process of the job.
"""
import os

_RANK, _AT = os.environ.get("RRFP_FAULT_KILL_RANK"), os.environ.get("RRFP_FAULT_KILL_AT_ITER")

if _RANK is not None and _AT is not None:
    import itertools
    import signal

    from megatron_rrfp.train import driver

    _train_step = driver.train_step

    def _killing_train_step(cfg, run):
        import torch.distributed as dist

        if run.iteration + 1 == int(_AT) and dist.get_rank() == int(_RANK):
            forward_step, calls = run.forward_step, itertools.count(1)

            def step(*args, **kwargs):
                if next(calls) == 2:
                    print(f"fault injection: SIGKILL rank {_RANK} in iteration {_AT}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                return forward_step(*args, **kwargs)

            run.forward_step = step
        return _train_step(cfg, run)

    driver.train_step = _killing_train_step
