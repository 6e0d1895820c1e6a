"""The ``--pipeline-schedule`` / ``--rrfp-*`` command-line flags, shared by the Megatron-LM
integration, the project's training driver and the benchmarks (one definition, one set
of checks, the same error messages everywhere)."""
from __future__ import annotations

import argparse
import math
import os
from typing import Optional

from ..checks import BUFFER_LIMIT, TIMEOUT_S
from ..mcore.compat import interleaved_layout_unverified
from ..mcore.config import DEFAULT_TIMEOUT_S, RRFPConfig, collective_timeout_floor_s
from ..mcore.dp_overlap import DP_OVERLAP_CHOICES
from ..policy.arbiter import DEFAULT_BUFFER_LIMIT, DEFAULT_HINT
from ..policy.hints import BUILTIN_HINTS, HintError
from ..policy.topology import Topology

PIPELINE_SCHEDULES = ("1f1b", "rrfp")


def _limit_text(text: str):
    """--rrfp-buffer-limit unchecked (Megatron-LM's parser): 16 as an int, '1.5x' as text."""
    return int(text) if text.strip().isdigit() else text.strip()


def add_rrfp_arguments(parser: argparse.ArgumentParser, *, check_types: bool = True) -> argparse.ArgumentParser:
    """Add the flags to ``parser`` (an argparse parser or Megatron-LM's). Returns it.

    ``check_types``: the numeric flags reject out-of-range values (nan, inf, 0) while
    parsing. Off for Megatron-LM's parser, whose errors print its several-hundred-flag
    usage: there ``validate_rrfp_arguments`` rejects them right after parsing, in one line."""
    buffer_type, timeout_type = (BUFFER_LIMIT.parse, TIMEOUT_S.parse) if check_types else (_limit_text, float)
    group = parser.add_argument_group("readiness-first pipeline schedule (megatron-rrfp)")
    group.add_argument("--pipeline-schedule", choices=PIPELINE_SCHEDULES, default="1f1b",
                       help="1f1b: Megatron's own schedules (unchanged). rrfp: the readiness-first executor.")
    group.add_argument("--rrfp-hint", default=DEFAULT_HINT,
                       help=f"hint order: {', '.join(BUILTIN_HINTS)} or a JSON / CSV hint file "
                            f"(default {DEFAULT_HINT})")
    group.add_argument("--rrfp-buffer-limit", type=buffer_type, default=DEFAULT_BUFFER_LIMIT,
                       help="activations in flight per stage before backpressure: an integer count of "
                            "(microbatch, chunk) forwards, a multiple of what Megatron's own schedule holds "
                            "('1x', '1.5x'), or 'auto' (from 1x, each stage grows into the memory measured free "
                            f"on its device; mcore/auto_limit.py); default {DEFAULT_BUFFER_LIMIT}")
    group.add_argument("--rrfp-strict", action="store_true",
                       help="run the hint as a fixed order (baseline in the same runtime)")
    group.add_argument("--rrfp-timeout", type=timeout_type, default=DEFAULT_TIMEOUT_S,
                       help=f"seconds without progress before a rank fails with a state dump "
                            f"(default {DEFAULT_TIMEOUT_S:g})")
    group.add_argument("--rrfp-dp-overlap", choices=DP_OVERLAP_CHOICES, default="auto",
                       help="with interleaving, DP > 1 and --overlap-grad-reduce / --overlap-param-gather on GPUs: "
                            "epochs (DP communication where Megatron issues it, at fixed points of each stage's "
                            "task order, replicas independent between them; the rounds transport), lockstep (in "
                            "the task loop, every DP replica of a stage in the agreement), after-loop (parameter "
                            "all-gathers before the task loop, reductions after it) or auto (epochs there; "
                            "default). A named choice applies on any device")
    group.add_argument("--rrfp-trace-dir", default=None,
                       help="write a Chrome/Perfetto trace of measured task timings per rank here")
    group.add_argument("--rrfp-goodput-ledger", default=None,
                       help="SQLite goodput ledger path (job, iteration, checkpoint events)")
    return parser


