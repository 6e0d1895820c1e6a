"""What ``megatron-rrfp train`` reports, the way Megatron-LM reports it.

Log line: Megatron-LM's ``training_log`` format, printed by the last rank every
``--log-interval`` iterations, so parsers and dashboards keyed on its labels read it::

     [2026-01-05 12:00:00.000000] iteration        5/      20 | consumed samples:           40 |
     elapsed time per iteration (ms): 152.3 | tokens per second: 3360.2 | learning rate: 9.045085E-04 |
     global batch size:     8 | lm loss: 4.156250E+00 | loss scale: 1.0 | grad norm: 0.812 |
     peak memory (MB): 412.50 | number of skipped iterations:   0 | number of nan iterations:   0 |

(one line). "tokens per second" and "peak memory (MB)" are ours (Megatron-LM logs TFLOP/s and
a separate memory report); further fields (``LogField``) are appended before the counters.
Peak memory = the largest across ranks of ``torch.cuda.max_memory_allocated`` on GPUs, of
the process's peak resident set size on CPU.

TensorBoard (``--tensorboard-dir``: the last rank writes, every ``--tensorboard-log-interval``
iterations) and W&B (``--wandb-project``; set ``WANDB_MODE=offline`` without network) get
Megatron-LM's tag names: ``learning-rate``, ``batch-size``, ``lm loss``, ``grad-norm`` (each
also ``<tag> vs samples``); with ``--log-timers-to-tensorboard`` ``iteration-time`` and every
timer as ``<name>-time`` (``forward-backward``, the optimizer's, and with rrfp ``rrfp-compute``,
``rrfp-bubble``, ``rrfp-backpressure``, ``rrfp-tp-agreement``, ``rrfp-flush``: written by
megatron-core's own ``Timers.write``, the maximum across ranks); with
``--log-memory-to-tensorboard`` ``mem-max-allocated-bytes`` (GPU) or ``mem-max-rss-bytes``
(CPU); and ``tokens-per-sec`` (ours). The timers are megatron-core's ``Timers`` at
``--timing-log-level`` (default 0; the rrfp-* timers are published at level 0, so selecting
rrfp is enough to see them); they are printed after the log line like Megatron-LM prints them.
"""
from __future__ import annotations

import os
import resource
import warnings
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Optional

TIMERS_LEVEL_1 = ("forward-backward", "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf",
                  "optimizer-clip-main-grad", "optimizer-count-zeros", "optimizer-inner-step",
                  "optimizer-copy-main-to-model-params", "optimizer")
TIMERS_LEVEL_2 = ("forward-compute", "backward-compute")
"""Timer names training_log logs at --timing-log-level 1 and 2 (Megatron-LM's names)."""


@dataclass(frozen=True, slots=True)
class LogField:
    """One extra ``label: value |`` field of the log line (e.g. peak activation memory)."""

    label: str
    value: str


@dataclass(slots=True)
class Interval:
    """What happened since the last log line (the logging rank's view)."""

    seconds: float = 0.0
    iterations: int = 0
    loss_sum: float = 0.0
    losses: int = 0

    def add(self, seconds: float, loss: Optional[float]) -> None:
        self.seconds += seconds
        self.iterations += 1
        if loss is not None:
            self.loss_sum += loss
            self.losses += 1


