"""The ``megatron-rrfp`` command: parse -> build -> run -> close, one subcommand each."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence


def _add_workload_variability(group) -> None:
    """Workload knobs shared by `simulate` and `bench` (same names as Variability's fields)."""
    group.add_argument("--straggler-stage", type=int, default=None, help="stage slowed by --straggler-factor")
    group.add_argument("--straggler-factor", type=float, default=1.0)
    group.add_argument("--seq-len-sigma", type=float, default=0.0, help="per-microbatch length spread (log-normal)")
    group.add_argument("--images-per-sample", type=float, default=0.0, help="mean images per microbatch (Poisson)")
    group.add_argument("--encoder-time", type=float, default=0.0, help="stage-0 encoder time per image, units of f0")
    group.add_argument("--image-token-share", type=float, default=0.0,
                       help="average share of decoder tokens that are image tokens (work scales with images)")


def _workload_variability(args: argparse.Namespace) -> dict:
    return dict(straggler_stage=args.straggler_stage, straggler_factor=args.straggler_factor,
                seq_len_sigma=args.seq_len_sigma, images_per_sample=args.images_per_sample,
                encoder_time_per_image=args.encoder_time, image_token_share=args.image_token_share)


def _add_simulate(sub) -> None:
    p = sub.add_parser("simulate", help="discrete-event simulation of pipeline policies",
                       description="Compare readiness-first policies with strict 1F1B on the same "
                                   "sampled run-time variability. Times are in units of f0.")
    p.add_argument("--pp", type=int, default=8, help="pipeline stages (default 8)")
    p.add_argument("--microbatches", "-m", type=int, default=32, help="microbatches per iteration (default 32)")
    p.add_argument("--chunks", type=int, default=1, help="model chunks per stage (interleaved if > 1)")
    p.add_argument("--policies", default="1f1b-strict,1f1b,bf,bfw",
                   help="comma list of bf, bfw, 1f1b, gpipe or hint files; '-strict' = fixed order")
    p.add_argument("--buffer-limit", type=int, default=32, help="microbatches in flight per stage (default 32)")
    p.add_argument("--seeds", type=int, default=5, help="seeds to simulate (medians are reported)")
    p.add_argument("--first-seed", type=int, default=0)
    v = p.add_argument_group("variability (the paper's reference: --sigma-compute 0.3 --c50 0.1 --sigma-msg 1.5)")
    v.add_argument("--reference", action="store_true", help="use the paper's reference variability (J3)")
    v.add_argument("--sigma-compute", type=float, default=0.0, help="log-normal sigma of F/B durations")
    v.add_argument("--backward-ratio", type=float, default=2.0, help="B time / F time (default 2)")
    v.add_argument("--c50", type=float, default=0.0, help="median message latency, units of f0")
    v.add_argument("--sigma-msg", type=float, default=0.0, help="log-normal sigma of message latency")
    _add_workload_variability(v)
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.add_argument("--timeline", metavar="PNG", help="draw every policy's timeline for the first seed")
    p.add_argument("--trace", metavar="JSON", help="Chrome/Perfetto trace of the first seed")
    p.set_defaults(func=_run_simulate)


def _run_simulate(args: argparse.Namespace) -> int:
    from .sim_study import StudyConfig, format_report, run_study, save_json, write_timeline
    from .simulator import REFERENCE_J3, Variability

    knobs = dict(sigma_compute=args.sigma_compute, c50=args.c50, sigma_msg=args.sigma_msg)
    if args.reference:
        knobs.update(REFERENCE_J3)
    variability = Variability(backward_ratio=args.backward_ratio, **_workload_variability(args), **knobs)
    config = StudyConfig(pipeline_size=args.pp, num_microbatches=args.microbatches, num_chunks=args.chunks,
                         policies=[p.strip() for p in args.policies.split(",") if p.strip()],
                         buffer_limit=args.buffer_limit, seeds=args.seeds, first_seed=args.first_seed,
                         variability=variability)
    report = run_study(config)
    print(format_report(report))
    if args.json:
        save_json(report, args.json)
        print(f"figures: {args.json}")
    if args.timeline or args.trace:
        png = args.timeline or args.trace.rsplit(".", 1)[0] + ".png"
        write_timeline(config, png, trace_path=args.trace)
        print(f"timeline: {png}" + (f"  trace: {args.trace}" if args.trace else ""))
    return 0


def _add_bench(sub) -> None:
    from .bench import DEFAULT_SCHEDULES, SCHEDULES, VARIABILITY_LEVELS

    for name in ("bench", "demo"):
        demo = name == "demo"
        p = sub.add_parser(name, help=("the 3-minute CPU demo: Megatron 1F1B vs RRFP on a real GPTModel" if demo
                                       else "measure schedules on real megatron-core models (every knob)"))
        p.add_argument("--model", default="gpt", choices=("gpt", "multimodal"))
        p.add_argument("--pp", type=int, default=4, help="pipeline stages (one process each locally)")
        p.add_argument("--chunks", type=int, default=1,
                       help="model chunks per stage; > 1 compares Megatron's interleaved schedule with RRFP")
        p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
        p.add_argument("--dp", type=int, default=1, help="data-parallel size")
        p.add_argument("--microbatches", "-m", type=int, default=16)
        p.add_argument("--micro-batch-size", type=int, default=2)
        p.add_argument("--seq-length", type=int, default=32)
        p.add_argument("--hidden-size", type=int, default=32)
        p.add_argument("--schedules", default=",".join(DEFAULT_SCHEDULES if demo else SCHEDULES),
                       help=f"comma list of {', '.join(SCHEDULES)}")
        p.add_argument("--variability", default="j3", choices=list(VARIABILITY_LEVELS),
                       help="j0 none ... j3 = sigma_c 0.3, c50 0.1 f0, sigma_m 1.5 (the paper's reference)")
        p.add_argument("--f0-ms", type=float, default=50.0, help="emulated forward time per stage and microbatch")
        _add_workload_variability(p)
        p.add_argument("--iterations", type=int, default=5, help="measured iterations (after warm-up)")
        p.add_argument("--warmup", type=int, default=1)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--buffer-limit", type=int, default=32)
        p.add_argument("--out", default=f"rrfp-out/{name}", help="JSON, traces and the timeline PNG go here")
        p.add_argument("--json", metavar="PATH", help="also copy the figures to PATH")
        p.add_argument("--goodput-ledger", metavar="DB", default=None,
                       help="record every measured iteration in a goodput ledger (megatron-rrfp goodput DB)")
        p.add_argument("--timeout", type=float, default=1200.0, help="seconds before the run is killed")
        p.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    import shutil

    from .bench import BenchConfig, format_table, run_bench
    from .simulator import Variability

    config = BenchConfig(
        model=args.model, pipeline_size=args.pp, num_chunks=args.chunks, tensor_parallel=args.tp,
        data_parallel=args.dp,
        num_microbatches=args.microbatches, micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
        hidden_size=args.hidden_size, schedules=[s.strip() for s in args.schedules.split(",") if s.strip()],
        variability=args.variability, f0_ms=args.f0_ms, workload=Variability(**_workload_variability(args)),
        iterations=args.iterations, warmup=args.warmup,
        seed=args.seed, buffer_limit=args.buffer_limit, out_dir=args.out, timeout_s=args.timeout,
        goodput_ledger=args.goodput_ledger)
    report = run_bench(config)
    print(format_table(report))
    print(f"figures: {config.out_dir}/bench.json  timeline: {config.out_dir}/timeline.png  "
          f"traces: {config.out_dir}/trace-*.json (open in ui.perfetto.dev)")
    if args.json:
        shutil.copyfile(os.path.join(config.out_dir, "bench.json"), args.json)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-rrfp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_simulate(sub)
    _add_bench(sub)
    from .goodput_cli import add_goodput_parser
    from .train import add_train_parser

    add_goodput_parser(sub)
    add_train_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:  # user errors: one clear line, no traceback
        print(f"megatron-rrfp {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