def validate_rrfp_arguments(args: argparse.Namespace, *, notes: Optional[list] = None,
                            megatron_lm: bool = True) -> Optional[RRFPConfig]:
    """Check the flags and build the executor options once (the hint parsed and kept).
    Returns the options when rrfp is selected, None for 1f1b. Raises ValueError naming
    the flag and the fix; no silent fallback. ``megatron_lm``: the flags are Megatron-LM's
    (False: ``megatron-rrfp train``'s, which builds its own TransformerConfig)."""
    schedule = getattr(args, "pipeline_schedule", "1f1b")
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"--pipeline-schedule {schedule!r}: choose one of {', '.join(PIPELINE_SCHEDULES)}")
    for flag in ("rrfp_trace_dir", "rrfp_goodput_ledger"):
        path = getattr(args, flag, None)
        if path:
            parent = path if flag == "rrfp_trace_dir" else (os.path.dirname(os.path.abspath(path)) or ".")
            if os.path.exists(parent) and not os.path.isdir(parent):
                raise ValueError(f"--{flag.replace('_', '-')} {path!r}: {parent!r} is not a directory")
    if schedule == "1f1b" and _rrfp_flags_set(args):
        raise ValueError("--rrfp-* flags were given but --pipeline-schedule is 1f1b; "
                         "add --pipeline-schedule rrfp (or drop the --rrfp-* flags)")
    config = rrfp_config_from_args(args)  # checks every value even for 1f1b: a typo never waits
    if schedule != "rrfp":
        return None
    check_megatron_layout(config, args)
    check_combined_steps(config, args, megatron_lm=megatron_lm)
    note = check_distributed_timeout(config, args)
    if note is not None and notes is not None:
        notes.append(note)
    return config


MEGATRON_DISTRIBUTED_TIMEOUT_MINUTES = 10
"""Megatron-LM's (and ``megatron-rrfp train``'s) default --distributed-timeout-minutes."""


def check_distributed_timeout(config: RRFPConfig, args) -> Optional[str]:
    """--distributed-timeout-minutes (NCCL's / gloo's timeout of Megatron's own groups: DP, TP,
    EP) must lie above --rrfp-timeout plus its margin (``collective_timeout_floor_s``), or a
    hung collective inside the task loop ends the process before RRFP's diagnosis prints.
    Left at Megatron-LM's default it is raised to that floor (returns the note saying so); set
    lower explicitly, it is refused. ``args`` without the flag (megatron-core only) is not checked."""
    minutes = getattr(args, "distributed_timeout_minutes", None)
    if not isinstance(minutes, (int, float)) or isinstance(minutes, bool):
        return None
    floor_s = collective_timeout_floor_s(config.timeout_s)
    if 60.0 * minutes >= floor_s:
        return None
    needed = math.ceil(floor_s / 60.0)
    if minutes == MEGATRON_DISTRIBUTED_TIMEOUT_MINUTES:
        args.distributed_timeout_minutes = type(minutes)(needed)
        return (f"megatron-rrfp: --distributed-timeout-minutes raised from Megatron-LM's default {minutes:g} to "
                f"{needed} (above --rrfp-timeout {config.timeout_s:g} s plus its margin), so RRFP's stall "
                "diagnosis prints before a collective's timeout")
    raise ValueError(f"--distributed-timeout-minutes {minutes:g} ({60 * minutes:g} s) is below --rrfp-timeout "
                     f"{config.timeout_s:g} s plus its margin ({floor_s:g} s in all): a hung collective would end "
                     f"the job before RRFP's diagnosis; pass --distributed-timeout-minutes {needed} or more, or a "
                     f"smaller --rrfp-timeout")


# Megatron-LM flags rrfp refuses (expert parallelism itself is supported: the agreement spans
# every stage rank that shares an all-to-all, see runtime/agreement.py).
REFUSED_FLAGS = {
    "moe_shared_expert_overlap": "the shared experts' side-stream overlap is not verified under rrfp",
    "use_megatron_fsdp": "FSDP all-gathers parameters over data-parallel ranks inside every forward and backward, "
                         "which rrfp's agreement does not span",
    "use_torch_fsdp2": "FSDP all-gathers parameters over data-parallel ranks inside every forward and backward, "
                       "which rrfp's agreement does not span",
    "moe_paged_stash": "the paged stash records the order of forward and backward passes in its first iterations "
                       "(reset by Megatron's own schedules) and prefetches stashed activations along that order "
                       "later, while rrfp's order changes from one iteration to the next; drop it or use "
                       "--pipeline-schedule 1f1b",
    "moe_expert_rank_capacity_factor": "Megatron-LM then wraps the schedule in PagedStashRunner (microbatches read "
                                       "ahead, the whole schedule rerun when HybridEP's static budget overflows), "
                                       "not verified under rrfp (HybridEP needs GPUs); drop it (dropless "
                                       "dispatch) or use --pipeline-schedule 1f1b",
}


