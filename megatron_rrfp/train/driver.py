"""``megatron-rrfp train``: a small GPT / multimodal pretraining driver on megatron-core that
any pipeline schedule can drive (megatron-core's own 1F1B, or the readiness-first one).

Laptop / CI (CPU, gloo; two local ranks, one pipeline stage each)::

    megatron-rrfp train --cpu --nproc 2 --pipeline-model-parallel-size 2 \\
        --pipeline-schedule rrfp --train-iters 20 --log-interval 1

GPUs (one rank per GPU; the same flags under torchrun or srun)::

    torchrun --nproc-per-node 8 -m megatron_rrfp.train --pipeline-model-parallel-size 4 \\
        --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \\
        --vocab-size 50304 --micro-batch-size 1 --global-batch-size 64 --train-iters 1000 \\
        --pipeline-schedule rrfp --rrfp-trace-dir traces/ --save ckpt/ --save-interval 200 --load ckpt/

One iteration is Megatron-LM's train_step: zero the DDP grad buffers, run the schedule
over ``global / (micro x DP)`` micro-batches, one optimizer step, one LR-scheduler step.
The flags are ``TrainConfig``'s (``config.py``); the pieces are built by ``builders.py``;
data and checkpoints live in ``data.py`` / ``checkpoint.py``.

Goodput and failures. ``--rrfp-goodput-ledger PATH`` records job start and end, every
iteration (tokens, each rank's RRFP time breakdown, data wait), checkpoint saves and
loads, restarts and the error that stopped a run (goodput/recorder.py; rank
0 writes, off the training thread; a ledger that cannot be written only warns). Resume
with the same ledger path so one report covers the whole job::

    megatron-rrfp train ... --save ckpt/ --save-interval 100 --rrfp-goodput-ledger run/goodput.db
    megatron-rrfp train ... --save ckpt/ --save-interval 100 --load ckpt/ --rrfp-goodput-ledger run/goodput.db
    megatron-rrfp goodput run/goodput.db --json goodput.json     # wasted progress, recovery, ...

A rank without progress for ``--rrfp-timeout`` seconds, or whose pipeline peer died,
raises PipelineStallError with its state (peer, ready set, counters); ``--nproc`` then
stops the remaining ranks within 10 s and exits non-zero (128 + signal for a killed rank).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from ..dist import env as distenv
from ..dist.launcher import spawn_local
from .config import TrainConfig, add_arguments, check_layout, from_args, to_argv

_STARTED_WALL = time.time()  # ~ this process's start: the ledger counts startup from here


@dataclass(kw_only=True, slots=True)
class Run:
    """Everything built for one training run on this rank."""

    model: Any
    optimizer: Any
    scheduler: Any
    forward_backward: Any
    forward_step: Any
    data: Any
    num_microbatches: int
    layout: dict
    logs: bool
    """This rank prints the training log: last pipeline stage, first TP and DP rank."""
    meter: Any = None
    """runtime.memory.ActivationMeter around Megatron's own schedule (rrfp measures itself)."""
    megatron_in_flight: int = 0
    """Peak forwards in flight of Megatron's own (fixed) order on this stage."""
    iteration: int = 0
    consumed_samples: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Step:
    """What one iteration returns."""

    loss: Optional[float]
    """Token-weighted lm loss on the logging ranks, else None."""
    grad_norm: Optional[float]
    lr: float
    data_wait_s: float
    memory: tuple[int, int] = (0, 0)
    """This rank's peak activation bytes and peak forwards in flight in the schedule call."""
    """Seconds this rank's forward steps spent waiting in next(data_iterator)."""


class TimedIterator:
    """The micro-batch iterator, timing every ``next()`` (``seconds``: the data wait)."""

    __slots__ = ("_iterator", "seconds")

    def __init__(self, iterator) -> None:
        self._iterator, self.seconds = iterator, 0.0

    def __iter__(self):
        return self

    def __next__(self):
        start = time.perf_counter()
        try:
            return next(self._iterator)
        finally:
            self.seconds += time.perf_counter() - start


# --------------------------------------------------------------------------- parse


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``train`` on ``megatron-rrfp``'s subcommands."""
    parser = subparsers.add_parser("train", help="pretrain a GPT / multimodal model with any pipeline schedule",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run_from_args)
    return parser


