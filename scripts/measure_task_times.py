#!/usr/bin/env python
"""Measure F, B, I and W of one pipeline stage of a real megatron-core model over many
microbatches, for ``megatron-rrfp simulate --task-times FILE`` to replay.

    python scripts/measure_task_times.py --device cuda --out task_times.json        # ~1 min on one GPU
    python scripts/measure_task_times.py --device cpu --hidden-size 64 --num-layers 1 --seq-length 64 \\
        --microbatches 40 --out task_times_cpu.json
    megatron-rrfp simulate --pp 8 -m 32 --task-times task_times.json --task-times-workload moe

Workloads (``--workloads``, any of them):

  gpt         a middle stage of megatron-core's GPTModel (local spec), fixed sequence length
  moe         the same with MoE layers: megatron-core's real top-k router and SequentialMLP
              experts (alltoall dispatcher, EP 1, no linear biases); each microbatch's hidden states share a
              random direction (``--moe-input-skew``), so the untrained router sends them to
              some experts more than others, as a batch from one domain does. Covariate: the
              expert load imbalance (the most loaded expert's tokens over the mean, worst layer)
  multimodal  the LLaVA-style recipe (train/recipes/multimodal.py): its first stage (ViT,
              projector, embedding, decoder layers) with Poisson(``--images-per-sample``)
              images per sample, capped at ``--max-images`` (covariate: images), and a middle
              decoder stage of the same model
  seqlen      the gpt stage with a sequence length per microbatch, log-uniform in
              [``--min-seq-length``, ``--seq-length``] (covariate: tokens)

Kinds, per microbatch, on the same input: F the forward; B the whole backward as Megatron's
1F1B runs it (megatron-core's ``backward_step``); then a second forward and the split
backward (``split.megatron_linear``, as the executor runs it): I the input-gradient half (under
``WeightGradStore.deferring``) and W the deferred weight-gradient half (``store.run``).
Each is timed on its own, the device idle before it: on CUDA with CUDA events (device time
between the two events on the stream, milliseconds), on CPU with the host's wall clock.
Peak activation memory (``runtime.memory.ActivationMeter``: the CUDA allocator, or the bytes
autograd saves on CPU) is taken on a warm-up microbatch of the largest size, unsplit (F+B)
and split (F+I+W, what I keeps alive for W included).

The JSON: ``{"format": "megatron-rrfp-task-times", "version": 1, "units": "ms",
"metadata": {...}, "workloads": {name: {"description", "stages": {role: {...}}}}}``; a role
("middle", and "first" for multimodal) holds "F", "B", "I", "W" (one time per microbatch, in
order), its covariate's name ("covariate") and values (under that name, per microbatch),
"shared_across_stages" (true when the covariate is the microbatch's data, the same on every
stage: tokens, images) and "peak_activation_mib" {"unsplit", "split"}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time

WORKLOADS = ("gpt", "moe", "multimodal", "seqlen")
KINDS = ("F", "B", "I", "W")
FORMAT = "megatron-rrfp-task-times"
# (cuda, cpu) defaults of the size flags: a minute on one H100 / a few minutes on two CPU cores
SIZE_DEFAULTS = {"hidden_size": (1024, 64), "num_layers": (2, 1), "seq_length": (2048, 128),
                 "img_h": (224, 16), "patch_dim": (14, 4), "microbatches": (100, 40)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: CUDA hidden from this process; cuda: the current CUDA device (default cpu)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--out", required=True, metavar="FILE", help="the JSON to write")
    p.add_argument("--microbatches", type=int, help="timed microbatches per workload (default 100 cuda, 40 cpu)")
    p.add_argument("--warmup", type=int, default=3, help="untimed microbatches first (default 3)")
    p.add_argument("--hidden-size", type=int, help="default 1024 cuda, 64 cpu")
    p.add_argument("--num-layers", type=int, help="decoder layers of the stage (default 2 cuda, 1 cpu)")
    p.add_argument("--num-attention-heads", type=int, default=0, help="default: hidden size / 64, at least 1")
    p.add_argument("--seq-length", type=int, help="default 2048 cuda, 128 cpu")
    p.add_argument("--min-seq-length", type=int, default=0, help="seqlen: shortest length (default seq / 8)")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--moe-router-topk", type=int, default=2)
    p.add_argument("--moe-input-skew", type=float, default=1.0,
                   help="moe: weight of each microbatch's shared random direction (0: i.i.d. tokens)")
    p.add_argument("--encoder-num-layers", type=int, default=2, help="multimodal: ViT layers")
    p.add_argument("--img-h", type=int, help="multimodal: square image side (default 224 cuda, 16 cpu)")
    p.add_argument("--patch-dim", type=int, help="multimodal: patch side (default 14 cuda, 4 cpu)")
    p.add_argument("--images-per-sample", type=float, default=1.5, help="multimodal: Poisson mean")
    p.add_argument("--max-images", type=int, default=4, help="multimodal: cap per sample")
    p.add_argument("--bf16", action="store_true", help="bf16 parameters and activations (default fp32)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    for name, (on_cuda, on_cpu) in SIZE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, on_cuda if cuda else on_cpu)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(args.workloads) - set(WORKLOADS))
    if unknown or not args.workloads:
        p.error(f"--workloads must be a comma list of {', '.join(WORKLOADS)}, got {unknown or 'nothing'}")
    for name in ("microbatches", "hidden_size", "num_layers", "seq_length", "micro_batch_size", "num_experts",
                 "moe_router_topk", "encoder_num_layers", "img_h", "patch_dim", "max_images"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 1:
        p.error(f"--warmup must be >= 1 (its first microbatch measures memory), got {args.warmup}")
    args.heads = args.num_attention_heads or max(1, args.hidden_size // 64)
    if args.hidden_size % args.heads:
        p.error(f"--hidden-size {args.hidden_size} must be a multiple of --num-attention-heads {args.heads}")
    if args.moe_router_topk > args.num_experts:
        p.error(f"--moe-router-topk {args.moe_router_topk} must be <= --num-experts {args.num_experts}")
    args.min_seq_length = args.min_seq_length or max(1, args.seq_length // 8)
    if not 1 <= args.min_seq_length <= args.seq_length:
        p.error(f"--min-seq-length must be in [1, --seq-length {args.seq_length}], got {args.min_seq_length}")
    if args.img_h % args.patch_dim:
        p.error(f"--img-h {args.img_h} must be a multiple of --patch-dim {args.patch_dim}")
    if "multimodal" in args.workloads and args.max_images * (args.img_h // args.patch_dim) ** 2 >= args.seq_length:
        p.error(f"--max-images x patches per image = {args.max_images} x {(args.img_h // args.patch_dim) ** 2} "
                f"leaves no text in --seq-length {args.seq_length}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":  # before torch initialises CUDA: a CPU run on a GPU host stays on CPU
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from megatron_rrfp.quiet import announce, for_entry_point

    with for_entry_point(announce=True):  # megatron-core's import notes as one line, as the CLI prints them
        announce()
        result = measure(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(table(result))
    print(f"task times: {args.out}")
    return 0


# --------------------------------------------------------------------------- timing


class Timer:
    """Times one task with the device idle before it: CUDA events (device milliseconds
    between them on the current stream) or the host's wall clock on CPU."""

    def __init__(self, device) -> None:
        import torch

        self.torch, self.cuda = torch, device.type == "cuda"

    def __call__(self, fn):
        torch = self.torch
        if not self.cuda:
            start = time.perf_counter()
            result = fn()
            return result, 1e3 * (time.perf_counter() - start)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        return result, start.elapsed_time(end)


