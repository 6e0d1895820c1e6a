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
raises PipelineStallError with its state (peer, ready set, counters). ``--nproc`` starts the
ranks (``--cpu``: forked after one import, launch/forked.py; GPUs: torch's own launcher,
torch.distributed.run, standalone rendezvous); either stops the other ranks with SIGTERM
when one fails; a stopped rank first finishes reporting
its own failure (signals.py) and the command exits non-zero (128 + signal for a killed rank).
On GPUs a failed iteration is not recovered in-process (NCCL communicators with a dead peer
are unusable; RRFP aborts its own): run under ``torchrun --max-restarts N`` with ``--load``,
as scripts/slurm does, so the job restarts from its last checkpoint.

Logs, TensorBoard, W&B and timers as Megatron-LM writes them: metrics.py. Preemption:
``--exit-signal-handler --exit-signal SIGUSR1`` saves and exits 0 on SIGUSR1 (signals.py).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from ..launch import env as launch_env
from ..ranks import max_over_ranks, print_line
from .config import TrainConfig, add_arguments, check_layout, from_args
from .signals import JobTerminated, Signals

_STARTED_WALL = time.time()  # ~ this process's start: the ledger counts startup from here


@dataclass(kw_only=True, slots=True)
class Run:
    """Everything built for one training run on this rank."""

    model: list
    """This rank's model chunks (megatron DDP each): one, or --virtual-pipeline-model-parallel-size."""
    optimizer: Any
    scheduler: Any
    forward_backward: Any
    forward_step: Any
    data: Any
    num_microbatches: int
    layout: dict
    timers: Any
    """megatron-core Timers at --timing-log-level (also config.timers of the model)."""
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
    """Seconds this rank's forward steps spent waiting in next(data_iterator)."""
    memory: tuple[int, int] = (0, 0)
    """This rank's peak activation bytes and peak forwards in flight in the schedule call."""


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
    parser.set_defaults(func=run_and_report)
    return parser


def run_from_args(args: argparse.Namespace) -> int:
    config = from_args(args)
    if config.nproc:
        from .local_ranks import start_local_ranks

        return start_local_ranks(config)
    return train(config)


# --------------------------------------------------------------------------- build


def setup(cfg: TrainConfig):
    """Process group, megatron parallel state, seeds; returns (device, dp_size)."""
    if cfg.cpu:
        launch_env.hide_cuda()  # a rank torchrun / srun started: before anything counts CUDA devices
    if "TORCHELASTIC_RUN_ID" in os.environ:
        launch_env.die_with_parent()  # a rank of torch's launcher: no orphan if the agent dies (forked ranks set it)
    env = launch_env.detect()
    dp = check_layout(cfg, env.world_size)
    from ..quiet import announce

    announce()  # rank 0 of a job started per rank (srun): the one line for megatron-core's notes
    import random

    import numpy as np
    import torch
    from megatron.core import parallel_state

    device = launch_env.init_process_group(env, cpu=cfg.cpu, timeout_s=60 * cfg.distributed_timeout_minutes)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=cfg.tensor_model_parallel_size,
                                             pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
                                             virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_model_parallel_size,
                                             distributed_timeout_minutes=cfg.distributed_timeout_minutes,
                                             expert_model_parallel_size=cfg.expert_model_parallel_size)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if cfg.cpu:
        from ..cpu import enable_cpu_reference_schedules

        enable_cpu_reference_schedules()
    else:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
    return device, dp


def checkpoint_layout(cfg: TrainConfig, world_size: int) -> dict:
    """What a checkpoint records of the run it came from; a resume needs the same (the
    hybrid pattern only for --model hybrid, so earlier GPT checkpoints still load)."""
    layout = {"world_size": world_size, **{k: getattr(cfg, k) for k in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "model", "num_layers", "hidden_size",
        "num_attention_heads", "vocab_size", "seq_length")}}
    if cfg.model == "hybrid":
        layout["hybrid_layer_pattern"] = cfg.hybrid_layer_pattern
    return layout


