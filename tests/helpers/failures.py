"""Rank bodies for failure tests: bad options, a rank that stops responding, a rank that dies.

Each runs under ``megatron_rrfp.launch.function.launch`` on a PP=2 layout. The surviving rank writes what it saw
(exception type, message, seconds until it gave up) to ``report_path`` so the test can
read it even though the launch as a whole fails.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import replace

import torch

from megatron_rrfp.bench.around_schedules import HeldMessages, sleep_before_tasks
from megatron_rrfp.mcore.config import RRFPConfig
from megatron_rrfp.mcore.schedule import forward_backward_rrfp, get_forward_backward_func, last_iteration_report

from . import mlp


def _stage_and_data(**config_overrides):
    from megatron_rrfp.cpu import enable_cpu_reference_schedules
    from megatron_rrfp.train import models

    enable_cpu_reference_schedules()
    config = models.tiny_gpt_config(**config_overrides)
    model = mlp.build_mlp_stage(config, seed=3)
    data = mlp.synthetic_mlp_batches(seed=1, micro_batch_size=2, seq_length=8, hidden_size=32)
    return model, data, mlp.mlp_forward_step


def api_contract() -> dict:
    """get_forward_backward_func routing, config.timers, and bad options (each raises a
    ValueError naming the option before any communication)."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.timers import Timers

    model, data, step = _stage_and_data()
    routed = {"pp2": get_forward_backward_func() is forward_backward_rrfp,
              "pp1": get_forward_backward_func(pp_size=1) is schedules.forward_backward_no_pipelining}
    model.config.timers = Timers(log_level=2, log_option="minmax")
    forward_backward_rrfp(forward_step_func=step, data_iterator=data, model=model, num_microbatches=4,
                          seq_length=8, micro_batch_size=2)
    timers = {name: model.config.timers(name).elapsed(reset=False)
              for name in ("forward-backward", "forward-compute", "backward-compute")}
    model.config.timers = None
    messages = {}
    attempts = {
        "overlap_p2p_comm": dict(),
        "buffer_limit": dict(buffer_limit=0),
        "hint": dict(hint="zigzag"),
        "timeout": dict(timeout_s=-1),
    }
    for name, kwargs in attempts.items():
        model.config.overlap_p2p_comm = name == "overlap_p2p_comm"
        try:
            forward_backward_rrfp(forward_step_func=step, data_iterator=data, model=model, num_microbatches=4,
                                  seq_length=8, micro_batch_size=2, **kwargs)
            messages[name] = None
        except ValueError as exc:
            messages[name] = str(exc)
    model.config.overlap_p2p_comm = False
    return {"routed": routed, "timers": timers, "errors": messages}


def unresponsive_peer(report_path: str, mode: str, timeout_s: float = 3.0) -> str:
    """Rank 1 stops responding (mode 'hang': sleeps inside its 3rd task) or dies
    (mode 'kill': os._exit inside its 3rd task); rank 0 must raise within timeout_s."""
    import torch.distributed as dist

    model, data, step = _stage_and_data()
    rank = dist.get_rank()
    tasks_started = [0]

    def misbehave(task) -> float:
        tasks_started[0] += 1
        if rank == 1 and tasks_started[0] == 3:
            if mode == "kill":
                os._exit(17)
            time.sleep(timeout_s * 4)
            os._exit(0)  # a hung rank that never comes back
        return 0.0

    options = RRFPConfig(timeout_s=timeout_s, around_task=sleep_before_tasks(misbehave))
    start = time.monotonic()
    try:
        forward_backward_rrfp(forward_step_func=step, data_iterator=data, model=model, num_microbatches=6,
                              seq_length=8, micro_batch_size=2, rrfp_config=options)
        outcome = {"error": None}
    except Exception as exc:  # noqa: BLE001 - the test inspects whatever was raised
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    outcome["seconds"] = time.monotonic() - start
    with open(report_path, "w", encoding="utf-8") as handle:
        json.dump(outcome, handle)
    os._exit(0)  # the pipeline is broken: leave without tearing down process groups


def stress(patterns: int, late_rank: int, seed: int = 0, progress_path: str | None = None,
           timeout_s: float = 30.0) -> dict:
    """Many random delay patterns on a TPxPP layout; one TP rank gets every message late
    in every other pattern. Returns the count of completed iterations and mismatches
    against a no-delay run of the same model and data, and the patterns that stalled
    (``hangs``: no progress for ``timeout_s``; the runtime is rebuilt and the next pattern
    runs). Rank 0 appends "done total" to ``progress_path`` after every pattern."""
    import random

    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_rrfp.runtime.executor import PipelineStallError

    # one block per stage: the orders and the agreement are the point, not the model's size
    model, _, step = _stage_and_data(num_layers=parallel_state.get_pipeline_model_parallel_world_size())
    rank = dist.get_rank()

    def run(options):
        for p in model.parameters():
            p.grad = None
        data = mlp.synthetic_mlp_batches(seed=5, micro_batch_size=2, seq_length=8, hidden_size=32)
        losses = forward_backward_rrfp(forward_step_func=step, data_iterator=data, model=model, num_microbatches=6,
                                       seq_length=8, micro_batch_size=2, rrfp_config=options)
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        return losses, grads

    # BF with room for every microbatch: at 1x memory (the default) PP=2 leaves BF no room to
    # reorder, and the point here is agreement under many different orders
    options = RRFPConfig.of(timeout_s=timeout_s, hint="bf", buffer_limit=6)
    _, expected = run(options)
    mismatches, hangs, first_hang, orders, rounds = 0, 0, None, set(), 0
    late = [0.0]  # this pattern's message delay on this rank
    held = HeldMessages(lambda message: late[0])
    for pattern in range(patterns):
        rng = random.Random(seed * 7919 + pattern * 31 + rank)
        scale = rng.choice([0.0005, 0.002, 0.005])
        late[0] = 0.02 if rank == late_rank and pattern % 2 == 0 else 0.0
        delayed = replace(options, deliver_message=held,
                          around_task=sleep_before_tasks(lambda task, rng=rng, scale=scale: rng.expovariate(1 / scale)))
        try:
            _, grads = run(delayed)
        except PipelineStallError as exc:
            hangs += 1
            first_hang = first_hang or f"pattern {pattern}: {exc}"
        else:
            report = last_iteration_report()
            orders.add(report.order_string)
            rounds += report.agree_rounds
            if not torch.allclose(grads, expected, rtol=1e-5, atol=1e-7):
                mismatches += 1
        if progress_path and rank == 0:
            with open(progress_path, "a", encoding="utf-8") as handle:
                handle.write(f"{pattern + 1} {patterns}\n")
    return {"rank": rank, "patterns": patterns, "mismatches": mismatches, "hangs": hangs, "first_hang": first_hang,
            "distinct_orders": len(orders), "agree_rounds": rounds}