def check_combined_steps(config: RRFPConfig, args, *, megatron_lm: bool = True) -> None:
    """--overlap-moe-expert-parallel-comm under rrfp: megatron-core's combined step for every F and B,
    a ready forward paired with a ready backward. Refused, in one line, where it cannot run: a named hint
    that places W tasks itself (bfw, zbh1); --delay-wgrad-compute on a megatron-core whose own (non-TE) linears lack
    backward_dw; under Megatron-LM a pipeline without virtual stages (megatron-core's TransformerConfig,
    which Megatron-LM builds from the flags, asserts them with this flag at PP > 1)."""
    if not getattr(args, "overlap_moe_expert_parallel_comm", False):
        return
    hint = config.arbiter.parsed_hint
    if hint.name != "default" and hint.split_backward:
        raise ValueError(f"--rrfp-hint {hint.name} places W tasks by its own order, which is not built for the pairs "
                         "of --overlap-moe-expert-parallel-comm: use --rrfp-hint default (it pairs, and splits the "
                         "backward where it can), bf or 1f1b")
    pp = getattr(args, "pipeline_model_parallel_size", None)
    virtual = any(getattr(args, name, None) is not None for name in (
        "virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
        "num_virtual_stages_per_pipeline_rank", "pipeline_model_parallel_layout"))
    if megatron_lm and isinstance(pp, int) and pp > 1 and not virtual:
        raise ValueError("--overlap-moe-expert-parallel-comm with --pipeline-schedule rrfp under Megatron-LM needs "
                         "--virtual-pipeline-model-parallel-size (or --num-layers-per-virtual-pipeline-stage) at "
                         "--pipeline-model-parallel-size > 1: megatron-core's TransformerConfig asserts it when "
                         "Megatron-LM builds the model; megatron-rrfp train pairs without virtual stages")
    if getattr(args, "delay_wgrad_compute", False) and getattr(args, "transformer_impl", "local") == "local":
        from megatron.core.tensor_parallel.layers import RowParallelLinear

        if not hasattr(RowParallelLinear, "backward_dw"):
            raise ValueError("--delay-wgrad-compute calls backward_dw() on every linear, which this megatron-core "
                             "release defines only for Transformer Engine's: use --transformer-impl "
                             "transformer_engine, megatron-core >= 0.19, or drop --delay-wgrad-compute")


def check_megatron_layout(config: RRFPConfig, args: argparse.Namespace) -> None:
    """What Megatron-LM's parsed flags already fix about the layout, checked before any
    process group exists (the schedule call checks again with the live groups)."""
    for flag, why in REFUSED_FLAGS.items():
        if getattr(args, flag, None) not in (None, False):
            raise ValueError(f"--pipeline-schedule rrfp does not support --{flag.replace('_', '-')}: {why}")
    pp = getattr(args, "pipeline_model_parallel_size", None)
    if not isinstance(pp, int) or pp >= 2:  # at PP=1 Megatron's own schedule runs: its CUDA graphs work
        check_cuda_graphs(args)
        check_layout(args, pp)
    if isinstance(pp, int) and pp >= 2:  # at PP=1 Megatron runs no pipeline schedule: the hint is unused
        try:
            config.arbiter.parsed_hint.orders(Topology(pp), 1)  # an explicit list must have one order per stage
        except HintError as exc:
            raise ValueError(f"--rrfp-hint: {exc}") from None


# What each CUDA graph implementation captures in a fixed order (Megatron-LM core_v0.16.1 - 0.19):
CUDA_GRAPH_REASONS = {
    "full_iteration": "Megatron-LM wraps the schedule in FullCudaGraphWrapper, which captures one iteration's "
                      "forward and backward passes as a single CUDA graph and replays that fixed order, while rrfp "
                      "picks each stage's next task at run time",
    "local": "megatron-core's per-layer graphs are captured per microbatch, in the first iteration's order, into "
             "one shared memory pool (created by Megatron's own schedules at their end) and must replay in that "
             "order, while rrfp's order changes from one iteration to the next",
    "transformer_engine": "Transformer Engine's per-layer graphs (TECudaGraphHelper) are captured for the order of "
                          "Megatron's own schedule table, with static buffers reused along that order, while rrfp's "
                          "order changes from one iteration to the next",
}


