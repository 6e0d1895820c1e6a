"""Where megatron-rrfp attaches to Megatron-LM's ``megatron.training``, by release.

The one place that knows Megatron-LM's module layout and training-loop names; the
installer (``install.py``), the CPU launcher and the goodput/trace hooks (``training_loop.py``)
look everything up through here.
"""
from __future__ import annotations

import importlib
import sys
import types
from dataclasses import dataclass
from typing import Optional

# --------------------------------------------------------------------------- Megatron-LM hooks
#
# megatron_rrfp.megatron_lm.install attaches to Megatron-LM (megatron.training) without editing it.
# Where each hook attaches, by release (checked against the core_v0.16.1 and core_v0.19.0
# tags of Megatron-LM):
#   add_megatron_arguments     megatron.training.arguments, 0.15 - 0.19. parse_args() looks
#                              it up as a module global at call time, so a wrapper there is
#                              seen and the entry script's extra_args_provider stays free.
#   get_forward_backward_func  defined in megatron.core.pipeline_parallel.schedules and
#                              re-exported by megatron.core.pipeline_parallel. Bound *by name*
#                              at import time in megatron.training.training (also
#                              megatron.rl.rl_utils, megatron.post_training.generate), so the
#                              integration rebinds every loaded module that holds Megatron's
#                              function (rebind_loaded). 0.19 adds the keyword
#                              schedule_pg_collection=; a MultiModuleProcessGroupCollection
#                              there selects Megatron's multi-module bridge schedule.
#   initialize_megatron        megatron.training.initialize, bound by name in
#                              megatron.training and megatron.training.training (0.15 - 0.19);
#                              asserts CUDA unless allow_no_cuda=True.
#   fused kernels              megatron.legacy.fused_kernels.load, built by
#                              initialize._compile_dependencies (<= 0.16; 0.19 has no
#                              megatron.legacy and builds none).

_ARGUMENTS_MODULE = "megatron.training.arguments"
_SCHEDULE_LOOKUP_MODULES = ("megatron.core.pipeline_parallel", "megatron.core.pipeline_parallel.schedules")
INITIALIZE_MODULE = "megatron.training.initialize"
FUSED_KERNELS_MODULE = "megatron.legacy.fused_kernels"  # <= 0.16 only


def _optional_training_module(name: str) -> Optional[types.ModuleType]:
    """Import a megatron.training module; None where the training package is absent. A
    training package that is there but fails to import (a missing dependency) raises."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name in ("megatron", "megatron.training", name):
            return None
        raise


def megatron_arguments_module() -> Optional[types.ModuleType]:
    """megatron.training.arguments, or None on a megatron-core-only install (e.g. the
    0.16.1 wheel) where Megatron-LM's training package is absent. A training package
    that is there but fails to import (a missing dependency) raises as usual."""
    return _optional_training_module(_ARGUMENTS_MODULE)


def schedule_lookup_modules() -> list[types.ModuleType]:
    """Modules whose ``get_forward_backward_func`` is Megatron's schedule lookup."""
    return [importlib.import_module(name) for name in _SCHEDULE_LOOKUP_MODULES]


def rebind_loaded(name: str, old, new, *, exclude: tuple = ()) -> list[types.ModuleType]:
    """Set ``module.<name> = new`` in every loaded module whose ``<name>`` is ``old``.

    Needed because Megatron-LM binds some functions by name at import time (``from ...
    import get_forward_backward_func``); replacing only the defining module would miss
    those copies. Identity comparison, so nothing else is touched; ``exclude`` names
    modules to leave alone (the one defining ``old`` itself). Returns the modules.
    """
    rebound = []
    for module_name, module in list(sys.modules.items()):
        if module_name in exclude:
            continue
        # The module's own namespace only: getattr could run a lazy module __getattr__.
        if isinstance(module, types.ModuleType) and vars(module).get(name) is old:
            setattr(module, name, new)
            rebound.append(module)
    return rebound