def run_from_args(args: argparse.Namespace) -> int:
    config = from_args(args)
    if config.nproc:
        check_layout(config, config.nproc)  # fail before starting anything
        env = {"CUDA_VISIBLE_DEVICES": ""} if config.cpu else {}
        if config.cpu and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // config.nproc))
        return spawn_local(config.nproc, [sys.executable, "-m", "megatron_rrfp.train", *to_argv(config)], env=env)
    return train(config)


# --------------------------------------------------------------------------- build


def setup(cfg: TrainConfig):
    """Process group, megatron parallel state, seeds; returns (device, dp_size)."""
    if cfg.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything initialises CUDA
    env = distenv.detect()
    dp = check_layout(cfg, env.world_size)
    import random

    import numpy as np
    import torch
    from megatron.core import parallel_state

    device = distenv.init_process_group(env, cpu=cfg.cpu, timeout_s=60 * cfg.distributed_timeout_minutes)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=cfg.tensor_model_parallel_size,
                                             pipeline_model_parallel_size=cfg.pipeline_model_parallel_size)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if cfg.cpu:
        from ..mcore.cpu import enable_cpu_reference_schedules

        enable_cpu_reference_schedules()
    else:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
    return device, dp


def build(cfg: TrainConfig, device, dp: int) -> Run:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from . import builders

    model = builders.build_model(cfg, device)
    optimizer, scheduler = builders.build_optimizer(cfg, model)
    layout = {"world_size": dist.get_world_size(), **{k: getattr(cfg, k) for k in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "model", "num_layers", "hidden_size",
        "num_attention_heads", "vocab_size", "seq_length")}}
    num_microbatches = cfg.global_batch_size // (cfg.micro_batch_size * dp)
    meter = in_flight = None
    if cfg.pipeline_schedule != "rrfp":  # measure Megatron's schedule from outside, like bench does
        from ..policy.actions import peak_in_flight
        from ..policy.hints import megatron_1f1b_order
        from ..policy.topology import Topology
        from ..runtime.memory import ActivationMeter, model_tensors

        meter = ActivationMeter(device, persistent=model_tensors([model]))
        in_flight = peak_in_flight(megatron_1f1b_order(
            ps.get_pipeline_model_parallel_rank(), Topology(ps.get_pipeline_model_parallel_world_size()),
            num_microbatches))
    return Run(model=model, optimizer=optimizer, scheduler=scheduler, forward_backward=builders.build_schedule(cfg),
               forward_step=builders.forward_step_func(cfg),
               data=builders.build_data(cfg, dp_rank=ps.get_data_parallel_rank(), dp_size=dp, device=device),
               num_microbatches=num_microbatches, layout=layout,
               logs=ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
               and ps.get_data_parallel_rank() == 0, meter=meter, megatron_in_flight=in_flight or 0)


def maybe_resume(cfg: TrainConfig, run: Run, recorder) -> None:
    from . import checkpoint

    if cfg.load is None:
        return
    if cfg.load_iteration is None and checkpoint.latest_iteration(cfg.load) is None:
        _rank0_print(f"no checkpoint in {cfg.load}: starting from scratch")
        return
    with recorder.checkpoint_load():
        resumed = checkpoint.load(cfg.load, iteration=cfg.load_iteration, model=run.model, optimizer=run.optimizer,
                                  scheduler=run.scheduler, layout=run.layout)
    recorder.restart(resumed.iteration)  # completed iterations after this one were lost
    run.iteration, run.consumed_samples = resumed.iteration, resumed.consumed_samples
    _rank0_print(f"resumed from {cfg.load} at iteration {run.iteration} ({run.consumed_samples} samples consumed)")


# --------------------------------------------------------------------------- run


