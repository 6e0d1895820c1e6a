"""`megatron-rrfp bench` and `demo`: measured schedules on real megatron-core models."""
from __future__ import annotations

import argparse
import os

from ..policy.arbiter import DEFAULT_BUFFER_LIMIT
from ..sim.cli import add_layout_arguments, add_workload_arguments, workload_from_args
from ..sim.llava import add_llava_arguments, llava_from_args


def add_bench_parsers(sub) -> None:
    from ..sim.variability import VARIABILITY_LEVELS
    from .run import BenchConfig
    from .sweep import BENCH_SCHEDULES, DEFAULT_SCHEDULES, DEMO_SCHEDULES

    bounds = {flag: BenchConfig.BOUNDS[name].parse for name, flag in BenchConfig.FLAGS.items()}
    bounds.update({name: BenchConfig.BOUNDS[name].parse for name in BenchConfig.BOUNDS})

    for name in ("bench", "demo"):
        demo = name == "demo"
        p = sub.add_parser(name, help=("the 3-minute CPU demo: Megatron 1F1B vs RRFP on a real GPTModel" if demo
                                       else "measure schedules on real megatron-core models (every knob)"))
        p.add_argument("--model", default="gpt", choices=("gpt", "hybrid", "multimodal"),
                       help="hybrid: megatron-core's HybridModel (>= 0.18), an attention and an MLP layer per chunk")
        layout = p.add_argument_group("layout (Megatron-LM's names; the short forms are aliases)")
        add_layout_arguments(layout, bounds, pp=4, microbatches=16, data_parallel=True,
                             pp_help="pipeline stages (one process each locally)",
                             chunks_help="model chunks per stage; > 1 compares Megatron's interleaved schedule with "
                                         "RRFP")
        p.add_argument("--micro-batch-size", type=bounds["--micro-batch-size"], default=2)
        p.add_argument("--seq-length", type=bounds["--seq-length"], default=32)
        p.add_argument("--hidden-size", type=bounds["--hidden-size"], default=32)
        p.add_argument("--schedules", default=",".join(DEMO_SCHEDULES if demo else DEFAULT_SCHEDULES),
                       help=f"comma list of {', '.join(BENCH_SCHEDULES)} (default: %(default)s)")
        p.add_argument("--variability", default="j3", choices=list(VARIABILITY_LEVELS),
                       help="j0 none ... j3 = sigma_c 0.3, c50 0.1 f0, sigma_m 1.5 (the paper's reference)")
        p.add_argument("--f0-ms", type=bounds["--f0-ms"], default=50.0,
                       help="emulated forward time per stage and microbatch")
        add_workload_arguments(p)
        add_llava_arguments(p.add_argument_group("LLaVA's shapes (--model multimodal: image tokens in the real model, "
                                                 "the ViT's cost on stage 0 in the emulated durations)"),
                            model_sizes=False)
        p.add_argument("--iterations", type=bounds["--iterations"], default=5,
                       help="measured iterations (after warm-up)")
        p.add_argument("--warmup", type=bounds["--warmup"], default=1)
        p.add_argument("--interleave", action="store_true",
                       help="alternate the schedules iteration by iteration (robust ratios on a loaded host)")
        p.add_argument("--seed", type=bounds["--seed"], default=0)
        p.add_argument("--buffer-limit", type=bounds["--buffer-limit"], default=DEFAULT_BUFFER_LIMIT,
                       help="RRFP's activations in flight per stage: an integer, a multiple of Megatron's "
                            "('1x', '1.5x') or 'auto' (grown into measured free memory); a comma list "
                            "(1x,1.5x,2x,auto) runs each readiness-first schedule once per limit and draws "
                            f"tradeoff.png (speedup vs peak memory); default {DEFAULT_BUFFER_LIMIT}")
        p.add_argument("--out", default=f"rrfp-out/{name}", help="JSON, traces and the timeline PNG go here")
        p.add_argument("--json", metavar="PATH", help="also copy the figures to PATH")
        p.add_argument("--goodput-ledger", metavar="DB", default=None,
                       help="record every measured iteration in a goodput ledger (megatron-rrfp goodput DB)")
        p.add_argument("--timeout", type=bounds["--timeout"], default=1200.0, help="seconds before the run is killed")
        p.add_argument("--breakdown", action="store_true",
                       help="print where each schedule's time went (device, host, runtime, agreement, waits) "
                            "instead of one line")
        p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                       help="cpu (default): one gloo process per rank on this host's CPUs, CUDA hidden from them; "
                            "cuda: one rank per GPU over NCCL (needs PP x TP x DP GPUs), started by torch's "
                            "launcher, the emulated device time a sleep kernel on each rank's stream")
        production = p.add_argument_group("production parallelism (Megatron-LM's names)")
        production.add_argument("--sequence-parallel", action="store_true",
                                help="Megatron's sequence parallelism (needs --tensor-model-parallel-size > 1)")
        production.add_argument("--overlap-grad-reduce", action="store_true",
                                help="megatron-core DDP around the stages, reductions overlapped with the backward")
        production.add_argument("--use-distributed-optimizer", action="store_true",
                                help="DDP's distributed-optimizer layout (reduce-scatter of gradients)")
        production.add_argument("--overlap-param-gather", action="store_true",
                                help="parameter all-gathers overlapped with the forwards (emulated: --dp-gather-ms)")
        production.add_argument("--dp-reduce-ms", type=bounds["dp_reduce_ms"], default=0.0,
                                help="emulated device time of one model chunk's DP gradient reduction (over its "
                                     "buckets by size); at the end without --overlap-grad-reduce")
        production.add_argument("--dp-gather-ms", type=bounds["dp_gather_ms"], default=0.0,
                                help="emulated device time of one model chunk's parameter all-gather "
                                     "(--use-distributed-optimizer; after the step without --overlap-param-gather)")
        production.add_argument("--a2a-ms", type=bounds["--a2a-ms"], default=0.0,
                                help="emulated device time of each MoE expert all-to-all (dispatch, combine; F and B)")
        production.add_argument("--rrfp-transport", default="auto", choices=("auto", "threads", "rounds"),
                                help="RRFP's transport: rounds = the NCCL protocol CUDA runs, here on gloo")
        production.add_argument("--whole-stage-agreement", action="store_true",
                                help="RRFP agrees over every DP replica of a stage, as on CUDA with interleaving, "
                                     "DP > 1 and overlap: measures the rule's cost on CPU")
        production.add_argument("--rrfp-dp-overlap", default="auto", choices=("auto", "lockstep", "after-loop"),
                                help="as train's flag; after-loop applies on CPU too (all-gathers before RRFP's task "
                                     "loop, reductions after it)")
        p.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    import shutil

    from ..sim.variability import Variability
    from .run import BenchConfig, run_bench
    from .table import format_table

    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise ValueError(f"--json {args.json!r}: its directory does not exist (checked now, not after the run)")
    workload = workload_from_args(args)
    llava = llava_from_args(args, args.pp, decoder_seq_length=args.seq_length)
    if llava is not None:
        if args.model != "multimodal" or (args.img_w or args.img_h) != args.img_h:
            raise ValueError("--img-h/--img-w/--patch-dim need --model multimodal and square images (the bench's "
                             "recipe, train/recipes/multimodal.py, takes one image side)")
        workload.update(straggler_stage=0, straggler_factor=llava.stage0_factor)
        print(f"LLaVA: {llava.image_tokens} image tokens per sample in --seq-length {args.seq_length}; ViT + "
              f"projection = {llava.encoder_share:.2f} of a decoder stage: stage 0 x{llava.stage0_factor:.2f}")
    config = BenchConfig(
        model=args.model, pipeline_size=args.pp, num_chunks=args.chunks, tensor_parallel=args.tp,
        data_parallel=args.dp,
        num_microbatches=args.microbatches, micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
        hidden_size=args.hidden_size, schedules=[s.strip() for s in args.schedules.split(",") if s.strip()],
        variability=args.variability, f0_ms=args.f0_ms, workload=Variability(**workload),
        iterations=args.iterations, warmup=args.warmup, interleave=args.interleave,
        seed=args.seed, buffer_limit=args.buffer_limit, out_dir=args.out, timeout_s=args.timeout,
        goodput_ledger=args.goodput_ledger, sequence_parallel=args.sequence_parallel,
        overlap_grad_reduce=args.overlap_grad_reduce, use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather, dp_reduce_ms=args.dp_reduce_ms,
        dp_gather_ms=args.dp_gather_ms, a2a_ms=args.a2a_ms, whole_stage_agreement=args.whole_stage_agreement,
        transport=args.rrfp_transport, dp_overlap=args.rrfp_dp_overlap,
        image_size=args.img_h if llava is not None else None, patch_dim=args.patch_dim, device=args.device)
    report = run_bench(config)
    if not report:
        return 0  # one rank of a job torchrun / srun started: rank 0 prints the table
    print(format_table(report, breakdown=args.breakdown))
    print(f"figures: {config.out_dir}/bench.json  timeline: {config.out_dir}/timeline.png  "
          + (f"trade-off: {config.out_dir}/tradeoff.png  " if "tradeoff" in report else "")
          + f"traces: {config.out_dir}/trace-*.json (open in ui.perfetto.dev)")
    if args.json:
        shutil.copyfile(os.path.join(config.out_dir, "bench.json"), args.json)
    return 0
