"""RRFP's timers, goodput ledger and traces in Megatron-LM's own training loop, without editing it.

``megatron_rrfp.install()`` (which ``python -m megatron_rrfp.launch`` calls) attaches
these hooks; they act in every run whose command line selects ``--pipeline-schedule rrfp``:
the rrfp-* breakdown always goes to Megatron's timers (so training_log prints it and
``--log-timers-to-tensorboard`` writes it as ``rrfp-*-time``, at any ``--timing-log-level``),
the ledger and traces with ``--rrfp-goodput-ledger`` and/or ``--rrfp-trace-dir``::

    torchrun --nproc-per-node 8 -m megatron_rrfp.launch pretrain_gpt.py \\
        --pipeline-model-parallel-size 8 --pipeline-schedule rrfp \\
        --rrfp-goodput-ledger run/goodput.db --rrfp-trace-dir run/traces ...
    megatron-rrfp goodput run/goodput.db

What wraps what (names of ``megatron.training.training``; layout.py, section "Megatron-LM
training-loop hooks", says why Megatron sees each wrapper and what differs by release):

    pretrain                   job_end() on return (and on sys.exit(0)); on an exception
                               disruption(type, message, rank), close, re-raise
    setup_model_and_optimizer  before it: a GoodputRecorder on every rank (rank 0 writes)
                               dating from Megatron's _TRAIN_START_TIME, job_start(pp, tp, ...),
                               rrfp-* timers added to training_log's list (extend_timer_logging)
    load_checkpoint            inside checkpoint_load(); restart(iteration, checkpoint kind, restart
                               mechanism: resume.py) if it resumed
    save_checkpoint_and_time,  inside checkpoint_save(iteration) (0.16.1's final save calls
    save_checkpoint            save_checkpoint directly; a nested call records once)
    train_step                 iteration_start(it) ... iteration(it, tokens, report) --
                               COLLECTIVE (a small all-gather) on every rank --, the report's
                               breakdown added to the rrfp-* timers (publish_to_timers, log
                               level 0), and every --log-interval iterations and at
                               --train-iters (rank 0) a line with the peak activation memory
                               and forwards in flight, max over ranks (a 2-float all-gather),
                               and every rank's spans gathered (COLLECTIVE) into one
                               common-clock trace DIR/rrfp-iter{N}.json written by rank 0

it = args.curr_iteration + 1 (1-based, the number Megatron logs); tokens = current global
batch x --seq-length (whole job, not per rank); the trace's pid is the global rank.
report = the RRFP iteration that train_step ran (None when the step ran another
schedule, e.g. at pipeline size 1: the ledger then counts the step as productive, unsplit).

Neither the ledger nor a trace can stop training: the recorder never raises after its
constructor (which raises LedgerBusyError on every rank, before any step, when another
live process writes the same ledger), and a failed trace write gives one ``TraceWarning`` per process.
"""
from __future__ import annotations

import functools
import inspect
import os
import time
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from ..goodput.recorder import extend_timer_logging, open_recorder, peak_memory_line, publish_to_timers
from ..ranks import print_line
from ..trace.merge import write_merged_trace
from . import layout, resume
from .inprocess import ArgsOnReentry

__all__ = ["HookOptions", "HookWarning", "MegatronLMHooks", "TraceWarning", "TraceWriter", "trace_due"]


class HookWarning(RuntimeWarning):
    """Something the hooks need is missing or failed; training goes on without it.

    A RuntimeWarning (like ledger.LedgerWarning), not a UserWarning: Megatron-LM's
    pretrain_gpt.py ignores UserWarning on every rank but 0, and a trace that only one
    rank cannot write must still be reported by that rank.
    """


class TraceWarning(HookWarning):
    """A trace file could not be written; training goes on without it."""