def train_step(cfg: TrainConfig, run: Run) -> Step:
    """One iteration (Megatron-LM's train_step)."""
    lr = run.optimizer.param_groups[0]["lr"]  # set by the scheduler for this iteration
    run.model.zero_grad_buffer()
    run.optimizer.zero_grad()
    data = TimedIterator(run.data.microbatches(run.consumed_samples, run.num_microbatches))
    with run.meter or contextlib.nullcontext():
        losses = run.forward_backward(
            forward_step_func=run.forward_step, data_iterator=data,
            model=[run.model], num_microbatches=run.num_microbatches, seq_length=cfg.seq_length,
            micro_batch_size=cfg.micro_batch_size, forward_only=False)
    if run.meter is not None:
        memory = (run.meter.peak_bytes, run.megatron_in_flight)
    else:
        from ..mcore.schedule import last_iteration_report

        report = last_iteration_report()
        memory = (report.peak_activation_bytes, report.peak_in_flight) if report is not None else (0, 0)
    _, grad_norm, _ = run.optimizer.step()
    run.scheduler.step(increment=1)
    run.iteration += 1
    run.consumed_samples += cfg.global_batch_size
    return Step(loss=_mean_loss(losses), grad_norm=grad_norm, lr=lr, data_wait_s=data.seconds, memory=memory)