def build(cfg: TrainConfig, device, dp: int) -> Run:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.timers import Timers

    from . import builders

    timers = Timers(cfg.timing_log_level, "minmax")
    model = builders.build_model(cfg, device)
    model[0].config.timers = timers  # the schedules' forward-backward / -compute timers (config shared by chunks)
    optimizer, scheduler = builders.build_optimizer(cfg, model, timers)
    layout = checkpoint_layout(cfg, dist.get_world_size())
    num_microbatches = cfg.global_batch_size // (cfg.micro_batch_size * dp)
    meter = in_flight = None
    if cfg.pipeline_schedule != "rrfp":  # measure Megatron's schedule from outside, like bench does
        from ..policy.actions import peak_in_flight
        from ..policy.hints import megatron_1f1b_order
        from ..policy.topology import Topology
        from ..runtime.memory import ActivationMeter, model_tensors

        meter = ActivationMeter(device, persistent=model_tensors(model))
        in_flight = peak_in_flight(megatron_1f1b_order(
            ps.get_pipeline_model_parallel_rank(), Topology(ps.get_pipeline_model_parallel_world_size(), len(model)),
            num_microbatches))
    return Run(model=model, optimizer=optimizer, scheduler=scheduler, forward_backward=builders.build_schedule(cfg),
               forward_step=builders.forward_step_func(cfg),
               data=builders.build_data(cfg, dp_rank=ps.get_data_parallel_rank(), dp_size=dp, device=device),
               num_microbatches=num_microbatches, layout=layout, timers=timers, meter=meter,
               megatron_in_flight=in_flight or 0)


def maybe_resume(cfg: TrainConfig, run: Run, recorder) -> None:
    from . import checkpoint

    if cfg.load is None:
        return
    if cfg.load_iteration is None and checkpoint.latest_iteration(cfg.load) is None:
        _rank0_print(f"no checkpoint in {cfg.load}: starting from scratch")
        return
    iteration = cfg.load_iteration if cfg.load_iteration is not None else checkpoint.latest_iteration(cfg.load)
    with recorder.checkpoint_load():
        resumed = _checkpoint_format(cfg, iteration).load(
            cfg.load, iteration=cfg.load_iteration, model=run.model[0], optimizer=run.optimizer,
            scheduler=run.scheduler, layout=run.layout)
    recorder.restart(resumed.iteration)  # completed iterations after this one were lost
    run.iteration, run.consumed_samples = resumed.iteration, resumed.consumed_samples
    _rank0_print(f"resumed from {cfg.load} at iteration {run.iteration} ({run.consumed_samples} samples consumed)")


# --------------------------------------------------------------------------- run