@dataclass(kw_only=True, slots=True)
class HookOptions:
    """What the hooks record in one Megatron-LM run (from its parsed flags)."""

    ledger_path: Optional[str] = None
    """--rrfp-goodput-ledger: the SQLite goodput ledger (rank 0 writes, every rank takes part)."""
    trace_dir: Optional[str] = None
    """--rrfp-trace-dir: one merged Chrome/Perfetto trace of all ranks per traced iteration."""
    timers: bool = True
    """The rrfp-* breakdown in Megatron's timers (training_log prints / writes them)."""

    @classmethod
    def from_args(cls, args) -> HookOptions:
        return cls(ledger_path=getattr(args, "rrfp_goodput_ledger", None) or None,
                   trace_dir=getattr(args, "rrfp_trace_dir", None) or None)

    @property
    def active(self) -> bool:
        return bool(self.ledger_path or self.trace_dir or self.timers)


def trace_due(iteration: int, *, log_interval: Optional[int], last_iteration: Optional[int]) -> bool:
    """Every ``log_interval`` iterations, and at the last one."""
    return iteration == last_iteration or bool(log_interval and log_interval > 0 and iteration % log_interval == 0)


class TraceWriter:
    """Every rank's measured spans of one iteration -> one merged, common-clock trace
    ``DIR/rrfp-iter{N}.json`` written by rank 0 (pid = rank; an arrow from each send to its
    receive; trace/merge.py). ``write`` is COLLECTIVE (every rank, same iterations); it never
    raises: a failure gives one TraceWarning per rank and training goes on."""

    def __init__(self, trace_dir: str, rank: int) -> None:
        self.trace_dir, self.rank = trace_dir, rank
        self.written = 0
        self.failed = 0

    def path(self, iteration: int) -> str:
        return os.path.join(self.trace_dir, f"rrfp-iter{iteration}.json")

    def write(self, iteration: int, report, *, metadata: Optional[dict] = None) -> Optional[str]:
        """Gather ``report.spans`` (an executor.IterationReport) of every rank; the path on
        rank 0, None elsewhere or if nothing was written. ``report`` None (not an RRFP step:
        the same on every rank) writes nothing and gathers nothing."""
        if report is None or not report.spans:
            return None  # not an RRFP step, or spans were not recorded
        path = self.path(iteration)
        info = {"stage": report.stage, "order": report.order_string, "wall_s": report.wall_s,
                "compute_s": report.compute_s, "wait_s": report.wait_s, "backpressure_s": report.backpressure_s,
                "agree_s": report.agree_s, "flush_s": report.flush_s,
                "peak_activation_bytes": report.peak_activation_bytes,
                "activation_measure": report.activation_measure, "peak_in_flight": report.peak_in_flight,
                "buffer_limit": report.buffer_limit}
        try:
            written = write_merged_trace(report.spans, report.started_at, path,
                                         label=f"rank {self.rank} (stage {report.stage})", info=info,
                                         metadata={"source": "megatron-rrfp measured", "iteration": iteration,
                                                   **(metadata or {})})
        except Exception as exc:  # mostly OSError; a trace is diagnostics and must not stop training
            self.failed += 1
            if self.failed == 1:
                warnings.warn(f"megatron-rrfp: rank {self.rank}: trace {path} not written ({type(exc).__name__}: "
                              f"{exc}); training continues; later trace failures on this rank are not reported",
                              TraceWarning, stacklevel=2)
            return None
        if written is not None:
            self.written += 1
        return written