class Microbatch:
    """One microbatch's inputs for a stage: ``forward()`` runs megatron-core's forward step
    on a fresh copy of them and returns (input tensor or None, output)."""

    def __init__(self, stage, forward_step, batch, hidden, output_grad, covariate: float) -> None:
        self.stage, self.forward_step, self.batch = stage, forward_step, batch
        self.hidden, self.output_grad, self.covariate = hidden, output_grad, covariate

    def forward(self):
        hidden = self.hidden.clone().requires_grad_() if self.hidden is not None else None
        self.stage.set_input_tensor(hidden)
        output, _loss = self.forward_step(iter([self.batch] if self.batch is not None else []), self.stage)
        return hidden, output


class StageTimer:
    """F, B, I, W of one stage: Megatron's forward/backward steps and rrfp's B/W split."""

    def __init__(self, stage, device) -> None:
        from megatron_rrfp.mcore import compat
        from megatron_rrfp.split import megatron_linear as wgrad

        self.stage, self.device, self.compat = stage, device, compat
        self.config = compat.get_model_config(stage)
        self.model_type = compat.model_type(stage)
        wgrad.install([stage])  # outside ``deferring`` the linears run megatron-core's own backward
        self.store = wgrad.WeightGradStore()
        self.wgrad = wgrad
        self.timer = Timer(device)

    def _forward(self, mb: Microbatch):
        hidden, out = mb.forward()
        self.compat.deallocate_output_tensor(out, self.config.deallocate_pipeline_outputs)
        return hidden, out

    def _backward(self, mb: Microbatch, hidden, out) -> None:
        self.compat.backward_step([hidden], [out], [mb.output_grad], self.model_type, self.config)

    def cycle(self, mb: Microbatch, key) -> dict:
        (hidden, out), f = self.timer(lambda: self._forward(mb))
        _, b = self.timer(lambda: self._backward(mb, hidden, out))
        hidden, out = self._forward(mb)

        def split_backward():
            with self.store.deferring(key):
                self._backward(mb, hidden, out)
        _, i = self.timer(split_backward)
        _, w = self.timer(lambda: self.store.run(key))
        return {"F": f, "B": b, "I": i, "W": w}

    def peak_activation_mib(self, mb: Microbatch, key) -> dict:
        """Peak activation memory of F+B and of F+I+W on this microbatch (MiB), and how it was read."""
        from megatron_rrfp.runtime.memory import ActivationMeter, model_tensors

        meter = ActivationMeter(self.device, persistent=model_tensors([self.stage]), reset_peak=True)
        store = self.wgrad.WeightGradStore(memory=meter)
        with meter:
            hidden, out = self._forward(mb)
            self._backward(mb, hidden, out)
        unsplit = meter.peak_bytes
        with meter:
            hidden, out = self._forward(mb)
            with store.deferring(key):
                self._backward(mb, hidden, out)
            store.run(key)
        return {"unsplit": unsplit / 2**20, "split": meter.peak_bytes / 2**20, "method": meter.method}


