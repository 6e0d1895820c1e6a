"""The self-check's ``nccl-stress`` step: the shipped executor over the NCCL rounds transport on
every rank of the world (TP=2 where it allows), random kernel and host delays, random message
shapes, every hint and interleaving, values checked exactly at stage 0. The one step that runs
the ordering hazards on real NCCL; on CPU the same function runs over gloo."""
from __future__ import annotations

import random

from .loopback import TokenWork, check_finals
from .result import Result


def stress_layout(world: int) -> tuple[int, int]:
    """(TP, PP) of the stress step: TP=2 where the world allows it."""
    tp = 2 if world >= 4 and world % 2 == 0 else 1
    return tp, world // tp


def stress(ctx, *, device, iterations: int = 20) -> str:
    """The stress pipeline on every rank of the world; returns this rank's problem ("" if none).

    Every value the TP ranks of a stage must agree on (hint, chunks, buffer limit) comes from
    a generator seeded without the rank; kernel and host delays come from one seeded with it.
    Device-agnostic: on CPU it runs the same rounds protocol over gloo (tests/distributed/test_gpu.py)."""
    import torch
    import torch.distributed as dist

    from ..mcore.session import Session
    from ..policy.arbiter import ArbiterConfig
    from ..policy.plan import Plan
    from ..policy.topology import Topology
    from ..runtime.agreement import TPAgreement
    from ..runtime.executor import PipelineIteration

    world, rank = ctx["world"], dist.get_rank()
    tp, pp = stress_layout(world)
    pipeline = [s * tp + rank % tp for s in range(pp)]
    stage = pipeline.index(rank)
    tp_group = None
    for s in range(pp):  # collective over the world, every stage's group in the same order
        group = dist.new_group([s * tp + t for t in range(tp)]) if tp > 1 else None
        tp_group = group if s == stage else tp_group
    session = Session(pp_ranks=pipeline, agree_ranks=[stage * tp + t for t in range(tp)], device=device,
                      timeout_s=ctx["stall_timeout_s"], transport="rounds")
    shared = random.Random(ctx["seed"] * 31)  # the same draws on every rank
    own = random.Random(ctx["seed"] * 31 + 1 + rank)  # delays: this rank's own
    problem = ""
    try:
        for it in range(iterations):
            chunks = 2 if it % 4 == 3 else 1
            hint = ("bf", "bfw", "1f1b")[it % 3]
            topology, m = Topology(pp, chunks), 2 * pp
            plan = Plan.build(ArbiterConfig(hint=hint, buffer_limit=shared.choice((2, 32))), topology, m)
            finals: dict = {}
            work = TokenWork(topology, stage, finals, random.Random(own.random()), max_sleep_cycles=1_000_000,
                             device=device, tp_group=tp_group)
            agreement = None
            if session.agreement_group is not None:
                agreement = TPAgreement(session.agreement_group, num_microbatches=m, num_chunks=chunks,
                                        split_backward=plan.arbiter(stage).split_backward, forward_only=False,
                                        device=session.device)
            PipelineIteration(work=work, arbiter=plan.arbiter(stage), topology=topology, stage=stage,
                              stage_ranks=pipeline, transport=session.transport, inbox=session.inbox,
                              agreement=agreement, timeout_s=ctx["stall_timeout_s"], forward_only=False).run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if stage == 0:
                problem = check_finals(finals, topology, m)
            if problem:
                problem = f"iteration {it} ({hint}, chunks={chunks}): {problem}"
                break
    except BaseException as exc:  # noqa: BLE001 - reported by the step
        problem = f"{type(exc).__name__}: {exc}"
    finally:
        session.close()
    return problem


def step_nccl_stress(ctx) -> Result:
    import torch
    import torch.distributed as dist

    world = ctx["world"]
    problem = stress(ctx, device=torch.device("cuda", torch.cuda.current_device()))
    problems = [None] * world
    dist.all_gather_object(problems, problem)
    bad = {r: p for r, p in enumerate(problems) if p}
    if bad:
        return Result("nccl-stress", "FAIL", f"{bad}")
    tp, pp = stress_layout(world)
    return Result("nccl-stress", "PASS", f"TP={tp} x PP={pp}, 20 iterations (bf/bfw/1f1b, interleaved every 4th, "
                                         "random kernel times and message shapes, a TP all-reduce in every F and B"
                                         f"{'' if tp > 1 else ' (TP=1 here: none)'}): values exact on every rank")


__all__ = ["step_nccl_stress", "stress", "stress_layout"]
