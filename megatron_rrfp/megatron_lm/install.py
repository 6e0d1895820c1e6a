"""Megatron-LM / megatron-core integration: select the pipeline schedule without editing Megatron.

Megatron-LM (an entry script such as pretrain_gpt.py, run through
``python -m megatron_rrfp.launch`` or with ``megatron_rrfp.install()`` at its top)::

    torchrun --nproc-per-node 8 -m megatron_rrfp.launch pretrain_gpt.py \\
        --pipeline-model-parallel-size 8 --pipeline-schedule rrfp --rrfp-buffer-limit 16 ...

``install()`` wraps ``megatron.training.arguments.add_megatron_arguments`` so Megatron's
parser gains ``--pipeline-schedule {1f1b,rrfp}`` and the ``--rrfp-*`` flags (defined once,
in megatron_rrfp.megatron_lm.flags). When that parser has parsed, the flags are checked (a bad value
exits with a message naming the flag) and, with ``--pipeline-schedule rrfp``, Megatron's
schedule lookup is routed to the readiness-first executor. With the default ``1f1b``
nothing of Megatron behaves differently.

Timers, goodput ledger and traces (``--pipeline-schedule rrfp``; the ledger with
``--rrfp-goodput-ledger PATH``, traces with ``--rrfp-trace-dir DIR``): install() also wraps
Megatron-LM's ``pretrain`` (inert unless such a run is active); once the flags select rrfp,
the names that megatron.training.training looks up at call time (setup_model_and_optimizer,
load_checkpoint, save_checkpoint_and_time, save_checkpoint, train_step) are wrapped so that
every rank adds its rrfp-* breakdown to Megatron's timers, feeds a GoodputRecorder and
writes merged Chrome/Perfetto traces (megatron_lm/training_loop.py). ``megatron-rrfp goodput PATH``
reads the ledger.

megatron-core alone (no megatron.training, e.g. the 0.16.1 wheel)::

    import megatron_rrfp
    megatron_rrfp.install(schedule="rrfp", buffer_limit=16)
    fb = megatron.core.pipeline_parallel.get_forward_backward_func()   # forward_backward_rrfp at PP > 1

Routing replaces ``get_forward_backward_func`` in megatron.core.pipeline_parallel, its
``schedules`` module and every loaded module that imported it by name (Megatron-LM's
training.py does so at import time). The replacement returns ``forward_backward_rrfp``
when the pipeline has more than one stage and defers to Megatron's own lookup otherwise.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from ..mcore import compat
from ..mcore.config import RRFPConfig, defaults, set_defaults
from ..ranks import print_line
from . import layout
from .flags import PIPELINE_SCHEDULES, add_rrfp_arguments, validate_rrfp_arguments
from .training_loop import HookOptions, MegatronLMHooks

__all__ = ["install", "uninstall", "routed", "get_forward_backward_func"]

_ARGS_HOOK = "add_megatron_arguments"
_LOOKUP = "get_forward_backward_func"


class _State:
    """What install() changed, so that uninstall() can put it back exactly."""

    def __init__(self) -> None:
        self.arguments_module = None  # megatron.training.arguments, once wrapped
        self.original_add_arguments = None
        self.original_lookup = None  # Megatron's get_forward_backward_func while routed
        self.routed_modules: list = []
        self.announced = False
        self.code_schedule: Optional[str] = None  # install(schedule=...), for the override warning
        self.training_hooks: Optional[MegatronLMHooks] = None  # goodput ledger + traces in Megatron-LM


_state = _State()


def install(schedule: Optional[str] = None, **options) -> None:
    """Hook Megatron-LM's flags; optionally select the schedule now. Idempotent.

    schedule=None: only add the flags to Megatron-LM's parser (if megatron.training is
    importable); the command line decides later. schedule="rrfp": route the schedule
    lookup now, with ``options`` as flat RRFPConfig options (hint, buffer_limit, strict,
    timeout_s, record_spans). schedule="1f1b": Megatron's own lookup.
    If Megatron-LM's parser runs afterwards, its flags decide (default 1f1b; a warning
    says when that overrides schedule="rrfp").
    """
    if schedule not in (None, *PIPELINE_SCHEDULES):
        raise ValueError(f"megatron_rrfp.install(schedule={schedule!r}): choose one of "
                         f"{', '.join(PIPELINE_SCHEDULES)}")
    if options and schedule != "rrfp":
        raise ValueError(f"megatron_rrfp.install: options {sorted(options)} need schedule='rrfp'")
    _hook_arguments()
    _hook_training_loop()
    if schedule == "rrfp":
        _select_rrfp(defaults().with_options(**options))  # a bad option raises before anything is routed
    elif schedule == "1f1b":
        _unroute()
    if schedule is not None:
        _state.code_schedule = schedule


def uninstall() -> None:
    """Undo install(): Megatron's parser builder and schedule lookup, default options."""
    _unroute()
    if _state.arguments_module is not None:
        setattr(_state.arguments_module, _ARGS_HOOK, _state.original_add_arguments)
    if _state.training_hooks is not None:
        _state.training_hooks.detach()
    set_defaults(RRFPConfig())
    _state.__init__()


def routed() -> bool:
    """Whether Megatron's schedule lookup currently goes through rrfp."""
    return _state.original_lookup is not None


# -- flags ----------------------------------------------------------------------------