def time_role(stage, microbatches: list, warmup: Microbatch, device, desc: str, observe=None) -> dict:
    """Every kind's time per microbatch (ms), in order, and the peak activation memory;
    ``observe()``, if given, is called before and after each microbatch's tasks (a covariate the
    tasks produce, read after the timing: reading it is a host sync), its values under "observed"."""
    from tqdm import tqdm

    timer = StageTimer(stage, device)
    stage.zero_grad(set_to_none=True)
    memory = timer.peak_activation_mib(warmup, key=(0, 0))
    times, observed = {kind: [] for kind in KINDS}, []
    for index, mb in enumerate(tqdm(microbatches, desc=desc, leave=False)):
        if observe:
            observe()
        for kind, ms in timer.cycle(mb, key=(index, 0)).items():
            times[kind].append(ms)
        if observe:
            observed.append(observe())
    return {**times, "peak_activation_mib": {"unsplit": memory["unsplit"], "split": memory["split"]},
            "memory_method": memory["method"], **({"observed": observed} if observe else {})}


# --------------------------------------------------------------------------- workloads


class Setup:
    """What every workload shares: device, dtype, generator, the stage config's sizes."""

    def __init__(self, args) -> None:
        import torch

        self.args, self.torch = args, torch
        self.device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" \
            else torch.device("cpu")
        self.dtype = torch.bfloat16 if args.bf16 else torch.float32
        self.generator = torch.Generator().manual_seed(args.seed)

    def config(self, **overrides):
        from megatron_rrfp.train import models

        a = self.args
        return models.tiny_gpt_config(num_layers=a.num_layers, hidden_size=a.hidden_size,
                                      num_attention_heads=a.heads, ffn_hidden_size=4 * a.hidden_size,
                                      params_dtype=self.dtype, pipeline_dtype=self.dtype, bf16=a.bf16, **overrides)

    def place(self, stage):
        return stage.to(device=self.device, dtype=self.dtype)  # as Float16Module casts

    def randn(self, *shape):
        return self.torch.randn(shape, generator=self.generator).to(self.device, self.dtype)

    def hidden_pair(self, seq: int, skew: float = 0.0):
        """A stage input [seq, b, h] and an output gradient of the same shape; ``skew`` adds one
        random direction shared by every token of the microbatch."""
        a = self.args
        hidden = self.randn(seq, a.micro_batch_size, a.hidden_size)
        if skew:
            hidden = hidden + skew * self.randn(1, 1, a.hidden_size)
        return hidden, self.randn(seq, a.micro_batch_size, a.hidden_size)


