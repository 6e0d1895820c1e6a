"""`megatron-rrfp simulate`: compare pipeline policies on the same sampled variability."""
from __future__ import annotations

import argparse

from ..checks import bound
from ..policy.arbiter import DEFAULT_BUFFER_LIMIT
from .llava import add_llava_arguments, llava_from_args
from .simulator import BASELINE
from .study import DEFAULT_POLICIES, StudyConfig
from .variability import Variability

_VARIABILITY = Variability.BOUNDS
_STUDY = StudyConfig.BOUNDS
_OPTIMAL_TIME = bound(0, 24 * 3600, low_open=True)



def add_layout_arguments(group, parse: dict, *, pp: int, microbatches: int, data_parallel: bool, pp_help: str,
                         chunks_help: str) -> None:
    """The layout flags of `simulate`, `bench` and `demo` in Megatron-LM's names (``train``'s), with
    the short forms kept as aliases; ``parse``: each field's Bound.parse by field name."""
    group.add_argument("--pipeline-model-parallel-size", "--pp", dest="pp", type=parse["pipeline_size"], default=pp,
                       help=f"{pp_help} (default {pp})")
    group.add_argument("--virtual-pipeline-model-parallel-size", "--chunks", dest="chunks",
                       type=parse["num_chunks"], default=1, help=chunks_help)
    group.add_argument("--num-microbatches", "--microbatches", "-m", dest="microbatches",
                       type=parse["num_microbatches"], default=microbatches,
                       help=f"microbatches per iteration (default {microbatches})")
    if data_parallel:
        group.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=parse["tensor_parallel"], default=1,
                           help="tensor-parallel size")
        group.add_argument("--data-parallel-size", "--dp", dest="dp", type=parse["data_parallel"], default=1,
                           help="data-parallel size (Megatron-LM derives it from the world size)")


def add_workload_arguments(group) -> None:
    """Workload knobs shared by `simulate` and `bench` (same names as Variability's fields;
    the flag's type is the field's accepted range, so a bad value stops the parse)."""
    group.add_argument("--straggler-stage", type=_VARIABILITY["straggler_stage"].parse, default=None,
                       help="stage slowed by --straggler-factor")
    group.add_argument("--straggler-factor", type=_VARIABILITY["straggler_factor"].parse, default=1.0)
    group.add_argument("--seq-len-sigma", type=_VARIABILITY["seq_len_sigma"].parse, default=0.0,
                       help="per-microbatch length spread (log-normal)")
    group.add_argument("--images-per-sample", type=_VARIABILITY["images_per_sample"].parse, default=0.0,
                       help="mean images per microbatch (Poisson)")
    group.add_argument("--encoder-time", type=_VARIABILITY["encoder_time_per_image"].parse, default=0.0,
                       help="stage-0 encoder time per image, units of f0")
    group.add_argument("--image-token-share", type=_VARIABILITY["image_token_share"].parse, default=0.0,
                       help="average share of decoder tokens that are image tokens (work scales with images)")
    add_moe_arguments(group)


_MOE_FIELDS = ("num_experts", "expert_parallel", "moe_topk", "moe_tokens", "moe_skew", "moe_concentration",
               "moe_share", "a2a_time")


def add_moe_arguments(group) -> None:
    """Mixture of experts (variability.moe_load_factor): expert load per microbatch from a skewed,
    drifting router; the slowest expert-parallel rank sets the layer's time."""
    helps = {"num_experts": "MoE: experts per layer (0: dense)",
             "expert_parallel": "MoE: EP degree; the replicas of a stage run in lock-step",
             "moe_topk": "MoE: experts per token", "moe_tokens": "MoE: tokens per microbatch and replica",
             "moe_skew": "MoE: Zipf exponent of each layer's expert popularity",
             "moe_concentration": "MoE: Dirichlet concentration of the router's per-microbatch drift",
             "moe_share": "MoE: share of a stage's compute in its experts",
             "a2a_time": "MoE: all-to-all time per F and per B at balanced load, units of f0"}
    defaults = Variability()
    for name in _MOE_FIELDS:
        group.add_argument(Variability.FLAGS[name], dest=name, type=_VARIABILITY[name].parse,
                           default=getattr(defaults, name), help=helps[name] + " (default %(default)s)")


def workload_from_args(args: argparse.Namespace) -> dict:
    return dict(straggler_stage=args.straggler_stage, straggler_factor=args.straggler_factor,
                seq_len_sigma=args.seq_len_sigma, images_per_sample=args.images_per_sample,
                encoder_time_per_image=args.encoder_time, image_token_share=args.image_token_share,
                **{name: getattr(args, name) for name in _MOE_FIELDS})