def train_step(cfg: TrainConfig, run: Run) -> Step:
    """One iteration (Megatron-LM's train_step)."""
    lr = run.optimizer.param_groups[0]["lr"]  # set by the scheduler for this iteration
    for chunk in run.model:
        chunk.zero_grad_buffer()
    run.optimizer.zero_grad()
    # one iterator per chunk, as Megatron-LM builds them: each chunk's forwards read the micro-batches in order
    data = [TimedIterator(run.data.microbatches(run.consumed_samples, run.num_microbatches)) for _ in run.model]
    with run.meter or contextlib.nullcontext():
        losses = run.forward_backward(
            forward_step_func=run.forward_step, data_iterator=data if len(data) > 1 else data[0],
            model=run.model, num_microbatches=run.num_microbatches, seq_length=cfg.seq_length,
            micro_batch_size=cfg.micro_batch_size, forward_only=False)
    if run.meter is not None:
        memory = (run.meter.peak_bytes, run.megatron_in_flight)
    else:
        from ..mcore.schedule import last_iteration_report

        report = last_iteration_report()
        memory = (report.peak_activation_bytes, report.peak_in_flight) if report is not None else (0, 0)
    run.timers("optimizer", log_level=1).start()
    _, grad_norm, _ = run.optimizer.step()
    run.timers("optimizer").stop()
    run.scheduler.step(increment=1)
    run.iteration += 1
    run.consumed_samples += cfg.global_batch_size
    return Step(loss=_mean_loss(losses), grad_norm=grad_norm, lr=lr, data_wait_s=sum(d.seconds for d in data),
                memory=memory)


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
    from .metrics import TrainingMetrics

    device, dp = setup(cfg)
    signals = Signals(rank=dist.get_rank(), exit_signal=cfg.exit_signal if cfg.exit_signal_handler else None).install()
    recorder = builders.build_recorder(cfg, dp, since_wall=_STARTED_WALL)  # collective with a ledger
    finished, metrics = False, None
    try:
        run = build(cfg, device, dp)
        metrics = TrainingMetrics(cfg, rank=dist.get_rank(), world_size=dist.get_world_size(), timers=run.timers)
        maybe_resume(cfg, run, recorder)
        _rank0_print(f"training {cfg.model}: {cfg.num_layers} layers x {cfg.hidden_size} wide, "
                     f"TP {cfg.tensor_model_parallel_size}"
                     f" x PP {cfg.pipeline_model_parallel_size} x DP {dp}"
                     f"{f' ({len(run.model)} model chunks per rank)' if len(run.model) > 1 else ''}, "
                     f"{run.num_microbatches} micro-batches of "
                     f"{cfg.micro_batch_size} x {cfg.seq_length} tokens per iteration, schedule {cfg.pipeline_schedule}"
                     f", {'bf16' if cfg.bf16 else 'fp32'}, {'cpu/gloo' if cfg.cpu else 'cuda/nccl'}")
        loop(cfg, run, recorder, metrics, signals)
        recorder.job_end()  # flushes for at most close_timeout_s (5 s)
        _ledger_note(cfg, recorder)
        finished = True
    except BaseException as exc:
        terminated = signals.terminating  # before failing(): SIGTERM came first, so it is the cause
        signals.failing()  # a SIGTERM from the launcher now waits for this report
        kind, message = type(exc).__name__, str(exc)
        if terminated and not isinstance(exc, JobTerminated):  # e.g. a peer that ended its grace first
            kind, message = JobTerminated.__name__, f"stopped by SIGTERM; while stopping: {kind}: {message}"
        recorder.disruption(kind, message, rank=dist.get_rank())  # flushed (<= 2 s)
        raise
    finally:
        if metrics is not None:
            metrics.close()
        recorder.close()
        close(cfg, finished=finished)
        if finished:  # after a failure the handlers stay: a late SIGTERM must not cut the exit short
            signals.uninstall()
    return 0


def loop(cfg: TrainConfig, run: Run, recorder, metrics, signals: Signals) -> None:
    import torch

    from ..goodput.recorder import publish_to_timers
    from ..megatron_lm.training_loop import TraceWriter, trace_due
    from .metrics import LogField

    report = _iteration_report_func(cfg)
    traces = TraceWriter(cfg.rrfp_trace_dir, _rank()) if cfg.rrfp_trace_dir else None
    window_memory = [0, 0]  # this rank's peak activation bytes and forwards in flight since the last log line
    while run.iteration < cfg.train_iters:
        number = run.iteration + 1
        recorder.iteration_start(number)
        start = time.perf_counter()
        step = train_step(cfg, run)
        if torch.cuda.is_available() and not cfg.cpu:
            torch.cuda.synchronize()  # CPU-GPU sync point: the time includes the device work
        seconds = time.perf_counter() - start
        # Collective with a ledger and world > 1: every rank gets here once per iteration.
        recorder.iteration(number, tokens=cfg.global_batch_size * cfg.seq_length,  # whole job, not per rank
                           report=report(), data_wait_s=step.data_wait_s, memory=step.memory)
        publish_to_timers(run.timers, report(), log_level=0)
        # Collective at log intervals (timers, peak memory); the line on the last rank.
        window_memory = [max(a, b) for a, b in zip(window_memory, step.memory)]
        extra = ()
        if run.iteration % cfg.log_interval == 0 or run.iteration == cfg.train_iters:
            # collective: every rank logs at the same iterations
            peak, in_flight = max_over_ranks(window_memory)
            extra = (LogField("peak activations (MB)", f"{peak / 2**20:.2f}"),
                     LogField("forwards in flight", f"{in_flight:.0f}"))
            window_memory = [0, 0]
        line = metrics.iteration(iteration=run.iteration, consumed_samples=run.consumed_samples, seconds=seconds,
                                 loss=step.loss, lr=step.lr, grad_norm=step.grad_norm, extra=extra)
        if line is not None:
            print_line(line)
            if metrics.timers_report():
                print_line(metrics.timers_report())
        if traces is not None and trace_due(run.iteration, log_interval=cfg.log_interval,
                                            last_iteration=cfg.train_iters):
            written = traces.write(run.iteration, report(), metadata={"schedule": "rrfp", "hint": cfg.rrfp_hint,
                                                                           "buffer_limit": cfg.rrfp_buffer_limit})
            if written and run.iteration == cfg.train_iters:
                print_line(f"trace of the last iteration: {written}")
        at_end = run.iteration == cfg.train_iters
        signals.raise_if_expired()
        stop = signals.exit_requested() and not at_end  # collective with --exit-signal-handler
        if cfg.save and (at_end or stop or (cfg.save_interval and run.iteration % cfg.save_interval == 0)):
            with recorder.checkpoint_save(run.iteration), _params_synced(cfg, run.model):  # "ok" only if no raise
                path = _checkpoint_format(cfg, None, saving=True).save(
                    cfg.save, iteration=run.iteration, consumed_samples=run.consumed_samples, model=run.model[0],
                    optimizer=run.optimizer, scheduler=run.scheduler, layout=run.layout)
            _rank0_print(f"saved checkpoint at iteration {run.iteration} to {path}")
        if stop:
            _rank0_print(f"exiting after iteration {run.iteration} on {cfg.exit_signal} (--exit-signal-handler)")
            return


