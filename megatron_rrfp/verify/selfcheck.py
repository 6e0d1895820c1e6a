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
  te-bfw, te-bias, te-first-microbatch, te-fp8, te-grouped
                       Transformer Engine's own split driven by rrfp's W, forward outside
                       deferring as the executor runs it: deferral observed, bias variants,
                       is_first_microbatch, FP8 (if the GPU has it), GroupedLinear experts
                       (``verify/selfcheck_te.py``); one GPU is enough

Coverage limits, said here so a PASS is not read as more: the loopback step's rounds are
CUDA copies (its first side does not block its queue as an NCCL kernel does, and its
wait() blocks the host), so ordering deadlocks are the business of nccl-stress (real
NCCL) and of the single-queue emulation on CPU (``tests/helpers/queue_device.py``). The whole
run takes a few minutes on one 8-GPU node: torchrun --nproc-per-node 8 scripts/gpu_selfcheck.py
"""
from __future__ import annotations

import faulthandler
import json
import os
import random
import subprocess
import sys
from collections.abc import Callable

from .selfcheck_loopback import MLPWork, TokenWork, check_finals, loopback_pipeline
from .selfcheck_result import Result
from .selfcheck_runner import Outcome, run_steps
from .selfcheck_te import TE_STEPS

STEPS_ONE_GPU = ("environment", "queue-serialization", "loopback", "stage-memory")
STEPS_MULTI_GPU = ("nccl-stress", "megatron-equivalence", "equivalence-tp2-pp2", "equivalence-pp4-chunks2-dp2",
                   "te-bfw", "te-bias", "te-first-microbatch", "te-fp8", "te-grouped",
                   *("production-" + name for name in ("sp-tp2-pp2", "dp-overlap-pp2-chunks2",
                                                     "dp-lockstep-pp2-chunks2", "moe-ep2-pp2",
                                                     "bf16-dp-overlap-pp2-chunks2")))
STEPS = STEPS_ONE_GPU + STEPS_MULTI_GPU + ("one-context",)
GPUS_NEEDED = {"nccl-stress": 2, "megatron-equivalence": 2, "equivalence-tp2-pp2": 4,
               "equivalence-pp4-chunks2-dp2": 8, "production-sp-tp2-pp2": 4, "production-dp-overlap-pp2-chunks2": 4,
               "production-dp-lockstep-pp2-chunks2": 4, "production-moe-ep2-pp2": 4,
               "production-bf16-dp-overlap-pp2-chunks2": 4}
"""A step runs where the world is a multiple of this many GPUs (the rest is data parallelism)."""




# --------------------------------------------------------------------------- one-GPU steps

def step_environment(ctx) -> Result:
    import torch

    nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
    name = torch.cuda.get_device_name()
    cdmc = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset")
    return Result("environment", "PASS", f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, "
                                         f"{name}, world {ctx['world']}, CUDA_DEVICE_MAX_CONNECTIONS={cdmc}")


# The probe runs in its own interpreter (CUDA_DEVICE_MAX_CONNECTIONS=1 must be set before CUDA
# starts). Every figure is device time from CUDA events; the host's clock only cross-checks it.
# Every kernel runs once before any clock starts: a kernel's first launch loads its module (lazy
# loading), which can wait for the device, so a first launch behind the long sleep stalled the
# host until the sleep was over and both host-clock readings came out as zero.
_SERIALIZATION_PROBE = r"""
import json, sys, time, torch
device, requested_s = int(sys.argv[1]), float(sys.argv[2])
torch.cuda.set_device(device)  # the rank's own GPU
a, b, c = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
x, y = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
event = lambda: torch.cuda.Event(enable_timing=True)
for s in (a, b, c):
    with torch.cuda.stream(s):
        torch.cuda._sleep(1000); x.add_(1); y.add_(1); event().record()
torch.cuda.synchronize()

def sleep_s(cycles):
    start, end = event(), event()
    with torch.cuda.stream(a):
        start.record(); torch.cuda._sleep(cycles); end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3