def add_simulate_parser(sub) -> None:
    p = sub.add_parser("simulate", help="discrete-event simulation of pipeline policies",
                       description="Compare readiness-first policies with strict 1F1B on the same "
                                   "sampled run-time variability. Times are in units of f0.")
    add_layout_arguments(p.add_argument_group("layout (Megatron-LM's names; the short forms are aliases)"),
                         {name: bound.parse for name, bound in _STUDY.items()}, pp=8, microbatches=32,
                         data_parallel=False, pp_help="pipeline stages", chunks_help="model chunks per stage "
                         "(interleaved if > 1)")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help="comma list of default, bf, bfw, 1f1b, zbh1, gpipe or hint files; '-strict' = fixed order "
                        f"(default {','.join(DEFAULT_POLICIES)})")
    p.add_argument("--buffer-limit", default=DEFAULT_BUFFER_LIMIT,
                   help="(microbatch, chunk) forwards in flight per stage: an integer, or a multiple of what "
                        "Megatron's own schedule holds ('1x', '1.5x'); a comma list (1x,1.5x,2x,4x) draws the "
                        f"speedup-vs-memory trade-off curve (default {DEFAULT_BUFFER_LIMIT})")
    p.add_argument("--baseline", default=BASELINE,
                   help="also report each policy's per-seed speedup over this one (e.g. zbh1-strict)")
    p.add_argument("--seeds", type=_STUDY["seeds"].parse, default=5, help="seeds to simulate (medians are reported)")
    p.add_argument("--first-seed", type=_STUDY["first_seed"].parse, default=0)
    v = p.add_argument_group("variability (the paper's reference: --sigma-compute 0.3 --c50 0.1 --sigma-msg 1.5)")
    v.add_argument("--reference", action="store_true", help="use the paper's reference variability (J3)")
    v.add_argument("--sigma-compute", type=_VARIABILITY["sigma_compute"].parse, default=0.0,
                   help="log-normal sigma of F/B durations")
    v.add_argument("--backward-ratio", type=_VARIABILITY["backward_ratio"].parse, default=2.0,
                   help="B time / F time (default 2)")
    v.add_argument("--c50", type=_VARIABILITY["c50"].parse, default=0.0, help="median message latency, units of f0")
    v.add_argument("--sigma-msg", type=_VARIABILITY["sigma_msg"].parse, default=0.0,
                   help="log-normal sigma of message latency")
    add_workload_arguments(v)
    v.add_argument("--task-times", metavar="FILE", default=None,
                   help="draw every task's duration from times measured on a device (scripts/measure_task_times.py "
                        "wrote FILE) instead of the compute model; f0 = the measured median F")
    v.add_argument("--task-times-workload", metavar="NAME", default=None,
                   help="the workload of --task-times to draw from (default: gpt, else the file's first)")
    add_llava_arguments(p.add_argument_group("LLaVA's shapes (Megatron-LM's pretrain_vlm.py; stage 0 holds the ViT)"),
                        model_sizes=True)
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.add_argument("--curve", metavar="PNG", help="with several --buffer-limit values: draw speedup vs peak "
                                                   "memory per policy (default: next to --json)")
    p.add_argument("--timeline", metavar="PNG", help="draw every policy's timeline for the first seed")
    p.add_argument("--trace", metavar="JSON", help="Chrome/Perfetto trace of the first seed")
    p.add_argument("--optimal", action="store_true",
                   help="also the clairvoyant optimum per seed (CP-SAT; small layouts: pip install "
                        "megatron-rrfp[optimal]): each policy's makespan / optimum beside /LB")
    p.add_argument("--optimal-time-limit", type=_OPTIMAL_TIME.parse, default=10.0,
                   help="solver seconds per seed and limit; past it the best order found is reported, not proven")
    p.set_defaults(func=_run_simulate)


def _run_simulate(args: argparse.Namespace) -> int:
    from .curve import plot_tradeoff
    from .study import format_report, format_tradeoff, run_tradeoff, save_json, write_timeline
    from .variability import REFERENCE_J3

    limits = [int(part) if part.isdigit() else part
              for part in (p.strip() for p in str(args.buffer_limit).split(",")) if part]
    if not limits:
        raise ValueError(f"--buffer-limit must be {_STUDY['buffer_limit'].describe()} (or a comma list of them), "
                         f"got {args.buffer_limit!r}")
    for limit in limits:
        _STUDY["buffer_limit"].check("--buffer-limit", limit)

    knobs = dict(sigma_compute=args.sigma_compute, c50=args.c50, sigma_msg=args.sigma_msg)
    if args.reference:
        knobs.update(REFERENCE_J3)
    workload = workload_from_args(args)
    llava = llava_from_args(args, args.pp)
    if llava is not None:
        workload.update(straggler_stage=0, straggler_factor=llava.stage0_factor)
        print(f"LLaVA: {llava.image_tokens} image tokens per sample, decoder sequence {llava.decoder_seq_length}; "
              f"ViT + projection = {llava.encoder_share:.2f} of a decoder stage: stage 0 x{llava.stage0_factor:.2f}")
    variability = Variability(backward_ratio=args.backward_ratio, **workload, **knobs, task_times=args.task_times,
                              task_times_workload=args.task_times_workload)
    if variability.task_times is not None:
        from .measured import describe, load_task_times

        print(describe(load_task_times(variability.task_times, variability.task_times_workload)))
    config = StudyConfig(pipeline_size=args.pp, num_microbatches=args.microbatches, num_chunks=args.chunks,
                         policies=[p.strip() for p in args.policies.split(",") if p.strip()],
                         buffer_limit=limits[0], seeds=args.seeds, first_seed=args.first_seed,
                         variability=variability, baseline=args.baseline)
    if args.optimal:
        from .optimal import check_study

        check_study(config, limits)
    tradeoff = run_tradeoff(config, limits)
    if args.optimal:
        from .optimal import add_optimum

        add_optimum(config, tradeoff, time_limit_s=args.optimal_time_limit)
    single = len(limits) == 1
    print(format_report(tradeoff["studies"][0]) if single else format_tradeoff(tradeoff))
    if args.json:
        save_json(tradeoff["studies"][0] if single else tradeoff, args.json)
        print(f"figures: {args.json}")
    curve = args.curve or (args.json.rsplit(".", 1)[0] + "-curve.png" if args.json and not single else None)
    if curve:
        print(f"trade-off curve: {plot_tradeoff(tradeoff, curve)}")
    if args.timeline or args.trace:
        png = args.timeline or args.trace.rsplit(".", 1)[0] + ".png"
        write_timeline(config, png, trace_path=args.trace)
        print(f"timeline: {png}" + (f"  trace: {args.trace}" if args.trace else ""))
    return 0