# --------------------------------------------------------------------------- Megatron-LM training-loop hooks
#
# megatron_rrfp.megatron_lm.training_loop records goodput (--rrfp-goodput-ledger) and writes RRFP
# traces (--rrfp-trace-dir) around Megatron-LM's own training loop, without editing it, by
# wrapping names of megatron.training.training. Checked against the core_v0.16.1 and
# core_v0.19.0 tags of Megatron-LM:
#   pretrain                   the entry point. Entry scripts bind it by name (pretrain_gpt.py, and
#                              0.18+'s pretrain_hybrid.py: `from megatron.training import pretrain`;
#                              megatron/training/__init__.py re-exports it), so it is rebound in every
#                              loaded module that holds it (rebind_loaded), before the entry script
#                              runs. 0.19's scripts pass it through inprocess_restart's wrapper in
#                              __main__, after install(): the wrapped one is what gets wrapped.
#                              0.16.1 - 0.19: it can end in sys.exit(exit_code) (train() on
#                              --exit-interval / --exit-duration-in-mins / a signal; 0 = clean).
#   setup_model_and_optimizer  called by pretrain through training.py's module globals, after
#                              initialize_megatron (args parsed, process groups up): the first
#                              point where a per-rank recorder can be built.
#   load_checkpoint            imported by name into training.py; setup_model_and_optimizer calls
#                              that module global when --load/--pretrained-checkpoint is given and
#                              gets (iteration, num_floating_point_operations_so_far). (RL's
#                              reference-weight loads in train() go through it too.)
#   save_checkpoint_and_time   defined in training.py; train() and checkpoint_and_decide_exit
#                              call it through module globals for interval/exit saves (first
#                              argument: the iteration). 0.19: pretrain's final save after
#                              train() also goes through it.
#   save_checkpoint            imported by name into training.py. 0.16.1: pretrain's final save
#                              (when --train-iters is not a multiple of --save-interval) calls it
#                              directly, not through save_checkpoint_and_time; both are wrapped and
#                              the inner one records only when it is not inside the outer one.
#   train_step                 defined in training.py; train() calls the module global right after
#                              `args.curr_iteration = iteration`, so the step's 1-based number is
#                              curr_iteration + 1 (0.16.1 - 0.19; 0.19 adds pg_collection= and
#                              p2p_communicator= keywords, passed through untouched).
#   _TRAIN_START_TIME          training.py's import-time wall clock, replaced by
#                              set_startup_timestamps(program_start=...) (0.16+); read at call time.
#   get_args, get_timers       megatron.training.global_vars (0.15 - 0.19).

_TRAINING_MODULE = "megatron.training.training"
_GLOBAL_VARS_MODULE = "megatron.training.global_vars"


@dataclass(frozen=True)
class TrainingLoopNames:
    """Where each hook attaches in megatron.training.training (see the section comment)."""

    entry: str = "pretrain"
    setup: str = "setup_model_and_optimizer"
    load: str = "load_checkpoint"
    saves: tuple = ("save_checkpoint_and_time", "save_checkpoint")  # outer first
    step: str = "train_step"
    start_time: str = "_TRAIN_START_TIME"


TRAINING_LOOP_NAMES = TrainingLoopNames()  # the same in 0.16.1 and 0.19.0


def megatron_training_module() -> Optional[types.ModuleType]:
    """megatron.training.training, or None without Megatron-LM's training package."""
    return _optional_training_module(_TRAINING_MODULE)


def megatron_lm_globals() -> tuple:
    """(get_args, get_timers) of megatron.training.global_vars."""
    global_vars = importlib.import_module(_GLOBAL_VARS_MODULE)
    return global_vars.get_args, global_vars.get_timers


def train_start_time(training: types.ModuleType) -> Optional[float]:
    """Megatron-LM's process start (wall clock, seconds), when the module records one."""
    value = vars(training).get(TRAINING_LOOP_NAMES.start_time)
    return float(value) if isinstance(value, (int, float)) else None


def train_step_iteration(args) -> int:
    """The 1-based number of the iteration train_step is about to run."""
    return int(args.curr_iteration) + 1


def loaded_iteration(result) -> int:
    """Iteration a load_checkpoint call resumed from: (iteration, flops) in 0.15 - 0.19."""
    if isinstance(result, tuple) and result and isinstance(result[0], int):
        return result[0]
    return 0


def saved_iteration(args: tuple, kwargs: dict) -> Optional[int]:
    """The iteration argument of save_checkpoint(_and_time): first positional or iteration=."""
    value = args[0] if args else kwargs.get("iteration")
    return value if isinstance(value, int) else None


def tokens_per_iteration(args) -> int:
    """Tokens one training iteration processes, whole job: global batch x sequence length.

    The global batch is the current one (it grows under --rampup-batch-size), from the
    microbatch calculator when it is set up, else --global-batch-size.
    """
    batch = None
    try:
        from megatron.core.num_microbatches_calculator import get_current_global_batch_size

        batch = get_current_global_batch_size()
    except (ImportError, AttributeError, AssertionError, TypeError):  # calculator not set up
        pass
    if not isinstance(batch, int):
        batch = getattr(args, "global_batch_size", None) or 0
    return int(batch) * int(getattr(args, "seq_length", None) or 0)


def trace_points(args) -> tuple[Optional[int], Optional[int]]:
    """(--log-interval, --train-iters): traces are written at multiples of the first and at the
    second (update_train_iters has turned --train-samples into iterations by then)."""
    return getattr(args, "log_interval", None), getattr(args, "train_iters", None)


def parallel_sizes(args) -> dict:
    """pp/tp/cp/dp sizes of a Megatron-LM run, for the ledger's job_start record."""
    names = {"pp": "pipeline_model_parallel_size", "tp": "tensor_model_parallel_size",
             "cp": "context_parallel_size", "dp": "data_parallel_size"}
    return {key: getattr(args, name) for key, name in names.items() if isinstance(getattr(args, name, None), int)}