class _Run:
    """One pretrain() call on this rank: its recorder, trace writer and checkpoint state."""

    def __init__(self, *, options: HookOptions, margs, timers, training: types.ModuleType,
                 since_wall: Optional[float] = None) -> None:
        self.rank, self.world = _rank_world()
        self.timers = timers
        # collective: another live job on this ledger fails every rank here, not rank 0 alone
        self.recorder = open_recorder(options.ledger_path, rank=self.rank, world=self.world,
                                      since_wall=since_wall or layout.train_start_time(training))
        self.traces = TraceWriter(options.trace_dir, self.rank) if options.trace_dir else None
        self.saving = False  # inside a recorded save: a nested save_checkpoint is the same save
        self.resumed = False
        self.recorder.job_start(**layout.parallel_sizes(margs))
        extend_timer_logging(timers)  # same names on every rank: Megatron's timers.log is collective

    def step_done(self, iteration: int, report, margs) -> None:
        self.recorder.iteration(iteration, tokens=layout.tokens_per_iteration(margs), report=report)
        publish_to_timers(self.timers, report, log_level=0)  # level 0: shown at any --timing-log-level
        log_interval, last_iteration = layout.trace_points(margs)
        if trace_due(iteration, log_interval=log_interval, last_iteration=last_iteration):
            line = peak_memory_line(report, iteration, world=self.world)  # collective: every rank, same steps
            if line:
                print_line(line)
            if self.traces is not None:
                self.traces.write(iteration, report)

    def end(self, error: Optional[BaseException]) -> None:
        if error is None:
            self.recorder.job_end()
            return
        message = f"exit code {error.code}" if isinstance(error, SystemExit) else str(error)
        self.recorder.disruption(type(error).__name__, message, rank=self.rank)
        self.recorder.close(timeout_s=2.0)  # releases the ledger lock for an in-process restart


