"""``TrainConfig``: every flag of ``megatron-rrfp train``, one field each.

The command line is generated from the fields (``megatron_rrfp.options``: flag = ``--`` +
name with dashes, help = the field's ``help``, type = its range in ``BOUNDS``), so the
dataclass and the parser cannot drift apart; the
``--pipeline-schedule`` / ``--rrfp-*`` fields come from ``megatron_lm.flags.add_rrfp_arguments``,
shared with the Megatron-LM integration. ``to_argv`` turns a config back into flags
(``--nproc`` uses it to start its ranks). ``validate`` raises ValueError quoting the
values, before any process starts.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
from dataclasses import dataclass
from typing import ClassVar, Optional, Union

from ..checks import Bound, bound, check_fields, integer
from ..mcore.config import DEFAULT_TIMEOUT_S
from ..megatron_lm.flags import add_rrfp_arguments, rrfp_config_from_args, validate_rrfp_arguments
from ..options import add_options, external, from_namespace, option
from ..options import flags as option_flags
from ..options import to_argv as options_to_argv
from ..policy.arbiter import DEFAULT_BUFFER_LIMIT, DEFAULT_HINT
from ..policy.budget import starting_limit
from .signals import EXIT_SIGNALS


def _flag(default, help: str, group: str, **kwargs):
    return option(default, help, group=group, **kwargs)


def _shared(default):  # defined by megatron_lm.flags.add_rrfp_arguments
    return external(default)


_SIZE = integer(1, 1 << 24)
_OPTIONAL_SIZE = integer(1, 1 << 24, optional=True)
BOUNDS: dict[str, Bound] = {
    **{name: _SIZE for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                                "tensor_model_parallel_size", "pipeline_model_parallel_size", "micro_batch_size",
                                "log_interval")},
    **{name: _OPTIONAL_SIZE for name in ("ffn_hidden_size", "vision_num_layers", "vision_hidden_size",
                                         "vision_num_attention_heads", "image_size", "patch_size", "tokens_per_image",
                                         "max_images", "save_interval", "global_batch_size")},
    "images_per_sample": bound(0, 1e3),
    "virtual_pipeline_model_parallel_size": _OPTIONAL_SIZE,
    "num_experts": integer(1, 1 << 16, optional=True), "expert_model_parallel_size": _SIZE,
    "moe_router_topk": _SIZE, "moe_aux_loss_coeff": bound(0, 1e3),
    "train_iters": integer(1, 10**9),
    "lr": bound(0, 1e3), "min_lr": bound(0, 1e3), "lr_warmup_iters": integer(0, 10**9),
    "weight_decay": bound(0, 1e3), "clip_grad": bound(0, 1e9),
    "seed": integer(0, 2**32 - 1),  # numpy's seed range
    "load_iteration": integer(0, 10**9, optional=True),
    "nproc": integer(1, 1024, optional=True),
    "tensorboard_log_interval": integer(1, 10**9), "timing_log_level": integer(0, 2),
    "distributed_timeout_minutes": bound(0, 7 * 24 * 60, low_open=True),  # a week, like --rrfp-timeout
}
"""Accepted range of every numeric flag (the --rrfp-* ones: megatron_lm/flags.py): the
argparse type of the flag and ``validate``'s first check."""


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    # model
    model: str = _flag("gpt", "gpt: megatron-core GPTModel (local spec); multimodal: the ViT + GPT recipe "
                       "(megatron_rrfp.recipes.multimodal); hybrid: megatron-core's HybridModel (>= 0.18) with "
                       "local layers (megatron_rrfp.mcore.hybrid_spec), layers from --hybrid-layer-pattern", "model",
                       choices=("gpt", "multimodal", "hybrid"))
    hybrid_layer_pattern: Optional[str] = _flag(None, "--model hybrid: one symbol per layer, * attention, - MLP, with "
                                                "| between pipeline stages (e.g. '*-*-|*-*-'); sets the layer count "
                                                "(--num-layers is not used)", "model", type=str)
    num_layers: Optional[int] = _flag(None, "decoder layers, split evenly over pipeline stages and their model "
                                      "chunks with --virtual-pipeline-model-parallel-size (default 4, rounded up to a "
                                      "multiple of PP x chunks)", "model", type=int)
    hidden_size: Optional[int] = _flag(None, "decoder width (default 64, or 16 per head where there are more heads)",
                                       "model", type=int)
    num_attention_heads: Optional[int] = _flag(None, "attention heads, divisible by the tensor-parallel size (default "
                                               "4, rounded up to a multiple of --tensor-model-parallel-size)",
                                               "model", type=int)
    ffn_hidden_size: Optional[int] = _flag(None, "MLP width (default 4 x hidden size)", "model", type=int)
    seq_length: int = _flag(64, "tokens per sample (images included for multimodal)", "model")
    vocab_size: Optional[int] = _flag(None, "vocabulary size, divisible by the tensor-parallel size (default 256, "
                                      "rounded up to a multiple of --tensor-model-parallel-size)", "model", type=int)
    vision_num_layers: Optional[int] = _flag(None, "multimodal: ViT layers (recipe default)", "model", type=int)
    vision_hidden_size: Optional[int] = _flag(None, "multimodal: ViT width; its MLP is 4x (recipe default)", "model",
                                              type=int)
    vision_num_attention_heads: Optional[int] = _flag(None, "multimodal: ViT heads (recipe default)", "model", type=int)
    image_size: Optional[int] = _flag(None, "multimodal: square image side in pixels (recipe default)", "model",
                                      type=int)
    patch_size: Optional[int] = _flag(None, "multimodal: ViT patch side in pixels (recipe default)", "model", type=int)
    tokens_per_image: Optional[int] = _flag(None, "multimodal: decoder positions per image; divides the patch count "
                                            "(recipe default)", "model", type=int)
    max_images: Optional[int] = _flag(None, "multimodal: cap on images per sample (recipe default)", "model", type=int)
    images_per_sample: float = _flag(1.0, "multimodal: mean images per sample (Poisson)", "model")
    # parallelism and batch
    tensor_model_parallel_size: int = _flag(1, "TP degree", "parallelism")
    pipeline_model_parallel_size: int = _flag(1, "PP degree; data parallelism takes the remaining ranks", "parallelism")
    virtual_pipeline_model_parallel_size: Optional[int] = _flag(
        None, "interleaving: model chunks per pipeline rank (--num-layers / (PP x chunks) layers each; rank r holds "
        "virtual stages r, r + PP, ...); Megatron-LM's --num-virtual-stages-per-pipeline-rank (also accepted) sets its "
        "args.virtual_pipeline_model_parallel_size; default: one chunk", "parallelism", type=int,
        aliases=("--num-virtual-stages-per-pipeline-rank",))
    micro_batch_size: int = _flag(2, "samples per micro-batch", "parallelism")
    global_batch_size: Optional[int] = _flag(None, "samples per iteration; micro-batches per iteration = global / "
                                             "(micro x DP) (default: 4 micro-batches per data-parallel rank)",
                                             "parallelism", type=int)
    # mixture of experts (Megatron-LM's flags; see builders.moe_options)
    num_experts: Optional[int] = _flag(None, "MoE: experts per MLP layer (SequentialMLP, local spec); default: dense",
                                       "mixture of experts", type=int)
    expert_model_parallel_size: int = _flag(1, "MoE: expert-parallel degree (divides the data-parallel size and "
                                            "--num-experts)", "mixture of experts")
    moe_router_topk: Optional[int] = _flag(None, "MoE: experts per token (default 2, at most --num-experts)",
                                           "mixture of experts", type=int)
    moe_token_dispatcher_type: str = _flag("allgather", "MoE: token dispatcher", "mixture of experts",
                                           choices=("allgather", "alltoall"))
    moe_aux_loss_coeff: float = _flag(0.0, "MoE: load-balancing aux-loss coefficient", "mixture of experts")
    overlap_moe_expert_parallel_comm: bool = _flag(
        False, "MoE: megatron-core's combined forward-backward step, one microbatch's all-to-alls beside another's "
        "compute (EP > 1, alltoall). Megatron's schedule: interleaved only (with PP > 1); rrfp pairs a ready "
        "forward with a ready backward, with or without interleaving. On CPU (fp32) the flag is set after "
        "megatron-core's bf16/fp16 check, which is about GPU kernels", "mixture of experts", action="store_true")
    delay_wgrad_compute: bool = _flag(
        False, "MoE: with --overlap-moe-expert-parallel-comm, each layer's weight gradients after its backward "
        "inside the combined step (megatron-core >= 0.19 with the local spec)", "mixture of experts",
        action="store_true")
    # production parallelism (Megatron-LM's names): one group, kept together
    sequence_parallel: bool = _flag(False, "Megatron-LM's --sequence-parallel: shard norms/dropout activations over "
                                    "TP (needs --tensor-model-parallel-size > 1)", "production parallelism",
                                    action="store_true")
    overlap_grad_reduce: bool = _flag(False, "Megatron-LM's --overlap-grad-reduce: DDP launches each bucket's "
                                      "reduction as its gradients complete (with rrfp's B/W split too)",
                                      "production parallelism", action="store_true")
    use_distributed_optimizer: bool = _flag(False, "Megatron-LM's --use-distributed-optimizer: optimizer state "
                                            "sharded over DP (gradients reduce-scattered)", "production parallelism",
                                            action="store_true")
    overlap_param_gather: bool = _flag(False, "Megatron-LM's --overlap-param-gather: the distributed optimizer's "
                                       "parameter all-gathers run in the next iteration's forwards (needs "
                                       "--use-distributed-optimizer and --overlap-grad-reduce)",
                                       "production parallelism", action="store_true")
    # optimisation
    train_iters: int = _flag(20, "iterations to train (the cosine decay spans them)", "optimizer")
    lr: float = _flag(1e-3, "peak learning rate (Adam)", "optimizer")
    min_lr: float = _flag(0.0, "learning rate at the end of the cosine decay (Megatron-LM's default)", "optimizer")
    lr_warmup_iters: int = _flag(0, "linear warmup from 0, in iterations (Megatron-LM's default)", "optimizer")
    weight_decay: float = _flag(0.01, "decoupled weight decay (constant)", "optimizer")
    clip_grad: float = _flag(1.0, "clip the global gradient norm to this (0: off)", "optimizer")
    seed: int = _flag(1234, "seed of weights, synthetic data and RNGs", "optimizer")
    # data, checkpoints, logging
    data_path: Optional[str] = _flag(None, "prefix of a Megatron indexed dataset (PREFIX.bin + PREFIX.idx), read by "
                                     "megatron-core's GPTDataset; default: synthetic data (python -m "
                                     "megatron_rrfp.train.data PREFIX writes a small one)", "data and checkpoints",
                                     type=str)
    data_cache_path: Optional[str] = _flag(None, "where GPTDataset caches its sample index (default: beside the data)",
                                           "data and checkpoints", type=str)
    save: Optional[str] = _flag(None, "checkpoint directory (also saved after the last iteration)",
                                "data and checkpoints", type=str)
    save_interval: Optional[int] = _flag(None, "save every N iterations", "data and checkpoints", type=int)
    load: Optional[str] = _flag(None, "resume from this checkpoint directory (if it holds one)", "data and checkpoints",
                                type=str)
    load_iteration: Optional[int] = _flag(None, "resume from this saved iteration instead of the latest",
                                          "data and checkpoints", type=int)
    ckpt_format: str = _flag("torch", "torch: per-rank torch.save files (same layout to resume); torch_dist: "
                             "megatron-core dist_checkpointing, Megatron-LM's format (--load reads either)",
                             "data and checkpoints", choices=("torch", "torch_dist"))
    exit_signal_handler: bool = _flag(False, "on --exit-signal save a checkpoint after the current iteration and exit "
                                      "0 (SLURM: #SBATCH --signal=USR1@120 with --exit-signal SIGUSR1)",
                                      "data and checkpoints", action="store_true")
    exit_signal: str = _flag("SIGTERM", "the signal --exit-signal-handler acts on", "data and checkpoints",
                             choices=EXIT_SIGNALS)
    # logging (Megatron-LM's flags and tag names; see train/metrics.py)
    log_interval: int = _flag(10, "print Megatron-LM's log line (iteration, loss, time per iteration, tokens/s, ...) "
                              "every N iterations (on the last rank)", "logging")
    tensorboard_dir: Optional[str] = _flag(None, "write TensorBoard scalars here (last rank)", "logging", type=str)
    tensorboard_log_interval: int = _flag(1, "TensorBoard / W&B scalars every N iterations", "logging")
    log_timers_to_tensorboard: bool = _flag(False, "also write iteration-time and every timer (<name>-time, the rrfp-* "
                                            "breakdown included)", "logging", action="store_true")
    log_memory_to_tensorboard: bool = _flag(False, "also write peak memory (mem-max-allocated-bytes on GPUs, "
                                            "mem-max-rss-bytes on CPU)", "logging", action="store_true")
    timing_log_level: int = _flag(0, "megatron-core timers: 0 (rrfp-* only), 1 (+ forward-backward, optimizer), "
                                  "2 (+ forward-compute, backward-compute)", "logging", choices=(0, 1, 2))
    wandb_project: Optional[str] = _flag(None, "log to this W&B project (last rank; WANDB_MODE=offline without "
                                         "network)", "logging", type=str)
    wandb_exp_name: Optional[str] = _flag(None, "W&B run name (needed with --wandb-project)", "logging", type=str)
    wandb_save_dir: Optional[str] = _flag(None, "W&B files go here (default SAVE/wandb)", "logging", type=str)
    bf16: bool = _flag(False, "bf16 weights and activations, fp32 main weights and gradient reduction (Megatron-LM's "
                       "--bf16)", "parallelism", action="store_true")
    # launching
    cpu: bool = _flag(False, "train on CPU over gloo (megatron-core bent to CPU by megatron_rrfp.cpu)",
                      "launching", action="store_true")
    nproc: Optional[int] = _flag(None, "start N local ranks, as torchrun --standalone --nproc-per-node N would "
                                 "(with --cpu forked from this process after one import of torch and megatron-core; "
                                 "on GPUs through torch's launcher, torch.distributed.run)",
                                 "launching", type=int)
    distributed_timeout_minutes: float = _flag(10.0, "timeout of collectives (Megatron-LM's flag); with "
                                               "--pipeline-schedule rrfp it must exceed --rrfp-timeout plus its "
                                               "margin: the default is then raised to that", "launching")
    # schedule: megatron_lm.flags.add_rrfp_arguments
    pipeline_schedule: str = _shared("1f1b")
    rrfp_hint: str = _shared(DEFAULT_HINT)
    rrfp_buffer_limit: Union[int, str] = _shared(DEFAULT_BUFFER_LIMIT)
    rrfp_strict: bool = _shared(False)
    rrfp_timeout: float = _shared(DEFAULT_TIMEOUT_S)
    rrfp_dp_overlap: str = _shared("auto")
    rrfp_trace_dir: Optional[str] = _shared(None)
    rrfp_goodput_ledger: Optional[str] = _shared(None)

    BOUNDS: ClassVar[dict[str, Bound]] = BOUNDS  # the ranges above: the types of the generated flags

    def __post_init__(self) -> None:
        """Defaults that depend on other flags, so that each default is valid whatever else is given."""
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        if self.num_layers is None:
            vpp = self.virtual_pipeline_model_parallel_size
            stages = pp * (vpp if isinstance(vpp, int) and vpp > 0 else 1) if isinstance(pp, int) and pp > 0 else 1
            self.num_layers = _round_up(4, stages)
        if self.num_attention_heads is None:
            self.num_attention_heads = _default_heads(tp if isinstance(tp, int) and tp > 0 else 1, self.hidden_size)
        if self.hidden_size is None:
            heads = self.num_attention_heads
            self.hidden_size = 64 if not isinstance(heads, int) or heads <= 0 or 64 % heads == 0 else 16 * heads
        if self.vocab_size is None:
            self.vocab_size = _round_up(256, tp) if isinstance(tp, int) and tp > 0 else 256
        if self.moe_router_topk is None:
            self.moe_router_topk = min(2, self.num_experts) if isinstance(self.num_experts, int) else 2


