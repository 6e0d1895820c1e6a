"""The ``--pipeline-schedule`` / ``--rrfp-*`` command-line flags, shared by the Megatron-LM
integration, the project's training driver and the benchmarks (one definition, one set
of checks, the same error messages everywhere)."""
from __future__ import annotations

import argparse
import os
from typing import Optional

from .hints import BUILTIN_HINTS, HintError, make_hint

SCHEDULES = ("1f1b", "rrfp")


def add_rrfp_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the flags to ``parser`` (an argparse parser or Megatron-LM's). Returns it."""
    group = parser.add_argument_group("readiness-first pipeline schedule (megatron-rrfp)")
    group.add_argument("--pipeline-schedule", choices=SCHEDULES, default="1f1b",
                       help="1f1b: Megatron's own schedules (unchanged). rrfp: the readiness-first executor.")
    group.add_argument("--rrfp-hint", default="bf",
                       help=f"hint order: {', '.join(BUILTIN_HINTS)} or a JSON hint file (default bf)")
    group.add_argument("--rrfp-buffer-limit", type=int, default=32,
                       help="microbatches in flight per stage before backpressure (default 32)")
    group.add_argument("--rrfp-strict", action="store_true",
                       help="run the hint as a fixed order (baseline in the same runtime)")
    group.add_argument("--rrfp-timeout", type=float, default=600.0,
                       help="seconds without progress before a rank fails with a state dump (default 600)")
    group.add_argument("--rrfp-trace-dir", default=None,
                       help="write a Chrome/Perfetto trace of measured task timings per rank here")
    group.add_argument("--rrfp-goodput-ledger", default=None,
                       help="SQLite goodput ledger path (job, iteration, checkpoint events)")
    return parser


def validate_rrfp_arguments(args: argparse.Namespace) -> None:
    """Raise ValueError naming the flag and the fix; no silent fallback."""
    schedule = getattr(args, "pipeline_schedule", "1f1b")
    if schedule not in SCHEDULES:
        raise ValueError(f"--pipeline-schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if not isinstance(args.rrfp_buffer_limit, int) or args.rrfp_buffer_limit < 1:
        raise ValueError(f"--rrfp-buffer-limit must be an integer >= 1, got {args.rrfp_buffer_limit!r} "
                         "(default 32; 16 already captures most of the benefit)")
    if not args.rrfp_timeout > 0:
        raise ValueError(f"--rrfp-timeout must be > 0 seconds, got {args.rrfp_timeout!r}")
    try:
        make_hint(args.rrfp_hint)
    except HintError as exc:
        raise ValueError(f"--rrfp-hint: {exc}") from exc
    for flag in ("rrfp_trace_dir", "rrfp_goodput_ledger"):
        path = getattr(args, flag, None)
        if path:
            parent = path if flag == "rrfp_trace_dir" else (os.path.dirname(os.path.abspath(path)) or ".")
            if os.path.exists(parent) and not os.path.isdir(parent):
                raise ValueError(f"--{flag.replace('_', '-')} {path!r}: {parent!r} is not a directory")
    if schedule == "1f1b" and _rrfp_flags_set(args):
        raise ValueError("--rrfp-* flags were given but --pipeline-schedule is 1f1b; "
                         "add --pipeline-schedule rrfp (or drop the --rrfp-* flags)")


def _rrfp_flags_set(args: argparse.Namespace) -> bool:
    defaults = add_rrfp_arguments(argparse.ArgumentParser(add_help=False)).parse_args([])
    return any(getattr(args, k, getattr(defaults, k)) != getattr(defaults, k)
               for k in vars(defaults) if k.startswith("rrfp_"))


def rrfp_config_from_args(args: argparse.Namespace, **extra) -> "RRFPConfig":  # noqa: F821
    """The executor options the flags ask for (after ``validate_rrfp_arguments``)."""
    from .schedule import RRFPConfig

    return RRFPConfig(hint=args.rrfp_hint, buffer_limit=args.rrfp_buffer_limit, strict=args.rrfp_strict,
                      timeout_s=args.rrfp_timeout, record_spans=bool(getattr(args, "rrfp_trace_dir", None)), **extra)


def selected(args: Optional[argparse.Namespace]) -> bool:
    return args is not None and getattr(args, "pipeline_schedule", "1f1b") == "rrfp"