def _hook_arguments() -> None:
    module = layout.megatron_arguments_module()
    if module is None or _state.arguments_module is not None:
        return  # megatron-core only, or already hooked
    original = getattr(module, _ARGS_HOOK)

    def add_megatron_arguments(parser, *args, **kwargs):
        parser = original(parser, *args, **kwargs)
        _add_flags(parser)
        return parser

    add_megatron_arguments.__doc__ = f"{original.__doc__ or ''}\n(megatron-rrfp adds --pipeline-schedule, --rrfp-*)"
    add_megatron_arguments.__wrapped__ = original
    setattr(module, _ARGS_HOOK, add_megatron_arguments)
    _state.arguments_module, _state.original_add_arguments = module, original


def _add_flags(parser: argparse.ArgumentParser) -> None:
    if "--pipeline-schedule" in parser._option_string_actions:
        return  # already there: add_megatron_arguments ran twice on this parser
    add_rrfp_arguments(parser, check_types=False)  # _apply checks the values, in one line
    parse_known_args = parser.parse_known_args  # parse_args() goes through it too

    def parse_and_apply(args=None, namespace=None):
        namespace, rest = parse_known_args(args, namespace)
        _apply(parser, namespace)
        return namespace, rest

    parser.parse_known_args = parse_and_apply


def _apply(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Check the flags right after Megatron parsed them, then route (or not).

    Checked here rather than in Megatron's validate_args: this needs no Megatron name
    beyond add_megatron_arguments and runs before any process group exists. Exits like
    argparse does for a bad value, but without the several-hundred-flag usage dump.
    """
    try:
        notes: list[str] = []
        config = validate_rrfp_arguments(args, notes=notes)
        notes += _prepare_inprocess_restart(args)
        if os.environ.get("RANK", "0") == "0":  # after every check passed: a refusal stays one line
            for note in notes:
                print_line(note, file=sys.stderr)
        if config is not None:
            _select_rrfp(config)
            _record_training_loop(HookOptions.from_args(args))
        else:
            if routed() and _state.code_schedule == "rrfp":
                print_line("megatron-rrfp: warning: --pipeline-schedule 1f1b (the command line) overrides "
                           "install(schedule='rrfp'); add --pipeline-schedule rrfp to keep rrfp", file=sys.stderr)
            _unroute()
            _record_training_loop(None)
    except ValueError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")


def _prepare_inprocess_restart(args: argparse.Namespace) -> list[str]:
    """--inprocess-restart (any schedule): what NVRx's wrapper needs from the launcher (inprocess.py)."""
    from ..cpu.megatron_core import runs_on_cuda
    from . import inprocess

    hooks = _state.training_hooks
    done = inprocess.prepare(args, None if hooks is None else hooks.entry_wrapper, cpu=not runs_on_cuda())
    return [f"megatron-rrfp: --inprocess-restart: {', '.join(done)}"] if done else []


# -- goodput ledger and traces in Megatron-LM's training loop --------------------------


def _hook_training_loop() -> None:
    """Wrap Megatron-LM's pretrain now, before the entry script imports it by name."""
    if _state.arguments_module is None or _state.training_hooks is not None:
        return  # megatron-core only, or already attached
    training = layout.megatron_training_module()
    if training is None:
        return
    get_args, get_timers = layout.megatron_lm_globals()
    _state.training_hooks = MegatronLMHooks(training, get_args=get_args, get_timers=get_timers)
    _state.training_hooks.attach()


def _record_training_loop(options: Optional[HookOptions]) -> None:
    """After parsing: wrap the loop's call-time names when rrfp is selected (timers, and the
    ledger / traces when asked for)."""
    hooks = _state.training_hooks
    if hooks is None:
        return
    if options is not None and options.active:
        hooks.activate(options)
    else:
        hooks.deactivate()


# -- schedule routing -----------------------------------------------------------------


def _select_rrfp(config: RRFPConfig) -> None:
    set_defaults(config)
    _state.announced = False
    _route()


def _route() -> None:
    if _state.original_lookup is not None:
        return
    original = compat.megatron_schedule_lookup()
    layout.schedule_lookup_modules()  # both must be loaded before the rebind below
    _state.routed_modules = layout.rebind_loaded(_LOOKUP, original, get_forward_backward_func)
    _state.original_lookup = original


def _unroute() -> None:
    if _state.original_lookup is None:
        return
    for module in _state.routed_modules:
        if getattr(module, _LOOKUP, None) is get_forward_backward_func:
            setattr(module, _LOOKUP, _state.original_lookup)
    # Modules imported while routed copied the replacement: put Megatron's back there too.
    layout.rebind_loaded(_LOOKUP, get_forward_backward_func, _state.original_lookup, exclude=(__name__,))
    _state.original_lookup, _state.routed_modules = None, []


def get_forward_backward_func(pp_size: Optional[int] = None, vp_size: Optional[int] = None, **kwargs):
    """Megatron's schedule lookup, with the readiness-first schedule when PP > 1.

    Same signature as Megatron's (0.19's ``schedule_pg_collection=`` passes through
    ``kwargs``); PP = 1 gets whatever Megatron's own lookup returns.
    """
    original = _state.original_lookup or compat.megatron_schedule_lookup()
    if compat.schedule_lookup_pipeline_size(pp_size, vp_size, kwargs.get("schedule_pg_collection")) > 1:
        from ..mcore.schedule import forward_backward_rrfp

        _announce_once()
        return forward_backward_rrfp
    return original(pp_size=pp_size, vp_size=vp_size, **kwargs)


def _announce_once() -> None:
    """One line per job (global rank 0) saying the schedule really is rrfp, and how."""
    if _state.announced:
        return
    _state.announced = True
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    policy = defaults().arbiter
    strict = ", strict" if policy.strict else ""
    print_line(f"megatron-rrfp: pipeline schedule rrfp (hint={policy.parsed_hint.name}, "
               f"buffer_limit={policy.buffer_limit}{strict})")
