"""The ``megatron-rrfp`` command: parse -> build -> run -> close, one subcommand each,
defined next to what it runs (sim/, bench/, goodput/, train/)."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Optional

from . import __version__, quiet
from .checks import OneLineParser, report_error

_RUNS_MEGATRON = ("demo", "bench", "train")
"""Subcommands whose ranks import megatron-core: they say the one line of quiet.py."""


def build_parser() -> argparse.ArgumentParser:
    from .bench.cli import add_bench_parsers
    from .bench.compare import add_compare_parser
    from .goodput.cli import add_goodput_parser
    from .sim.cli import add_simulate_parser
    from .train.driver import add_train_parser

    parser = OneLineParser(prog="megatron-rrfp", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_simulate_parser(sub)
    add_bench_parsers(sub)
    add_compare_parser(sub)
    add_goodput_parser(sub)
    add_train_parser(sub)
    return parser


def runs_on_cpu(args: argparse.Namespace) -> bool:
    """A command whose processes must not touch a GPU: everything but ``bench`` / ``demo --device
    cuda`` and ``train`` without ``--cpu``."""
    if args.command == "train":
        return args.cpu
    return getattr(args, "device", "cpu") == "cpu"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if runs_on_cpu(args):
        from .launch.env import hide_cuda

        hide_cuda()  # on a GPU host too: before torch first counts devices (it keeps the count)
    with quiet.for_entry_point(announce=args.command in _RUNS_MEGATRON):
        try:
            return args.func(args)
        except (ValueError, OSError) as exc:  # user errors: one clear line, no traceback
            return report_error(f"megatron-rrfp {args.command}", exc)


if __name__ == "__main__":
    sys.exit(main())
