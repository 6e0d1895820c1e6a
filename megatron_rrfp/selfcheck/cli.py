"""GPU self-check: what to run first on a GPU host (``scripts/gpu_selfcheck.py``).

    torchrun --nproc-per-node N scripts/gpu_selfcheck.py [--steps ...] [--json PATH]

Every step prints PASS / FAIL / SKIP with a one-line diagnosis; a step that hangs past
``--step-timeout`` dumps every thread's stack (faulthandler) and exits non-zero. Steps:

one GPU (every rank, on its own GPU)
  environment          versions, device, CUDA_DEVICE_MAX_CONNECTIONS (the script sets 1,
                       as Megatron-LM does, unless it is set)
  queue-serialization  whether a stream wait blocks later work of other streams here (the
                       hazard the rounds protocol is built for; informational), timed by CUDA
                       events; FAIL if its calibrated sleep kernel did not run as long as asked
  loopback             a 2-stage pipeline (bf, bfw, 1f1b, interleaved) in this process on
                       this GPU: the shipped executor and RoundTransport, rounds moved by
                       CUDA copies between two threads' streams, random kernel times
  stage-memory         peak memory of a stage (torch.cuda.max_memory_allocated) under RRFP
                       with the in-flight bound of 1F1B, against 1F1B itself
  one-context          this process holds a CUDA context on its own GPU only (nvidia-smi)
two or more GPUs (all ranks together, NCCL)
  nccl-stress          the NCCL rounds transport, random delays, both directions, random
                       message shapes, 20 iterations over every hint
  megatron-equivalence a tiny GPT, PP = every GPU: RRFP's losses and gradients against
                       Megatron's 1F1B
  equivalence-tp2-pp2  the same at TP=2 x PP=2 (4 GPUs; the rest data parallel): the TP
                       agreement on NCCL
  equivalence-pp4-chunks2-dp2
                       PP=4 x 2 chunks x DP=2 (8 GPUs): interleaving and data-parallel
                       reductions against Megatron's interleaved 1F1B
  production-*         Megatron-LM's production flags (sequence parallelism, overlapped DP
                       with the distributed optimizer, in and out of the task loop, MoE
                       EP2, bf16, paired F and B on megatron-core's two streams with
                       --overlap-moe-expert-parallel-comm), each against Megatron's own
                       schedule (4 GPUs; ``equivalence.py``)
  te-bfw, te-bias, te-first-microbatch, te-fp8, te-grouped
                       Transformer Engine's own split driven by rrfp's W, forward outside
                       deferring as the executor runs it: deferral observed, bias variants,
                       is_first_microbatch, FP8 (if the GPU has it), GroupedLinear experts
                       (``te.py``); one GPU is enough

Coverage limits, said here so a PASS is not read as more: the loopback step's rounds are
CUDA copies (its first side does not block its queue as an NCCL kernel does, and its
wait() blocks the host), so ordering deadlocks are the business of nccl-stress (real
NCCL) and of the single-queue emulation on CPU (``tests/helpers/queue_device.py``). The whole
run takes a few minutes on one 8-GPU node: torchrun --nproc-per-node 8 scripts/gpu_selfcheck.py
"""
from __future__ import annotations

import faulthandler
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from ..options import add_options, from_namespace, option
from .device import step_environment, step_one_context, step_queue_serialization
from .equivalence import GPT_STEPS
from .loopback import step_loopback, step_stage_memory
from .result import Result
from .runner import report, run_steps
from .stress import step_nccl_stress
from .te import TE_STEPS

STEPS_ONE_GPU = ("environment", "queue-serialization", "loopback", "stage-memory")
STEPS_MULTI_GPU = ("nccl-stress", "megatron-equivalence", "equivalence-tp2-pp2", "equivalence-pp4-chunks2-dp2",
                   "te-bfw", "te-bias", "te-first-microbatch", "te-fp8", "te-grouped",
                   *("production-" + name for name in ("sp-tp2-pp2", "dp-overlap-pp2-chunks2",
                                                     "dp-lockstep-pp2-chunks2", "dp-after-loop-pp2-chunks2",
                                                     "dp-epochs-pp4-chunks2", "moe-ep2-pp2",
                                                     "bf16-dp-overlap-pp2-chunks2", "moe-paired-ep2-pp2-chunks2")))