FLAGS = option_flags(TrainConfig)

TRAIN_HELP = {
    "rrfp_goodput_ledger": (
        "record goodput in this SQLite file: job start/end, every iteration (tokens, each rank's RRFP time "
        "breakdown gathered from all ranks, data wait), checkpoint saves and loads, restarts, and the error "
        "that stopped a run. Rank 0 writes it off the training thread; a ledger that cannot be written gives a "
        "LedgerWarning and training goes on; another live job writing the same file is an error at start. "
        "Pass the same path when resuming with --load: one report covers the whole job "
        "('megatron-rrfp goodput PATH'). Like every --rrfp-* flag, needs --pipeline-schedule rrfp", "PATH"),
}
"""--dest: (help, metavar) replacing megatron_lm.flags.add_rrfp_arguments' generic text in this driver's --help."""


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_options(parser, TrainConfig)
    add_rrfp_arguments(parser)
    for action in parser._actions:  # the shared flags, as this driver uses them
        if action.dest in TRAIN_HELP:
            action.help, action.metavar = TRAIN_HELP[action.dest]
    return parser


def from_args(args: argparse.Namespace) -> TrainConfig:
    config = from_namespace(TrainConfig, args)
    if config.model == "hybrid" and config.hybrid_layer_pattern:  # as Megatron-LM: the pattern sets the count
        from .hybrid import pattern_layers

        config = dataclasses.replace(config, num_layers=pattern_layers(config.hybrid_layer_pattern))
    validate(config)
    return config


