"""A fault drill around ``python -m megatron_rrfp.launch``: one rank fails inside a forward step.

    torchrun ... -m helpers.inprocess_drill [--cpu] SCRIPT args...     (tests/ on PYTHONPATH)

Configured by the environment (the script's command line stays Megatron-LM's):
``RRFP_DRILL_RANK`` (global rank that fails), ``RRFP_DRILL_ITERATION`` (the 1-based iteration Megatron
logs; several comma-separated: one fault at each), ``RRFP_DRILL_MICROBATCH`` (the forward call within that
iteration, default 1: mid-iteration), ``RRFP_DRILL_KIND``: ``raise`` (a RuntimeError from the forward
step), ``exit`` (the process exits at once, ``os._exit(3)``) or ``hang`` (the forward step never returns;
Python keeps running, so an asynchronous exception can still end it). Each fault fires once per process:
after an in-process restart the same iteration runs through. ``RRFP_DRILL_ONCE_FILE``: a file that records
the iterations already faulted, so a fault also fires once per job across new processes (torchrun's
restarts, a relaunch). Each firing is printed as ``rrfp-drill: fault ...``.
``RRFP_DRILL_DUMP_S``: every rank dumps all its threads' stacks that many seconds into the fault's
iteration (where a restart spends its time).

The fault sits in megatron-core's ``schedules.forward_step``, which Megatron's own schedules and
rrfp's executor both look up at call time, so the drill is the same for ``--pipeline-schedule
1f1b`` and ``rrfp``. Test code: it wraps the shipped launcher from outside.
"""
from __future__ import annotations

import os
import sys
import threading
import time

_fired: set = set()  # the iterations this process already faulted
_world: dict = {"state": None, "threads": set()}  # the schedule state and rrfp threads seen in this world


def _watch_world(rank: int) -> None:
    """At every forward: remember this world's ScheduleState and rrfp threads; at the first forward
    under a new ScheduleState (an in-process restart re-created the world), print what of the old
    world is still there: ``rrfp-drill: rank R new world: ...`` (a test reads it)."""
    from megatron_rrfp.mcore.state import ScheduleState

    state = ScheduleState._current
    threads = {t for t in threading.enumerate() if t.name.startswith("rrfp-")}
    old = _world["state"]
    if old is not None and state is not old:
        alive = sorted(t.name for t in _world["threads"] if t.is_alive())
        olds = [*old.auto_limits.values(), *old.byte_budgets.values()]  # calibrations of the failed world
        carried = sum(any(v is o for o in olds) for v in [*state.auto_limits.values(), *state.byte_budgets.values()])
        print(f"rrfp-drill: rank {rank} new world: old session open {old.session is not None} | "
              f"calibrations carried {carried} | old rrfp threads alive {alive}", flush=True)
        _world["threads"] = set()
    _world["state"] = state
    _world["threads"] |= threads


def _iteration() -> int:
    from megatron.training import get_args

    return int(get_args().curr_iteration) + 1


def _fault_iterations() -> set:
    return {int(i) for i in os.environ["RRFP_DRILL_ITERATION"].split(",") if i.strip()}


def _due(iteration: int) -> bool:
    """A fault at ``iteration`` that neither this process nor (with RRFP_DRILL_ONCE_FILE) the job fired."""
    if iteration not in _fault_iterations() or iteration in _fired:
        return False
    once = os.environ.get("RRFP_DRILL_ONCE_FILE")
    if once and os.path.exists(once):
        with open(once) as f:
            if str(iteration) in f.read().split():
                return False
    return True


def _record(iteration: int) -> None:
    _fired.add(iteration)
    once = os.environ.get("RRFP_DRILL_ONCE_FILE")
    if once:
        with open(once, "a") as f:
            f.write(f"{iteration}\n")
            f.flush()
            os.fsync(f.fileno())


def _faulty(forward_step_func, rank: int, kind: str, microbatch: int, calls: dict):
    def forward_step_func_with_fault(*args, **kwargs):
        iteration = _iteration()
        calls[iteration] = calls.get(iteration, 0) + 1
        if calls[iteration] == microbatch and _due(iteration):
            _record(iteration)
            print(f"rrfp-drill: fault {kind} on rank {rank} at iteration {iteration}, forward {microbatch}",
                  flush=True)
            if kind == "exit":
                os._exit(3)
            if kind == "hang":
                while True:
                    time.sleep(0.05)
            raise RuntimeError(f"rrfp-drill: injected fault on rank {rank} at iteration {iteration}")
        return forward_step_func(*args, **kwargs)

    return forward_step_func_with_fault


def install_drill() -> None:
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import schedules

    kind = os.environ.get("RRFP_DRILL_KIND", "raise")
    if kind not in ("raise", "exit", "hang"):
        raise SystemExit(f"RRFP_DRILL_KIND must be raise, exit or hang, got {kind!r}")
    microbatch = int(os.environ.get("RRFP_DRILL_MICROBATCH", "1"))
    original = schedules.forward_step
    calls: dict = {}

    def forward_step(forward_step_func, *args, **kwargs):
        rank = dist.get_rank()
        _watch_world(rank)
        if os.environ.get("RRFP_DRILL_DUMP_S") and not calls.get("armed") and _iteration() in _fault_iterations():
            # every rank's stacks that long into the fault's iteration
            import faulthandler

            calls["armed"] = True
            faulthandler.dump_traceback_later(float(os.environ["RRFP_DRILL_DUMP_S"]), repeat=False)
        if rank == int(os.environ["RRFP_DRILL_RANK"]):
            forward_step_func = _faulty(forward_step_func, rank, kind, microbatch, calls)
        return original(forward_step_func, *args, **kwargs)

    schedules.forward_step = forward_step


def main(argv: list[str]) -> None:
    from megatron_rrfp.launch.megatron_lm import build_parser
    from megatron_rrfp.launch.megatron_lm import main as launch

    opts = build_parser().parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(opts.script)))  # the tree's megatron, as launch does
    if opts.cpu:
        from megatron_rrfp.cpu import enable_cpu_training
        from megatron_rrfp.launch.env import hide_cuda

        hide_cuda()
        enable_cpu_training()
    install_drill()
    launch(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