sleep_s(int(1e8))  # the clocks up from idle
short, long = int(2e7), int(2e8)
t_short, t_long = sleep_s(short), sleep_s(long)
rate = (long - short) / max(t_long - t_short, 1e-9)  # clock64 cycles per second; launch costs cancel
cycles = int(rate * requested_s)
torch.cuda.synchronize()
t0, ta, tb = event(), event(), event()
host0 = time.monotonic()
with torch.cuda.stream(a):
    t0.record(); torch.cuda._sleep(cycles); ta.record()
c.wait_event(ta)
with torch.cuda.stream(c):
    x.add_(1)
with torch.cuda.stream(b):
    y.add_(1); tb.record()
issued_s = time.monotonic() - host0
tb.synchronize(); host_b_s = time.monotonic() - host0
ta.synchronize(); host_s = time.monotonic() - host0
nominal_hz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0) * 1e3  # kHz; 0: unknown
print(json.dumps(dict(requested_s=requested_s, cycles=cycles, rate_hz=rate, nominal_hz=nominal_hz,
                      calibration_s=[t_short, t_long], kernel_s=t0.elapsed_time(ta) / 1e3,
                      b_s=max(0.0, t0.elapsed_time(tb) / 1e3), host_s=host_s, host_b_s=host_b_s,
                      issued_s=issued_s)))