def gpt_stage(setup: Setup, **config_overrides):
    from megatron_rrfp.train import models

    config = setup.config(**config_overrides)
    stage = models.build_gpt_stage(config, vocab_size=128, seq_length=setup.args.seq_length, seed=setup.args.seed,
                                   pre_process=False, post_process=False)
    return setup.place(stage), models.gpt_forward_step


def middle_microbatches(setup: Setup, stage, forward_step, lengths: list, skew: float = 0.0) -> list:
    out = []
    for seq in lengths:
        hidden, grad = setup.hidden_pair(seq, skew)
        out.append(Microbatch(stage, forward_step, None, hidden, grad, float(seq * setup.args.micro_batch_size)))
    return out


def measure_gpt(setup: Setup) -> dict:
    a = setup.args
    stage, step = gpt_stage(setup)
    mbs = middle_microbatches(setup, stage, step, [a.seq_length] * (a.microbatches + a.warmup))
    role = time_role(stage, mbs[a.warmup:], mbs[0], setup.device, "gpt")
    return {"description": f"a middle GPT stage, {a.num_layers} layers, seq {a.seq_length}",
            "stages": {"middle": {**role, "covariate": "tokens", "tokens": [mb.covariate for mb in mbs[a.warmup:]],
                                  "shared_across_stages": True}}}


def measure_seqlen(setup: Setup) -> dict:
    a = setup.args
    stage, step = gpt_stage(setup)
    rng = setup.torch.Generator().manual_seed(a.seed + 17)
    low, high = math.log(a.min_seq_length), math.log(a.seq_length)
    lengths = [max(1, round(math.exp(low + (high - low) * float(u))))
               for u in setup.torch.rand(a.microbatches, generator=rng)]
    mbs = middle_microbatches(setup, stage, step, [a.seq_length] * a.warmup + lengths)  # warm-up: the longest
    role = time_role(stage, mbs[a.warmup:], mbs[0], setup.device, "seqlen")
    return {"description": f"a middle GPT stage, {a.num_layers} layers, sequence length log-uniform in "
                           f"[{a.min_seq_length}, {a.seq_length}]",
            "stages": {"middle": {**role, "covariate": "tokens", "tokens": [mb.covariate for mb in mbs[a.warmup:]],
                                  "shared_across_stages": True}}}


class RouterLoads:
    """Tokens per expert of every router call (forward hooks on megatron-core's TopKRouter),
    kept on the device until read: reading them is a host sync, done after the timing."""

    def __init__(self, stage) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.loads = []
        for module in stage.modules():
            if isinstance(module, TopKRouter):
                module.register_forward_hook(self._hook)

    def _hook(self, _module, _inputs, output) -> None:
        routing_map = output[1]  # [tokens, experts] bool, in 0.16 and 0.19
        self.loads.append(routing_map.sum(dim=0))

    def imbalance(self) -> float:
        """Worst layer's most loaded expert over its mean load since the last call (1.0 = balanced;
        NaN when no router ran); clears the record."""
        worst = max((float(load.max()) / max(float(load.float().mean()), 1e-9) for load in self.loads),
                    default=math.nan)
        self.loads.clear()
        return worst