@contextlib.contextmanager
def _params_synced(cfg: TrainConfig, chunks: list):
    """With --overlap-param-gather the optimizer's new weights arrive in the next forwards;
    a save first all-gathers them (Megatron-LM's disable_forward_pre_hook), then re-arms the hooks."""
    if not (cfg.overlap_param_gather and cfg.use_distributed_optimizer):
        yield
        return
    for chunk in chunks:
        chunk.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        for chunk in chunks:
            chunk.enable_forward_pre_hook()


def _checkpoint_format(cfg: TrainConfig, iteration: Optional[int], *, saving: bool = False):
    """The module that saves (--ckpt-format) or loads (whatever ``iteration`` was saved in)."""
    from . import checkpoint, checkpoint_dist

    if saving:
        return checkpoint_dist if cfg.ckpt_format == "torch_dist" else checkpoint
    dist_format = iteration is not None and checkpoint_dist.is_dist_checkpoint(cfg.load, iteration)
    return checkpoint_dist if dist_format else checkpoint


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
        print_line(f"goodput ledger: {path}  (report: megatron-rrfp goodput {path})")
    else:
        state = "not written" if not writer.healthy else f"{writer.dropped} events lost"
        print_line(f"goodput ledger {path}: {state} (see the LedgerWarning above); training was not affected")


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


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _rank0_print(message: str) -> None:
    if _rank() == 0:
        print_line(message)


def build_parser() -> argparse.ArgumentParser:
    from ..checks import OneLineParser

    parser = OneLineParser(prog="python -m megatron_rrfp.train", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ..quiet import for_entry_point

    args = build_parser().parse_args(argv)
    with for_entry_point(announce=True):  # a rank of `train --nproc` inherits the filter, not the line
        return run_and_report(args)


def run_and_report(args: argparse.Namespace) -> int:
    """``run_from_args`` with the exits of a command: one line for a user error (2), and a
    failed rank's traceback then an immediate exit (1; 143 when stopped by SIGTERM)."""
    try:
        return run_from_args(args)
    except (ValueError, OSError) as exc:  # user errors: one clear line, no traceback
        from ..checks import report_error

        return report_error("megatron-rrfp train", exc)
    except JobTerminated as exc:  # recorded in the ledger already; exit as SIGTERM would
        print_line(f"megatron-rrfp train: {exc}", file=sys.stderr)
        _exit_now(128 + signal.SIGTERM)
    except Exception:  # noqa: BLE001 - a failed rank: recorded already (train()), reported here
        traceback.print_exc()
        _exit_now(1)


def _exit_now(code: int) -> None:
    """Leave a failed rank without interpreter teardown: a dead peer can wedge the destruction
    of process groups, and teardown restores SIGTERM's default action, so the launcher's
    SIGTERM would turn this rank's exit status into 'killed by SIGTERM'."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