class MegatronLMHooks:
    """The wrappers around one ``megatron.training.training`` module (see the module doc).

    ``attach()`` wraps the entry point (inert until a run is active); ``activate(options)``
    wraps the names Megatron looks up at call time and makes the next setup start a run;
    ``deactivate()`` / ``detach()`` put Megatron's functions back (those still ours).
    ``get_args`` / ``get_timers``: Megatron-LM's global_vars functions; ``last_report``: where the
    schedule's report is read (default megatron_rrfp.mcore.schedule.last_iteration_report).
    """

    def __init__(self, training: types.ModuleType, *, get_args: Callable, get_timers: Callable,
                 last_report: Optional[Callable] = None,
                 names: layout.TrainingLoopNames = layout.TRAINING_LOOP_NAMES) -> None:
        self.training, self.names = training, names
        self.get_args, self.get_timers = get_args, get_timers
        self.last_report = last_report or _last_iteration_report
        self.options: Optional[HookOptions] = None
        self.run: Optional[_Run] = None
        self._entry: Optional[tuple] = None  # (Megatron's pretrain, our wrapper)
        self._wrapped: dict[str, tuple] = {}  # name -> (Megatron's function, our wrapper)
        self.call_wrapper = None  # NVRx's, when --inprocess-restart injected it into this pretrain call
        self.entered_wall: Optional[float] = None  # when this pretrain call began (time.time())
        self.args_on_reentry = ArgsOnReentry()  # Megatron >= 0.18 forgets its parsed flags on a restart

    # -- installing --------------------------------------------------------------------

    @property
    def entry_wrapper(self) -> Optional[Callable]:
        """Our wrapper of Megatron's ``pretrain`` (what entry scripts call), once attached."""
        return None if self._entry is None else self._entry[1]

    def attach(self) -> None:
        if self._entry is not None:
            return
        original = vars(self.training).get(self.names.entry)
        if original is None:
            warnings.warn(f"megatron-rrfp: {self.training.__name__}.{self.names.entry} not found; goodput ledger "
                          "and traces are off for Megatron-LM runs", HookWarning, stacklevel=2)
            return
        wrapper = _wrapper(original, self._pretrain)
        layout.rebind_loaded(self.names.entry, original, wrapper)  # entry scripts import it by name
        self._entry = (original, wrapper)

    def activate(self, options: HookOptions) -> None:
        self.options = options
        handlers = {self.names.setup: self._setup, self.names.load: self._load, self.names.step: self._train_step,
                    **{name: self._save for name in self.names.saves}}
        missing = [name for name in handlers if name not in self._wrapped and vars(self.training).get(name) is None]
        if missing:
            warnings.warn(f"megatron-rrfp: {self.training.__name__} has no {', '.join(missing)}: those are not "
                          "recorded (a Megatron-LM release this version of megatron-rrfp does not know?)",
                          HookWarning, stacklevel=2)
        for name, handler in handlers.items():
            original = vars(self.training).get(name)
            if name in self._wrapped or original is None:
                continue
            wrapper = _wrapper(original, handler)
            setattr(self.training, name, wrapper)
            self._wrapped[name] = (original, wrapper)

    def deactivate(self) -> None:
        self.options = None
        for name, (original, wrapper) in self._wrapped.items():
            if vars(self.training).get(name) is wrapper:
                setattr(self.training, name, original)
        self._wrapped.clear()

    def detach(self) -> None:
        self.deactivate()
        if self._entry is not None:
            original, wrapper = self._entry
            layout.rebind_loaded(self.names.entry, wrapper, original)
            self._entry = None
        if self.run is not None:
            self.run.recorder.close()
            self.run = None

    # -- the wrappers' bodies ----------------------------------------------------------

    def _pretrain(self, original, args, kwargs):
        self.entered_wall = time.time()
        self.call_wrapper = _call_wrapper(original, args, kwargs)
        self.args_on_reentry.enter(original)
        try:
            result = original(*args, **kwargs)
        except SystemExit as exc:  # Megatron's own exits: code 0 is a clean end
            self._end_run(None if exc.code in (None, 0) else exc)
            raise
        except BaseException as exc:
            self._end_run(exc)
            raise
        self._end_run(None)
        return result

    def _setup(self, original, args, kwargs):
        if self.options is not None and self.options.active:
            if self.run is not None:  # a second setup in one process without pretrain around it
                self.run.recorder.close()
            reentered = resume.restart_mechanism(self.call_wrapper, {}) == "in-process"
            self.run = _Run(options=self.options, margs=self.get_args(), timers=self.get_timers(),
                            training=self.training,  # a restarted pretrain: its process started long ago
                            since_wall=self.entered_wall if reentered else None)
        return original(*args, **kwargs)

    def _load(self, original, args, kwargs):
        run = self.run
        if run is None:
            return original(*args, **kwargs)
        with run.recorder.checkpoint_load():
            result = original(*args, **kwargs)
        iteration = layout.loaded_iteration(result)
        if iteration > 0 and not run.resumed:
            run.resumed = True
            run.recorder.restart(iteration, checkpoint=resume.checkpoint_kind(self.get_args(), iteration),
                                 mechanism=resume.restart_mechanism(self.call_wrapper))
        return result

    def _save(self, original, args, kwargs):
        run = self.run
        if run is None or run.saving:
            return original(*args, **kwargs)
        run.saving = True
        try:
            with run.recorder.checkpoint_save(layout.saved_iteration(args, kwargs)):
                return original(*args, **kwargs)
        finally:
            run.saving = False

    def _train_step(self, original, args, kwargs):
        run = self.run
        if run is None:
            return original(*args, **kwargs)
        margs = self.get_args()
        iteration = layout.train_step_iteration(margs)
        before = self.last_report()
        run.recorder.iteration_start(iteration)
        result = original(*args, **kwargs)
        report = self.last_report()
        run.step_done(iteration, None if report is before else report, margs)  # same object: not this step's
        return result

    def _end_run(self, error: Optional[BaseException]) -> None:
        run, self.run = self.run, None
        if run is not None:
            run.end(error)


def _wrapper(original: Callable, handler: Callable) -> Callable:
    """A function that looks like ``original`` and calls ``handler(original, args, kwargs)``."""

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        return handler(original, args, kwargs)

    wrapper._rrfp_hook = True
    return wrapper


def _call_wrapper(pretrain: Callable, args: tuple, kwargs: dict):
    """The ``inprocess_call_wrapper`` NVRx passed (by position or by name), or None."""
    try:
        return inspect.signature(pretrain).bind_partial(*args, **kwargs).arguments.get("inprocess_call_wrapper")
    except (TypeError, ValueError):
        return kwargs.get("inprocess_call_wrapper")


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _last_iteration_report():
    from ..mcore.schedule import last_iteration_report

    return last_iteration_report()