def measure_moe(setup: Setup) -> dict:
    from megatron_rrfp.train import models

    a = setup.args
    stage, step = gpt_stage(setup, **models.moe_fields(num_experts=a.num_experts, expert_parallel=1,
                                                       topk=a.moe_router_topk, dispatcher="alltoall",
                                                       aux_loss_coeff=0.01),
                             moe_ffn_hidden_size=4 * a.hidden_size,
                             add_bias_linear=False)  # as most MoE LLMs (biased SequentialMLP experts add
    # their bias in place on a view of their output: autograd refuses it, megatron-core 0.16.1 with torch 2.13)
    loads = RouterLoads(stage)
    mbs = middle_microbatches(setup, stage, step, [a.seq_length] * (a.microbatches + a.warmup), a.moe_input_skew)
    # both forwards of a cycle route the same tokens with the same weights: the same loads
    role = time_role(stage, mbs[a.warmup:], mbs[0], setup.device, "moe", observe=loads.imbalance)
    imbalance = role.pop("observed")
    return {"description": f"a middle MoE GPT stage, {a.num_layers} layers, {a.num_experts} experts, top-"
                           f"{a.moe_router_topk}, seq {a.seq_length}, input skew {a.moe_input_skew}",
            "stages": {"middle": {**role, "covariate": "expert_imbalance",
                                  "expert_imbalance": imbalance, "shared_across_stages": False}}}