def _mean_loss(losses: list) -> Optional[float]:
    """Token-weighted mean loss over micro-batches and DP ranks (last stage; else None).
    Each loss dict holds [summed loss, token count] per micro-batch."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not parallel_state.is_pipeline_last_stage():
        return None
    total = torch.stack([next(iter(d.values())).float() for d in losses]).sum(dim=0)
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return (total[0] / total[1]).item()  # CPU-GPU sync point


def train(cfg: TrainConfig) -> int:
    import torch.distributed as dist

    from . import builders

    device, dp = setup(cfg)
    recorder = builders.build_recorder(cfg, dp, since_wall=_STARTED_WALL)  # collective with a ledger
    finished = False
    try:
        run = build(cfg, device, dp)
        maybe_resume(cfg, run, recorder)
        _rank0_print(f"training {cfg.model}: {cfg.num_layers} layers x {cfg.hidden_size} wide, "
                     f"TP {cfg.tensor_model_parallel_size}"
                     f" x PP {cfg.pipeline_model_parallel_size} x DP {dp}, {run.num_microbatches} micro-batches of "
                     f"{cfg.micro_batch_size} x {cfg.seq_length} tokens per iteration, schedule {cfg.pipeline_schedule}"
                     f", {'cpu/gloo' if cfg.cpu else 'cuda/nccl'}")
        loop(cfg, run, recorder)
        write_trace(cfg)
        recorder.job_end()  # flushes for at most close_timeout_s (5 s)
        _ledger_note(cfg, recorder)
        finished = True
    except BaseException as exc:
        recorder.disruption(type(exc).__name__, str(exc), rank=dist.get_rank())  # flushed (<= 2 s)
        raise
    finally:
        recorder.close()
        close(cfg, finished=finished)
    return 0


def loop(cfg: TrainConfig, run: Run, recorder) -> None:
    import torch

    from . import checkpoint

    report = _iteration_report_func(cfg)
    window: list[tuple[Optional[float], float]] = []  # (loss, seconds) since the last log line
    window_memory = [0, 0]  # this rank's peak activation bytes and forwards in flight since then
    while run.iteration < cfg.train_iters:
        number = run.iteration + 1
        recorder.iteration_start(number)
        start = time.perf_counter()
        step = train_step(cfg, run)
        if torch.cuda.is_available() and not cfg.cpu:
            torch.cuda.synchronize()  # CPU-GPU sync point: the time includes the device work
        window.append((step.loss, time.perf_counter() - start))
        # Collective with a ledger and world > 1: every rank gets here once per iteration.
        recorder.iteration(number, tokens=cfg.global_batch_size * cfg.seq_length,  # whole job, not per rank
                           report=report(), data_wait_s=step.data_wait_s, memory=step.memory)
        window_memory = [max(a, b) for a, b in zip(window_memory, step.memory)]
        if run.iteration % cfg.log_interval == 0 or run.iteration == cfg.train_iters:
            memory = _max_over_ranks(window_memory)  # collective: every rank logs at the same iterations
            if run.logs:
                print(_log_line(cfg, run, window, step.grad_norm, step.lr, memory), flush=True)
            window, window_memory = [], [0, 0]
        at_end = run.iteration == cfg.train_iters
        if cfg.save and (at_end or (cfg.save_interval and run.iteration % cfg.save_interval == 0)):
            with recorder.checkpoint_save(run.iteration):  # "ok" only if the save did not raise
                path = checkpoint.save(cfg.save, iteration=run.iteration, consumed_samples=run.consumed_samples,
                                       model=run.model, optimizer=run.optimizer, scheduler=run.scheduler,
                                       layout=run.layout)
            _rank0_print(f"saved checkpoint at iteration {run.iteration} to {path}")


def _iteration_report_func(cfg: TrainConfig):
    """``last_iteration_report`` for rrfp (this rank's compute / bubble / flush seconds);
    Megatron's own schedules report nothing (the ledger then cannot split bubbles out)."""
    if cfg.pipeline_schedule != "rrfp":
        return lambda: None
    from ..mcore.schedule import last_iteration_report

    return last_iteration_report


def _ledger_note(cfg: TrainConfig, recorder) -> None:
    """One line on the writing rank: where the report is, or that the ledger was lost."""
    writer = recorder.writer
    if writer is None:
        return
    path = cfg.rrfp_goodput_ledger
    if writer.healthy and writer.dropped == 0:
        print(f"goodput ledger: {path}  (report: megatron-rrfp goodput {path})", flush=True)
    else:
        print(f"goodput ledger {path}: {'not written' if not writer.healthy else f'{writer.dropped} events lost'} "
              "(see the LedgerWarning above); training was not affected", flush=True)


def _max_over_ranks(values: list) -> list:
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def _log_line(cfg: TrainConfig, run: Run, window: list, grad_norm: Optional[float], lr: float,
              memory: Sequence[float] = (0, 0)) -> str:
    seconds = sum(s for _, s in window) / len(window)
    loss = sum(loss for loss, _ in window) / len(window)
    tokens_per_s = cfg.global_batch_size * cfg.seq_length / seconds  # all DP replicas together
    norm = f"{grad_norm:.4f}" if grad_norm is not None else "n/a"
    return (f"iteration {run.iteration:>6}/{cfg.train_iters} | schedule {cfg.pipeline_schedule} | "
            f"lm loss {loss:.6E} | grad norm {norm} | lr {lr:.3E} | "
            f"iteration time {1e3 * seconds:.1f} ms | tokens/s {tokens_per_s:.1f} | "
            f"peak activations {memory[0] / 1e6:.2f} MB | in flight {memory[1]:.0f}")


def write_trace(cfg: TrainConfig) -> None:
    """Each rank's measured task spans of the last iteration, one Chrome trace per rank
    plus all ranks in one file (pid = rank; times from each rank's own iteration start)."""
    if not cfg.rrfp_trace_dir:
        return
    import torch.distributed as dist

    from ..mcore.schedule import last_iteration_report
    from ..trace.chrome import write_chrome_trace

    report = last_iteration_report()
    spans = report.spans if report is not None else []
    rank = dist.get_rank()
    meta = {"schedule": "rrfp", "hint": cfg.rrfp_hint, "iteration": cfg.train_iters,
            "buffer_limit": cfg.rrfp_buffer_limit}
    if report is not None:
        meta.update(peak_activation_bytes=report.peak_activation_bytes, peak_in_flight=report.peak_in_flight,
                    activation_measure=report.activation_measure, resolved_buffer_limit=report.buffer_limit)
    write_chrome_trace(spans, os.path.join(cfg.rrfp_trace_dir, f"rank{rank:05d}.json"), metadata=meta)
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(spans, gathered, dst=0)
    if rank == 0:
        path = write_chrome_trace([s for part in gathered for s in part],
                                  os.path.join(cfg.rrfp_trace_dir, "trace.json"), metadata=meta)
        print(f"trace of the last iteration: {path}", flush=True)


# --------------------------------------------------------------------------- close


def close(cfg: TrainConfig, *, finished: bool) -> None:
    """After a failure only the transport threads are stopped: a peer may be wedged, and
    the launcher (torchrun, srun --kill-on-bad-exit, --nproc) ends the others."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if cfg.pipeline_schedule == "rrfp":
        from ..mcore.session import shutdown

        shutdown()  # transport threads, before their process groups go away
    if finished and dist.is_initialized():
        dist.barrier()  # nobody closes sockets a peer still reads from
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _rank0_print(message: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(message, flush=True)


def build_parser() -> argparse.ArgumentParser:
    from ..checks import OneLineParser

    parser = OneLineParser(prog="python -m megatron_rrfp.train", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run_from_args(args)
    except (ValueError, OSError) as exc:  # user errors: one clear line, no traceback
        from ..checks import report_error

        return report_error("megatron-rrfp train", exc)


if __name__ == "__main__":
    sys.exit(main())