class TrainingMetrics:
    """Log line, Megatron timers, TensorBoard and W&B for one run; every rank makes the
    same calls (``log`` is collective at log intervals: timers and peak memory gather)."""

    def __init__(self, cfg, *, rank: int, world_size: int, timers) -> None:
        self.cfg, self.rank, self.world_size, self.timers = cfg, rank, world_size, timers
        self.last_rank = rank == world_size - 1  # Megatron-LM's print_rank_last / writers' rank
        self.interval = Interval()
        self._timers_text: Optional[str] = None
        self.tensorboard = self._open_tensorboard() if self.last_rank and cfg.tensorboard_dir else None
        self.wandb = self._open_wandb() if self.last_rank and cfg.wandb_project else None
        self.timer_names = list(TIMERS_LEVEL_1 if cfg.timing_log_level >= 1 else ())
        self.timer_names += TIMERS_LEVEL_2 if cfg.timing_log_level >= 2 else ()
        if cfg.pipeline_schedule == "rrfp":
            from ..goodput.recorder import TIMER_NAMES

            self.timer_names += TIMER_NAMES.values()

    # -- per iteration ------------------------------------------------------------------

    def iteration(self, *, iteration: int, consumed_samples: int, seconds: float, loss: Optional[float],
                  lr: float, grad_norm: Optional[float], extra: tuple[LogField, ...] = ()) -> Optional[str]:
        """Record one finished iteration; at log intervals (collective) returns the log line
        on the last rank. ``loss`` is known on the last pipeline stage only."""
        cfg = self.cfg
        self.interval.add(seconds, loss)
        if self.last_rank and iteration % cfg.tensorboard_log_interval == 0:
            scalars = {"learning-rate": lr, "batch-size": cfg.global_batch_size,
                       "tokens-per-sec": cfg.global_batch_size * cfg.seq_length / seconds}
            if loss is not None:
                scalars["lm loss"] = loss
            if grad_norm is not None:
                scalars["grad-norm"] = grad_norm
            self._write(scalars, iteration, consumed_samples, vs_samples=("learning-rate", "batch-size", "lm loss",
                                                                           "grad-norm"))
        if iteration % cfg.log_interval and iteration != cfg.train_iters:
            return None
        interval, self.interval = self.interval, Interval()
        per_iteration = interval.seconds / interval.iterations
        peak = peak_memory_bytes()  # collective: the largest on any rank
        if self.last_rank:
            timing = {"iteration-time": per_iteration} if cfg.log_timers_to_tensorboard else {}
            if cfg.log_memory_to_tensorboard:
                timing["mem-max-allocated-bytes" if _on_gpu() else "mem-max-rss-bytes"] = peak
            self._write(timing, iteration, consumed_samples)
        self._write_timers(iteration)
        if not self.last_rank:
            return None
        fields = [("consumed samples", f"{consumed_samples:12d}"),
                  ("elapsed time per iteration (ms)", f"{per_iteration * 1e3:.1f}"),
                  ("tokens per second", f"{cfg.global_batch_size * cfg.seq_length / per_iteration:.1f}"),
                  ("learning rate", f"{lr:.6E}"), ("global batch size", f"{cfg.global_batch_size:5d}")]
        if interval.losses:
            fields.append(("lm loss", f"{interval.loss_sum / interval.losses:.6E}"))
        fields.append(("loss scale", "1.0"))
        if grad_norm is not None:
            fields.append(("grad norm", f"{grad_norm:.3f}"))
        fields.append(("peak memory (MB)", f"{peak / 2**20:.2f}"))
        fields += [(f.label, f.value) for f in extra]
        fields += [("number of skipped iterations", "  0"), ("number of nan iterations", "  0")]
        stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")
        return (f" [{stamp}] iteration {iteration:8d}/{cfg.train_iters:8d} |"
                + "".join(f" {label}: {value} |" for label, value in fields))

    def timers_report(self) -> Optional[str]:
        """Megatron's '(min, max) time across ranks (ms):' block of the last interval
        (collective); None where there is nothing to show."""
        return self._timers_text

    # -- internals ----------------------------------------------------------------------

    def _write_timers(self, iteration: int) -> None:
        """Megatron-LM's order: write to TensorBoard/W&B without resetting, then log and reset."""
        self._timers_text = None
        if self.timers is None or not self.timer_names:
            return
        normalizer = max(1, self.cfg.log_interval)
        if self.cfg.log_timers_to_tensorboard:
            # collective on every rank; megatron-core's Timers.write skips a None writer
            self.timers.write(self.timer_names, self.tensorboard, iteration, normalizer=normalizer, reset=False)
            self.timers.write(self.timer_names, self.wandb, iteration, normalizer=normalizer, reset=False)
        self._timers_text = self.timers.get_all_timers_string(self.timer_names, normalizer=normalizer, reset=True)

    def _write(self, scalars: dict, iteration: int, consumed_samples: int, vs_samples: tuple = ()) -> None:
        if self.tensorboard is not None:
            for tag, value in scalars.items():
                self.tensorboard.add_scalar(tag, value, iteration)
                if tag in vs_samples:
                    self.tensorboard.add_scalar(f"{tag} vs samples", value, consumed_samples)
        if self.wandb is not None and scalars:
            self.wandb.log(dict(scalars), iteration)

    def _open_tensorboard(self):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ValueError(f"--tensorboard-dir needs the tensorboard package ({exc}); "
                             "pip install 'megatron-rrfp[tensorboard]'") from exc
        return SummaryWriter(log_dir=self.cfg.tensorboard_dir, max_queue=1000)

    def _open_wandb(self):
        cfg = self.cfg
        try:
            import wandb
        except ImportError as exc:
            raise ValueError(f"--wandb-project needs the wandb package ({exc}); pip install 'megatron-rrfp[wandb]'"
                             ) from exc
        save_dir = cfg.wandb_save_dir or os.path.join(cfg.save, "wandb")
        os.makedirs(save_dir, exist_ok=True)
        wandb.init(dir=save_dir, project=cfg.wandb_project, name=cfg.wandb_exp_name,
                   config={k: v for k, v in asdict(cfg).items() if v is not None})
        return wandb

    def close(self) -> None:
        """Flush and close the writers (never raises: the run's result is already decided)."""
        for name, close in (("tensorboard", lambda: self.tensorboard.close()), ("wandb", lambda: self.wandb.finish())):
            if getattr(self, name) is None:
                continue
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - a monitoring backend must not fail the job
                warnings.warn(f"megatron-rrfp train: closing {name} failed ({type(exc).__name__}: {exc})",
                              RuntimeWarning, stacklevel=2)
            setattr(self, name, None)


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


def peak_memory_bytes() -> float:
    """Collective (every rank): the largest peak memory of any rank (see the module doc)."""
    import torch

    from ..ranks import max_over_ranks

    if _on_gpu():
        mine = float(torch.cuda.max_memory_allocated())
    else:
        mine = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    return max_over_ranks([mine])[0]


__all__ = ["Interval", "LogField", "TIMERS_LEVEL_1", "TIMERS_LEVEL_2", "TrainingMetrics", "peak_memory_bytes"]