def measure_multimodal(setup: Setup) -> dict:
    from megatron_rrfp.train.recipes import multimodal

    a = setup.args
    patches = (a.img_h // a.patch_dim) ** 2
    spec = multimodal.MultimodalSpec(vision_num_layers=a.encoder_num_layers, vision_hidden_size=a.hidden_size,
                                     vision_num_attention_heads=a.heads, vision_ffn_hidden_size=4 * a.hidden_size,
                                     image_size=a.img_h, patch_size=a.patch_dim, tokens_per_image=patches,
                                     max_images=a.max_images, vocab_size=128, seq_length=a.seq_length)
    config = multimodal.multimodal_config(num_layers=a.num_layers, hidden_size=a.hidden_size,
                                          num_attention_heads=a.heads, ffn_hidden_size=4 * a.hidden_size,
                                          params_dtype=setup.dtype, pipeline_dtype=setup.dtype, bf16=a.bf16)
    first = setup.place(multimodal.build_multimodal_stage(config, spec, seed=a.seed, pre_process=True,
                                                          post_process=False))
    batches = multimodal.synthetic_multimodal_batches(spec, seed=a.seed, micro_batch_size=a.micro_batch_size,
                                                      images_per_sample_mean=a.images_per_sample)

    def on_device(batch):
        return {k: v.to(setup.device, setup.dtype) if v.is_floating_point() else v.to(setup.device)
                for k, v in batch.items()}

    def first_microbatch(batch):
        _, grad = setup.hidden_pair(a.seq_length)
        return Microbatch(first, multimodal.multimodal_forward_step, on_device(batch), None, grad,
                          float(sum(multimodal.image_counts(batch))))

    timed = [first_microbatch(next(batches)) for _ in range(a.microbatches)]
    largest = next(batches)
    largest["num_images"].fill_(a.max_images)  # the warm-up: every sample at the cap
    largest["images"] = setup.torch.randn(largest["images"].shape, generator=setup.generator)
    warmup = first_microbatch(largest)
    first_role = time_role(first, timed, warmup, setup.device, "multimodal first stage")
    middle = setup.place(multimodal.build_multimodal_stage(config, spec, seed=a.seed, pre_process=False,
                                                           post_process=False))
    mbs = middle_microbatches(setup, middle, multimodal.multimodal_forward_step,
                              [a.seq_length] * (a.microbatches + 1))
    middle_role = time_role(middle, mbs[1:], mbs[0], setup.device, "multimodal middle stage")
    return {"description": f"LLaVA-style: first stage ViT ({a.encoder_num_layers} layers, {patches} patches per "
                           f"{a.img_h}px image, Poisson({a.images_per_sample}) images per sample, at most "
                           f"{a.max_images}) + projector + {a.num_layers} decoder layers; middle stage "
                           f"{a.num_layers} decoder layers; seq {a.seq_length}",
            "stages": {"first": {**first_role, "covariate": "images", "images": [mb.covariate for mb in timed],
                                 "shared_across_stages": True},
                       "middle": {**middle_role, "covariate": "tokens",
                                  "tokens": [mb.covariate for mb in mbs[1:]], "shared_across_stages": True}}}


MEASURE = {"gpt": measure_gpt, "moe": measure_moe, "multimodal": measure_multimodal, "seqlen": measure_seqlen}


def measure(args) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from megatron_rrfp.mcore import compat

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("measure_task_times: --device cuda, but torch sees no CUDA device (use --device cpu)")
    if not cuda:
        from megatron_rrfp.cpu import enable_cpu_reference_schedules

        enable_cpu_reference_schedules()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        if cuda:
            tensor_parallel.model_parallel_cuda_manual_seed(args.seed)  # attention enters the CUDA RNG tracker
        setup = Setup(args)
        started = time.perf_counter()
        workloads = {name: MEASURE[name](setup) for name in args.workloads}
        elapsed = time.perf_counter() - started
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return {
        "format": FORMAT, "version": 1, "units": "ms",
        "kinds": {"F": "forward", "B": "the whole backward (1F1B's backward_step)",
                  "I": "input-gradient half of the split backward", "W": "its deferred weight-gradient half"},
        "metadata": {
            "device": args.device,
            "device_name": torch.cuda.get_device_name() if cuda else (platform.processor() or platform.machine()),
            "timer": "cuda events (device time)" if cuda else "wall clock (perf_counter)",
            "cpu_threads": torch.get_num_threads(), "torch": torch.__version__,
            "megatron_core": str(compat.MEGATRON_CORE_VERSION), "python": platform.python_version(),
            "dtype": "bfloat16" if args.bf16 else "float32",
            "sizes": {k: getattr(args, k) for k in ("hidden_size", "num_layers", "seq_length", "min_seq_length",
                                                    "micro_batch_size", "num_experts", "moe_router_topk",
                                                    "moe_input_skew", "encoder_num_layers", "img_h", "patch_dim",
                                                    "images_per_sample", "max_images")} | {"heads": args.heads},
            "microbatches": args.microbatches, "warmup": args.warmup, "seed": args.seed,
            "seconds": round(elapsed, 1), "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "command": " ".join(sys.argv),
        },
        "workloads": workloads,
    }


# --------------------------------------------------------------------------- report


def spread(values) -> float:
    """(p95 - p5) / p50, the paper's measure of variability."""
    ordered = sorted(values)

    def quantile(q):
        position = q * (len(ordered) - 1)
        low = math.floor(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
    p50 = quantile(0.5)
    return (quantile(0.95) - quantile(0.05)) / p50 if p50 else math.nan


def table(result: dict) -> str:
    m = result["metadata"]
    lines = [f"{m['device_name']} ({m['device']}, {m['timer']}), torch {m['torch']}, megatron-core "
             f"{m['megatron_core']}, {m['dtype']}, {m['microbatches']} microbatches per workload, {m['seconds']} s",
             f"{'workload/stage':<22}" + "".join(f"{k + ' p50 ms':>11}{'spread':>8}" for k in KINDS)
             + f"{'I+W / B':>9}{'peak MiB F+B / F+I+W':>22}  covariate (min..max)"]
    for name, workload in result["workloads"].items():
        for role, t in workload["stages"].items():
            cells = "".join(f"{statistics.median(t[k]):>11.3f}{spread(t[k]):>8.2f}" for k in KINDS)
            ratio = statistics.median(t["I"]) + statistics.median(t["W"])
            cov = t[t["covariate"]]
            peak = t["peak_activation_mib"]
            lines.append(f"{name + '/' + role:<22}{cells}{ratio / statistics.median(t['B']):>9.2f}"
                         f"{peak['unsplit']:>11.1f} / {peak['split']:<8.1f}  {t['covariate']} "
                         f"{min(cov):.3g}..{max(cov):.3g}")
    lines.append("spread = (p95 - p5) / p50 over the microbatches")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