STEPS = STEPS_ONE_GPU + STEPS_MULTI_GPU + ("one-context",)
GPUS_NEEDED = {"nccl-stress": 2, "megatron-equivalence": 2, "equivalence-tp2-pp2": 4,
               "equivalence-pp4-chunks2-dp2": 8, "production-sp-tp2-pp2": 4, "production-dp-overlap-pp2-chunks2": 4,
               "production-dp-lockstep-pp2-chunks2": 4, "production-dp-after-loop-pp2-chunks2": 4,
               "production-dp-epochs-pp4-chunks2": 8, "production-moe-ep2-pp2": 4,
               "production-bf16-dp-overlap-pp2-chunks2": 4, "production-moe-paired-ep2-pp2-chunks2": 4}
"""A step runs where the world is a multiple of this many GPUs (the rest is data parallelism)."""

STEP_FUNCTIONS: dict[str, Callable] = {
    "environment": step_environment, "queue-serialization": step_queue_serialization, "loopback": step_loopback,
    "stage-memory": step_stage_memory, "one-context": step_one_context, "nccl-stress": step_nccl_stress,
    **GPT_STEPS, **TE_STEPS,
}


@dataclass(kw_only=True, slots=True)
class SelfCheckOptions:
    """``scripts/gpu_selfcheck.py``'s command line."""

    steps: str = option(",".join(STEPS), f"comma-separated subset of: {', '.join(STEPS)}")
    step_timeout: float = option(600.0, "seconds before a step counts as hung")
    stall_timeout: float = option(60.0, "RRFP's own stall timeout in the steps")
    seed: int = option(0, "seed of the steps' models, data and delays")
    json: Optional[str] = option(None, "write the results (rank 0)", metavar="PATH")


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, SelfCheckOptions)
    args = from_namespace(SelfCheckOptions, parser.parse_args(argv))
    steps = [s for s in args.steps.split(",") if s]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        parser.error(f"--steps: unknown {unknown}; choose from {', '.join(STEPS)}")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # before CUDA starts, as Megatron-LM does

    import torch

    if not torch.cuda.is_available():
        print("gpu_selfcheck: SKIP: no CUDA device is visible (torch.cuda.is_available() is False, torch "
              f"{torch.__version__}, built with CUDA {torch.version.cuda}); nothing to check here. On a GPU host run: "
              "torchrun --nproc-per-node N scripts/gpu_selfcheck.py")
        return 0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    import torch.distributed as dist

    store = None
    if world > 1:  # the rendezvous store carries every rank's failures and results (runner.py)
        store, _, _ = next(dist.rendezvous("env://"))
        dist.init_process_group("nccl", store=store, rank=int(os.environ["RANK"]), world_size=world,
                                device_id=torch.device("cuda", local))
    rank = dist.get_rank() if world > 1 else 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    faulthandler.enable()
    ctx = {"world": world, "rank": rank, "seed": args.seed, "stall_timeout_s": args.stall_timeout}
    order = [s for s in STEPS if s in steps]  # one-context last: after every thread ran

    def skip(step: str):
        need = GPUS_NEEDED.get(step, 1)
        if world < need or world % need:
            return Result(step, "SKIP", f"needs a multiple of {need} GPUs (here {world}): "
                                        f"torchrun --nproc-per-node {need} (or 8)")
        return None

    outcome = run_steps(order, STEP_FUNCTIONS, ctx, store=store, multi_rank=set(STEPS_MULTI_GPU), skip=skip,
                        step_timeout_s=args.step_timeout, finish=lambda o: report(o, rank=rank, world=world,
                                                                                  json_path=args.json))
    if world > 1:
        dist.destroy_process_group()
    return 1 if outcome.failed else 0


__all__ = ["GPUS_NEEDED", "STEPS", "STEP_FUNCTIONS", "main"]