"""
SLEEP_REQUESTED_S = 0.5


def judge_serialization_probe(figures: dict, gpu: str) -> Result:
    """The probe's verdict: FAIL when its clock is not real (the calibrated sleep did not run
    about as long as asked, by CUDA events and by the host's clock, or the measured clock is
    not the device's); else PASS, saying whether stream B waited behind the other stream's wait."""
    requested, kernel, host = figures["requested_s"], figures["kernel_s"], figures["host_s"]
    rate, nominal = figures["rate_hz"], figures["nominal_hz"]
    clock = f"{figures['cycles']} cycles at {rate / 1e9:.3f} GHz measured" + (
        f" (nominal {nominal / 1e9:.3f} GHz)" if nominal else "")
    problems = []
    low, high = (0.2 * nominal, 1.2 * nominal) if nominal else (1e8, 5e9)
    if not low <= rate <= high:
        problems.append(f"the sleep kernel's clock measured {rate / 1e9:.3f} GHz, outside "
                        f"{low / 1e9:.2f}-{high / 1e9:.2f} GHz")
    if not 0.75 * requested <= kernel <= 1.25 * requested:
        problems.append(f"the sleep asked for {requested:.3f} s ran {kernel:.3f} s by CUDA events")
    if not 0.8 * kernel <= host <= kernel + 2.0:
        problems.append(f"the host waited {host:.3f} s for a kernel of {kernel:.3f} s by CUDA events")
    if problems:
        return Result("queue-serialization", "FAIL", f"{gpu}: the probe's timing is not real: "
                                                     f"{'; '.join(problems)} ({clock})")
    serialized = figures["b_s"] >= 0.9 * kernel
    timing = (f"sleep kernel asked for {requested:.3f} s ({clock}), ran {kernel:.3f} s by CUDA events "
              f"(host waited {host:.3f} s)")
    if serialized:
        return Result("queue-serialization", "PASS", f"{gpu}: {timing}; with CUDA_DEVICE_MAX_CONNECTIONS=1 a kernel "
                                                     f"on stream B ended {figures['b_s']:.3f} s after it began, "
                                                     "behind another stream's wait on it: one hardware queue, as "
                                                     "the rounds protocol assumes")
    return Result("queue-serialization", "PASS", f"{gpu}: {timing}; with CUDA_DEVICE_MAX_CONNECTIONS=1 a kernel on "
                                                 f"stream B ended {figures['b_s']:.3f} s after it began: this "
                                                 "GPU/driver did not serialize here (the protocol does not rely on "
                                                 "it either way)")


def step_queue_serialization(ctx) -> Result:
    import torch

    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1")
    gpu = f"GPU {torch.cuda.current_device()}"
    try:
        out = subprocess.run([sys.executable, "-c", _SERIALIZATION_PROBE, str(torch.cuda.current_device()),
                              str(SLEEP_REQUESTED_S)], env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return Result("queue-serialization", "FAIL", "the probe hung for 120 s")
    if out.returncode != 0:
        return Result("queue-serialization", "FAIL", f"probe failed: {out.stderr.strip()[-300:]}")
    try:
        figures = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return Result("queue-serialization", "FAIL", f"probe printed no figures: {out.stdout.strip()[-300:]}")
    return judge_serialization_probe(figures, gpu)


def step_loopback(ctx) -> Result:
    import torch

    from ..policy.topology import Topology

    cases = [(1, "bf", 32), (1, "bfw", 2), (1, "1f1b", 32), (2, "bf", 4)]
    for i, (chunks, hint, limit) in enumerate(cases):
        microbatches = 8
        finals: dict = {}

        def factory(topology, stage, rng, finals=finals):
            return TokenWork(topology, stage, finals if stage == 0 else {}, rng, max_sleep_cycles=2_000_000)

        errors, _ = loopback_pipeline(chunks=chunks, hint=hint, buffer_limit=limit, microbatches=microbatches,
                                       iterations=3, work_factory=factory, seed=ctx["seed"] + i,
                                       timeout_s=ctx["stall_timeout_s"])
        torch.cuda.synchronize()
        problem = "; ".join(errors) or check_finals(finals, Topology(2, chunks), microbatches)
        if problem:
            return Result("loopback", "FAIL", f"chunks={chunks} hint={hint} limit={limit}: {problem}")
    return Result("loopback", "PASS", f"{len(cases)} layouts x 3 iterations, random kernel times, values exact "
                                      "(rounds as CUDA copies: not NCCL's blocking; see nccl-stress)")


def step_stage_memory(ctx) -> Result:
    import torch

    peaks = {}
    for label, hint, limit in (("1f1b", "1f1b", 32), ("rrfp bf, limit=PP", "bf", 2), ("rrfp default", "bf", 32)):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()

        def factory(topology, stage, rng):
            return MLPWork(topology, stage, rng, hidden=1024, layers=4)

        errors, _ = loopback_pipeline(chunks=1, hint=hint, buffer_limit=limit, microbatches=8, iterations=2,
                                       work_factory=factory, seed=ctx["seed"], timeout_s=ctx["stall_timeout_s"])
        torch.cuda.synchronize()
        if errors:
            return Result("stage-memory", "FAIL", f"{label}: {'; '.join(errors)}")
        peaks[label] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    figures = ", ".join(f"{k} {v:.1f} MiB" for k, v in peaks.items())
    ok = peaks["rrfp bf, limit=PP"] <= 1.10 * peaks["1f1b"] + 1.0
    verdict = "within 10% of 1F1B at the same in-flight bound" if ok else "ABOVE 1F1B at the same in-flight bound"
    return Result("stage-memory", "PASS" if ok else "FAIL", f"peak of both stages on one GPU: {figures}: {verdict}")


def step_one_context(ctx) -> Result:
    import torch

    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Result("one-context", "SKIP", f"nvidia-smi unavailable: {exc}")
    mine = {line.split(",")[1].strip() for line in out.stdout.splitlines()
            if line.split(",")[0].strip() == str(os.getpid())}
    if not mine:
        return Result("one-context", "SKIP", "nvidia-smi does not list this process (a PID namespace?)")
    own = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    if len(mine) == 1 and (own in next(iter(mine)) or next(iter(mine)).endswith(own[-12:])):
        return Result("one-context", "PASS", f"one CUDA context, on GPU {torch.cuda.current_device()}")
    return Result("one-context", "FAIL", f"this process has contexts on {sorted(mine)} (own GPU {own}): a thread "
                                         "touched CUDA without torch.cuda.set_device")


# --------------------------------------------------------------------------- multi-GPU steps

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


def step_megatron_equivalence(ctx) -> Result:
    from .selfcheck_gpt import compare_with_megatron_on_gpu

    return Result("megatron-equivalence", *compare_with_megatron_on_gpu(ctx, pp=ctx["world"]))


def step_equivalence_tp2_pp2(ctx) -> Result:
    from .selfcheck_gpt import compare_with_megatron_on_gpu

    return Result("equivalence-tp2-pp2", *compare_with_megatron_on_gpu(ctx, tp=2, pp=2))


def step_equivalence_pp4_chunks2_dp2(ctx) -> Result:
    from .selfcheck_gpt import compare_with_megatron_on_gpu

    return Result("equivalence-pp4-chunks2-dp2", *compare_with_megatron_on_gpu(ctx, pp=4, chunks=2))


# Issue 29: Megatron-LM's production flags, each against Megatron's own schedule on the same GPUs
# (DP = the rest of the world: 2 at 4 GPUs, 4 at 8). Cost: ~3 iterations x 8 micro-batches of a
# 2-4 layer model plus one NCCL layout each; like the equivalence steps above, seconds apiece.
PRODUCTION_STEPS = {
    "production-sp-tp2-pp2": dict(tp=2, pp=2, sequence_parallel=True),  # W re-gathers its input over TP
    # --overlap-grad-reduce --overlap-param-gather --use-distributed-optimizer, interleaved (mcore/dp_overlap.py):
    # the default, DP communication out of the task loop; and in it, under the whole-stage agreement
    "production-dp-overlap-pp2-chunks2": dict(pp=2, chunks=2, overlap=True),
    "production-dp-lockstep-pp2-chunks2": dict(pp=2, chunks=2, overlap=True, dp_overlap="lockstep"),
    "production-moe-ep2-pp2": dict(pp=2, ep=2),  # alltoall dispatcher, EP over DP replicas
    "production-bf16-dp-overlap-pp2-chunks2": dict(pp=2, chunks=2, overlap=True, bf16=True),
}


def _production_step(name: str):
    def step(ctx) -> Result:
        from .selfcheck_gpt import compare_with_megatron_on_gpu

        return Result(name, *compare_with_megatron_on_gpu(ctx, **PRODUCTION_STEPS[name]))

    return step


STEP_FUNCTIONS: dict[str, Callable] = {
    "environment": step_environment, "queue-serialization": step_queue_serialization, "loopback": step_loopback,
    "stage-memory": step_stage_memory, "one-context": step_one_context, "nccl-stress": step_nccl_stress,
    "megatron-equivalence": step_megatron_equivalence, "equivalence-tp2-pp2": step_equivalence_tp2_pp2,
    "equivalence-pp4-chunks2-dp2": step_equivalence_pp4_chunks2_dp2, **TE_STEPS,
    **{name: _production_step(name) for name in PRODUCTION_STEPS},
}


# --------------------------------------------------------------------------- runner

def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of: {', '.join(STEPS)}")
    parser.add_argument("--step-timeout", type=float, default=600.0, help="seconds before a step counts as hung")
    parser.add_argument("--stall-timeout", type=float, default=60.0, help="RRFP's own stall timeout in the steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write the results (rank 0)")
    args = parser.parse_args(argv)
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
    if world > 1:  # the rendezvous store carries every rank's failures and results (selfcheck_runner)
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


def report(outcome: Outcome, *, rank: int, world: int, json_path) -> None:
    """Rank 0: the verdict line (naming each failed step and rank) and the JSON."""
    if rank != 0:
        return
    failed = outcome.failed
    print(f"gpu_selfcheck: {'FAIL' if failed else 'PASS'}"
          + (f" ({', '.join(f'{s} on rank {r}' for r, s in failed)})" if failed else ""), flush=True)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as handle:
            json.dump({"world": world, "ranks": outcome.gathered, "failed": bool(failed)}, handle, indent=1)


__all__ = ["STEPS", "Result", "main", "report"]