def cuda_graph_capture(args) -> tuple[str, str]:
    """(implementation, the flags that ask for it) of the training CUDA graphs Megatron-LM's parsed
    flags will build, before its validate_args resolves them: "none", "local" /
    "transformer_engine" (per layer) or "full_iteration" (the whole schedule). The deprecated
    spellings count as Megatron-LM resolves them: --enable-cuda-graph is local,
    --external-cuda-graph transformer_engine, a "full_iteration" scope the whole schedule (0.16.1:
    --cuda-graph-impl local --cuda-graph-scope full_iteration; 0.19: either scope flag, any impl)."""
    impl = getattr(args, "cuda_graph_impl", None) or "none"
    given = [f"--cuda-graph-impl {impl}"] if impl != "none" else []
    for flag, deprecated_impl in (("enable_cuda_graph", "local"), ("external_cuda_graph", "transformer_engine")):
        if getattr(args, flag, False) is True:
            impl = deprecated_impl
            given.append(f"--{flag.replace('_', '-')}")
    migrates = hasattr(args, "cuda_graph_modules")  # 0.19: a full_iteration scope selects the implementation
    for flag, name in (("cuda_graph_modules", "--cuda-graph-modules"), ("cuda_graph_scope_deprecated",
                                                                         "--cuda-graph-scope"),
                       ("cuda_graph_scope", "--cuda-graph-scope")):
        scopes = getattr(args, flag, None)
        scopes = scopes if isinstance(scopes, (list, tuple)) else [scopes]
        if any(getattr(scope, "name", scope) == "full_iteration" for scope in scopes) and (
                migrates or impl == "local"):
            impl = "full_iteration"
            given.append(f"{name} full_iteration")
    return impl, " ".join(dict.fromkeys(given))


def check_cuda_graphs(args) -> None:
    """Refuse training CUDA graphs under rrfp: every implementation Megatron-LM has captures work
    in an order fixed before the run (``CUDA_GRAPH_REASONS``). Inference-only graphs and
    --optimizer-cuda-graph (the optimizer step, after the schedule returns) are not refused."""
    impl, given = cuda_graph_capture(args)
    if impl in CUDA_GRAPH_REASONS:
        raise ValueError(f"--pipeline-schedule rrfp does not support {given}: {CUDA_GRAPH_REASONS[impl]}; "
                         "drop it (--cuda-graph-impl none) or use --pipeline-schedule 1f1b")


def check_layout(args, pp) -> None:
    """--pipeline-model-parallel-layout: the executor runs the chunks Megatron builds, whatever their
    layer counts; a layout with more stages than ranks (interleaved) only where that is verified
    (``compat.interleaved_layout_unverified``). A malformed layout is left to Megatron-LM's check."""
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    why = interleaved_layout_unverified()
    if not isinstance(layout, str) or not why or not isinstance(pp, int):
        return
    try:
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

        stages = PipelineParallelLayerLayout.get_num_stages_from_str(layout)
    except Exception:  # Megatron-LM's validate_args reports a malformed layout in its own words
        return
    if stages > pp:
        raise ValueError(f"--pipeline-schedule rrfp does not support --pipeline-model-parallel-layout {layout!r} "
                         f"({stages} stages on {pp} pipeline ranks): {why}; give one stage per rank, upgrade "
                         "megatron-core, or use --pipeline-schedule 1f1b")


def _rrfp_flags_set(args: argparse.Namespace) -> bool:
    defaults = add_rrfp_arguments(argparse.ArgumentParser(add_help=False)).parse_args([])
    return any(getattr(args, k, getattr(defaults, k)) != getattr(defaults, k)
               for k in vars(defaults) if k.startswith("rrfp_"))


def rrfp_config_from_args(args: argparse.Namespace) -> RRFPConfig:
    """The executor options the flags ask for; ValueError naming the flag on a bad value."""
    BUFFER_LIMIT.check("--rrfp-buffer-limit", args.rrfp_buffer_limit)
    TIMEOUT_S.check("--rrfp-timeout (seconds)", args.rrfp_timeout)
    try:
        return RRFPConfig.of(hint=args.rrfp_hint, buffer_limit=args.rrfp_buffer_limit, strict=args.rrfp_strict,
                             timeout_s=args.rrfp_timeout, record_spans=bool(getattr(args, "rrfp_trace_dir", None)),
                             dp_overlap=getattr(args, "rrfp_dp_overlap", "auto"))
    except HintError as exc:
        raise ValueError(f"--rrfp-hint: {exc}") from exc


def selected(args: Optional[argparse.Namespace]) -> bool:
    return args is not None and getattr(args, "pipeline_schedule", "1f1b") == "rrfp"