def to_argv(config: TrainConfig, *, skip: tuple[str, ...] = ("nproc",)) -> list[str]:
    """The flags that reproduce ``config`` (only those that differ from the defaults)."""
    return options_to_argv(config, skip=skip)


def validate(c: TrainConfig, *, world_size: Optional[int] = None) -> None:
    """Raise ValueError naming the flag and the values; ``world_size`` adds the layout checks."""
    check_fields(c, BOUNDS, FLAGS)
    validate_rrfp_arguments(c, megatron_lm=False)
    tp, pp = c.tensor_model_parallel_size, c.pipeline_model_parallel_size
    _require(c.hidden_size % c.num_attention_heads == 0,
             f"--hidden-size {c.hidden_size} is not divisible by --num-attention-heads {c.num_attention_heads}")
    _require(c.num_attention_heads % tp == 0,
             f"--num-attention-heads {c.num_attention_heads} is not divisible by --tensor-model-parallel-size {tp}")
    _require(c.vocab_size % tp == 0,
             f"--vocab-size {c.vocab_size} is not divisible by --tensor-model-parallel-size {tp}")
    _require(c.model == "hybrid" or c.num_layers % pp == 0,
             f"--num-layers {c.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    _check_interleaving(c)
    _require(c.global_batch_size is None or c.global_batch_size % c.micro_batch_size == 0,
             f"--global-batch-size {c.global_batch_size} is not a multiple of --micro-batch-size {c.micro_batch_size}")
    _require(0 <= c.lr_warmup_iters < c.train_iters,
             f"--lr-warmup-iters {c.lr_warmup_iters} must be >= 0 and < --train-iters {c.train_iters}")
    _require(0.0 <= c.min_lr <= c.lr, f"need 0 <= --min-lr ({c.min_lr}) <= --lr ({c.lr})")
    _require(c.clip_grad >= 0.0 and c.weight_decay >= 0.0,
             f"--clip-grad ({c.clip_grad}) and --weight-decay ({c.weight_decay}) must be >= 0")
    _require(c.save_interval is None or c.save is not None, "--save-interval needs --save DIR")
    _require(c.load_iteration is None or c.load is not None, "--load-iteration needs --load DIR")
    _require(c.pipeline_schedule != "rrfp" or pp >= 2,
             f"--pipeline-schedule rrfp needs --pipeline-model-parallel-size >= 2 (got {pp}); "
             "with one stage there is nothing to order: use 1f1b")
    _require(c.rrfp_goodput_ledger is None or not os.path.isdir(c.rrfp_goodput_ledger),
             f"--rrfp-goodput-ledger {c.rrfp_goodput_ledger!r} is a directory; give the ledger file's path "
             "(e.g. DIR/goodput.db)")
    _require(c.wandb_project is None or bool(c.wandb_exp_name),
             "--wandb-project needs --wandb-exp-name NAME (the run's name, as in Megatron-LM)")
    _require(c.wandb_project is None or bool(c.wandb_save_dir or c.save),
             "--wandb-project needs --wandb-save-dir DIR (or --save DIR: then SAVE/wandb)")
    _require(c.tensorboard_log_interval >= 1,
             f"--tensorboard-log-interval must be >= 1, got {c.tensorboard_log_interval}")
    _require(not c.sequence_parallel or tp > 1,
             f"--sequence-parallel needs --tensor-model-parallel-size > 1 (got {tp})")
    _require(not c.sequence_parallel or c.model == "gpt", "--sequence-parallel is offered for --model gpt only")
    _require(not (c.bf16 and c.model == "multimodal"), "--bf16 is offered for --model gpt and hybrid only")
    _require(c.model != "multimodal" or c.data_path is None,
             "--data-path holds text tokens; --model multimodal trains on synthetic image+text batches only")
    _require(c.model != "multimodal" or importlib.util.find_spec("megatron_rrfp.train.recipes.multimodal") is not None,
             "--model multimodal needs megatron_rrfp.train.recipes.multimodal, which this installation lacks")
    if c.model == "multimodal":
        _check_multimodal(c)
    elif c.data_path is not None:  # every rank, before any collective (GPTDataset hangs on too few tokens)
        from .data import check_indexed_dataset

        check_indexed_dataset(c.data_path, c.seq_length)
    _check_moe(c)
    _require(c.model == "hybrid" or c.hybrid_layer_pattern is None, "--hybrid-layer-pattern needs --model hybrid")
    if c.model == "hybrid":
        from .hybrid import check_hybrid

        check_hybrid(c)
    if world_size is not None:
        check_layout(c, world_size)


def check_layout(c: TrainConfig, world_size: int) -> int:
    """The data-parallel size, or ValueError."""
    tp, pp = c.tensor_model_parallel_size, c.pipeline_model_parallel_size
    _require(world_size % (tp * pp) == 0,
             f"world size {world_size} is not divisible by TP x PP = {tp} x {pp}")
    dp = world_size // (tp * pp)
    if c.global_batch_size is None:  # the default, now that DP is known
        c.global_batch_size = 4 * c.micro_batch_size * dp
    _require(dp % c.expert_model_parallel_size == 0,
             f"--expert-model-parallel-size {c.expert_model_parallel_size} does not divide the data-parallel size {dp} "
             f"(world size {world_size} / TP x PP)")
    _require(c.global_batch_size % (c.micro_batch_size * dp) == 0,
             f"--global-batch-size {c.global_batch_size} is not divisible by --micro-batch-size x DP = "
             f"{c.micro_batch_size} x {dp}")
    microbatches = c.global_batch_size // (c.micro_batch_size * dp)
    _require(c.virtual_pipeline_model_parallel_size is None or microbatches >= pp,
             f"--virtual-pipeline-model-parallel-size: {microbatches} micro-batches per iteration (--global-batch-size "
             f"{c.global_batch_size} / (--micro-batch-size {c.micro_batch_size} x DP {dp})) is fewer than "
             f"--pipeline-model-parallel-size {pp}; Megatron's interleaved schedule needs at least one per stage")
    if c.pipeline_schedule == "rrfp":  # the hint checked against the real pipeline: a strict order that can
        from ..policy.plan import Plan  # never run fails here, not after every rank waited out --rrfp-timeout
        from ..policy.topology import Topology

        arbiter = rrfp_config_from_args(c).arbiter
        arbiter = dataclasses.replace(arbiter, buffer_limit=starting_limit(arbiter.buffer_limit))
        try:
            Plan.build(arbiter, Topology(pp, c.virtual_pipeline_model_parallel_size or 1), microbatches)
        except ValueError as exc:
            raise ValueError(f"--rrfp-hint {c.rrfp_hint} with --pipeline-model-parallel-size {pp} and {microbatches} "
                             f"micro-batches per iteration: {exc}") from None
    return dp


def _check_multimodal(c: TrainConfig) -> None:
    """The recipe's shape rules (image, patch and token sizes against --seq-length)."""
    import warnings

    with warnings.catch_warnings():  # megatron-core's import-time notes (no TE / apex) are not this error
        warnings.simplefilter("ignore")
        from .builders import multimodal_spec

    try:
        spec = multimodal_spec(c)
    except ValueError as exc:
        raise ValueError(f"--model multimodal: {exc} (flags --image-size, --patch-size, --tokens-per-image, "
                         "--max-images, --seq-length)") from None
    _require(spec.vision_num_attention_heads % c.tensor_model_parallel_size == 0,
             f"--vision-num-attention-heads {spec.vision_num_attention_heads} is not divisible by "
             f"--tensor-model-parallel-size {c.tensor_model_parallel_size}")


def _check_interleaving(c: TrainConfig) -> None:
    """--virtual-pipeline-model-parallel-size and --overlap-param-gather as Megatron-LM checks them."""
    vpp, pp = c.virtual_pipeline_model_parallel_size, c.pipeline_model_parallel_size
    _require(not c.overlap_param_gather or (c.use_distributed_optimizer and c.overlap_grad_reduce),
             "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce (as in Megatron-LM)")
    if vpp is None:
        return
    _require(pp >= 2, f"--virtual-pipeline-model-parallel-size needs --pipeline-model-parallel-size >= 2 (got {pp})")
    _require(c.model == "gpt", "--virtual-pipeline-model-parallel-size is offered for --model gpt only")
    _require(c.num_layers % (pp * vpp) == 0,
             f"--num-layers {c.num_layers} is not divisible by --pipeline-model-parallel-size x "
             f"--virtual-pipeline-model-parallel-size = {pp} x {vpp}")
    # checkpoints hold one stage per rank (train/checkpoint*.py); chunk lists are not written yet
    _require(c.save is None and c.load is None,
             "--virtual-pipeline-model-parallel-size with --save / --load is not supported by megatron-rrfp train "
             "yet (its checkpoints hold one model chunk per rank); drop --save/--load or the interleaving")


def _check_moe(c: TrainConfig) -> None:
    ep, experts = c.expert_model_parallel_size, c.num_experts
    if experts is None:
        _require(ep == 1, f"--expert-model-parallel-size {ep} needs --num-experts")
        return
    _require(c.model in ("gpt", "hybrid"), "--num-experts is offered for --model gpt and hybrid (E layers)")
    _require(experts % ep == 0, f"--num-experts {experts} is not divisible by --expert-model-parallel-size {ep}")
    _require(c.moe_router_topk <= experts, f"--moe-router-topk {c.moe_router_topk} exceeds --num-experts {experts}")
    _check_combined(c)


def _check_combined(c: TrainConfig) -> None:
    """--overlap-moe-expert-parallel-comm / --delay-wgrad-compute: megatron-core's own conditions (its
    TransformerConfig asserts them), and what each schedule can run."""
    overlap, pp = c.overlap_moe_expert_parallel_comm, c.pipeline_model_parallel_size
    _require(not c.delay_wgrad_compute or overlap,
             "--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm (megatron-core's rule)")
    if not overlap:
        return
    _require(c.expert_model_parallel_size > 1 and c.moe_token_dispatcher_type == "alltoall",
             "--overlap-moe-expert-parallel-comm needs --expert-model-parallel-size > 1 and "
             f"--moe-token-dispatcher-type alltoall (got {c.expert_model_parallel_size}, "
             f"{c.moe_token_dispatcher_type})")
    _require(c.model == "gpt", "--overlap-moe-expert-parallel-comm is offered for --model gpt")
    _require(c.cpu or c.bf16, "--overlap-moe-expert-parallel-comm needs --bf16 on a GPU (megatron-core's rule)")
    _require(c.pipeline_schedule == "rrfp" or pp < 2 or c.virtual_pipeline_model_parallel_size is not None,
             f"--overlap-moe-expert-parallel-comm with --pipeline-schedule {c.pipeline_schedule} and "
             f"--pipeline-model-parallel-size {pp} needs --virtual-pipeline-model-parallel-size (Megatron's combined "
             "1F1B exists only for its interleaved schedule); --pipeline-schedule rrfp pairs without it")
    _require(c.pipeline_schedule != "rrfp" or c.rrfp_hint not in ("bfw", "zbh1"),
             f"--rrfp-hint {c.rrfp_hint} places W tasks by its own order, which is not built for the pairs of "
             "--overlap-moe-expert-parallel-comm: use default (it pairs, and splits the backward where it can), "
             "bf or 1f1b")
    if c.delay_wgrad_compute:
        from megatron.core.tensor_parallel.layers import RowParallelLinear

        _require(hasattr(RowParallelLinear, "backward_dw"),
                 "--delay-wgrad-compute calls backward_dw() on every linear, which this megatron-core release "
                 "defines only for Transformer Engine's (train builds the local spec): drop --delay-wgrad-compute "
                 "or use megatron-core >= 0.19")


def _default_heads(tp: int, hidden: Optional[int]) -> int:
    """4 heads, rounded up to a multiple of TP; with --hidden-size given, the first such count that divides it."""
    first = _round_up(4, tp)
    if not isinstance(hidden, int) or hidden <= 0:
        return first
    return next((h for h in range(first, hidden + 1, tp) if hidden % h == 0), tp)


def _round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``value`` (the multiple itself when larger)."""
    return -(-value // multiple) * multiple


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
