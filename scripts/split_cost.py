#!/usr/bin/env python
"""What the B/W split costs one pipeline stage, measured on this host's device (CUDA if present).

    python scripts/split_cost.py [--device auto|cpu|cuda] [--hidden-size 4096] [--num-layers 2]
        [--seq-length 2048] [--micro-batch-size 1] [--microbatches 4] [--repeats 5] [--bf16] [--json PATH]

A middle stage of megatron-core's GPTModel (local spec: the linears rrfp's split defers), in
one process, no pipeline around it, on ``--device`` (``auto``: CUDA where a GPU is visible,
said in the first line; ``cuda`` refuses without one). Per microbatch, the device synchronised around each phase:

  F, B      megatron-core's forward and backward_step (weight gradients in B), as Megatron's
            1F1B runs them; before rrfp's split is installed
  F'        the forward once ``split.megatron_linear.install`` has prepared the linears
  B'        the same backward under ``WeightGradStore.deferring``: input gradients only
  W         ``WeightGradStore.run``: the stashed weight gradients

The split's own cost is (B' + W) - B, and F' - F for the forward. On CUDA each phase's peak
memory above what was allocated when it began is reported too, and ``stash`` is what B' keeps
alive until W (``pending_bytes``): the activation memory the split adds over 1F1B. Both paths'
gradients are compared. Not in these figures: the executor's work between tasks (bench's
breakdown has it) and fused kernels (fusions are off: the stage is built as on CPU).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=4096)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-attention-heads", type=int, default=0, help="default: hidden size / 128")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=4, help="per repeat")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats, after one warm-up")
    parser.add_argument("--bf16", action="store_true", help="bf16 parameters and activations")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: CUDA where a GPU is visible, else the CPU")
    parser.add_argument("--json", metavar="PATH", help="also write the figures here")
    args = parser.parse_args(argv)
    heads = args.num_attention_heads or max(1, args.hidden_size // 128)
    for name in ("hidden_size", "num_layers", "seq_length", "micro_batch_size", "microbatches", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.hidden_size % heads:
        parser.error(f"--hidden-size {args.hidden_size} must be a multiple of --num-attention-heads {heads}")
    import torch

    visible = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if args.device == "cuda" and not visible:
        parser.error("--device cuda: no CUDA device is visible here (torch.cuda.is_available() is False); "
                     "use --device cpu")
    args.cuda = args.device == "cuda" or (args.device == "auto" and visible)

    from megatron_rrfp.quiet import announce, for_entry_point

    with for_entry_point(announce=True):  # megatron-core's import notes as one line, as the CLI prints them
        announce()
        figures = measure(args, heads)
    print(table(figures))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=1)
    return 0 if figures["max_rel_grad_diff"] <= figures["tolerance"] else 1


def measure(args, heads: int) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from megatron_rrfp.mcore import compat
    from megatron_rrfp.split import megatron_linear as wgrad
    from megatron_rrfp.train import models

    cuda = args.cuda
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        from megatron_rrfp.cpu import enable_cpu_reference_schedules

        enable_cpu_reference_schedules()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    if cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(1)  # attention enters the CUDA RNG tracker
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    config = models.tiny_gpt_config(num_layers=args.num_layers, hidden_size=args.hidden_size,
                                    num_attention_heads=heads, ffn_hidden_size=4 * args.hidden_size,
                                    params_dtype=dtype, pipeline_dtype=dtype, bf16=args.bf16)
    stage = models.build_gpt_stage(config, vocab_size=128, seq_length=args.seq_length, seed=1,
                                   pre_process=False, post_process=False)
    stage = stage.to(device=device, dtype=dtype)  # as Float16Module casts
    model_type = compat.model_type(stage)
    shape = (args.seq_length, args.micro_batch_size, args.hidden_size)
    generator = torch.Generator().manual_seed(3)
    inputs = [torch.randn(shape, generator=generator).to(device, dtype) for _ in range(args.microbatches)]
    output_grads = [torch.randn(shape, generator=generator).to(device, dtype) for _ in range(args.microbatches)]
    mask = torch.triu(torch.ones(args.seq_length, args.seq_length, dtype=torch.bool, device=device), 1)[None, None]
    phases = {name: [] for name in ("F", "B", "F'", "B'", "W")}
    peaks = {name: 0 for name in phases}
    stash = []

    def timed(name, fn):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        result = fn()
        if cuda:
            torch.cuda.synchronize()
            peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated() - before)
        phases[name].append(time.perf_counter() - start)
        return result

    def one_repeat(split: bool, store, record: bool) -> list:
        stage.zero_grad(set_to_none=True)
        input_grads = []
        for mb in range(args.microbatches):
            hidden = inputs[mb].clone().requires_grad_()

            def forward(hidden=hidden):
                stage.set_input_tensor(hidden)
                out = stage(None, None, mask)
                compat.deallocate_output_tensor(out, config.deallocate_pipeline_outputs)
                return out

            def backward(out, hidden=hidden, mb=mb):
                compat.backward_step([hidden], [out], [output_grads[mb]], model_type, config)

            def split_backward(out, mb=mb):
                with store.deferring((mb, 0)):
                    backward(out)
                return store.pending_bytes()

            out = timed("F'" if split else "F", forward)
            if split:
                stash.append(timed("B'", lambda out=out: split_backward(out)))
                timed("W", lambda mb=mb: store.run((mb, 0)))
            else:
                timed("B", lambda out=out: backward(out))
            input_grads.append(hidden.grad.detach().clone())
        if not record:  # the warm-up: its first-call allocations (cuBLAS workspaces) are no phase's peak
            for name in ("F'", "B'", "W") if split else ("F", "B"):
                phases[name].clear()
                peaks[name] = 0
            stash.clear()
        return input_grads

    def run(split: bool, store=None):
        for repeat in range(1 + args.repeats):
            input_grads = one_repeat(split, store, record=repeat > 0)
        grads = {n: p.grad.detach().clone() for n, p in stage.named_parameters() if p.grad is not None}
        return grads, input_grads

    reference, reference_inputs = run(split=False)
    wgrad.install([stage])
    store = wgrad.WeightGradStore()
    split_grads, split_inputs = run(split=True, store=store)

    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))

    missing = sorted(set(reference) ^ set(split_grads))
    if missing:
        raise SystemExit(f"the split path's gradients differ in which parameters have one: {missing}")
    diffs = [rel(split_grads[n], g) for n, g in reference.items()] + [
        rel(a, b) for a, b in zip(split_inputs, reference_inputs)]
    median_ms = {name: 1e3 * statistics.median(times) for name, times in phases.items()}
    dist.destroy_process_group()
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "megatron_core": str(compat.MEGATRON_CORE_VERSION),
        "hidden_size": args.hidden_size, "num_layers": args.num_layers, "heads": heads,
        "seq_length": args.seq_length, "micro_batch_size": args.micro_batch_size,
        "dtype": str(dtype).removeprefix("torch."), "microbatches": args.microbatches, "repeats": args.repeats,
        "median_ms": median_ms,
        "split_cost_ms": median_ms["B'"] + median_ms["W"] - median_ms["B"],
        "forward_cost_ms": median_ms["F'"] - median_ms["F"],
        "peak_mib": {name: peak / 2**20 for name, peak in peaks.items()} if cuda else None,
        "stash_mib": max(stash) / 2**20 if stash else 0.0,
        "max_rel_grad_diff": max(diffs), "tolerance": 1e-2 if args.bf16 else 1e-5,
    }


def table(f: dict) -> str:
    ms = f["median_ms"]
    f_split, b_split = ms["F'"], ms["B'"]
    unsplit, split = ms["F"] + ms["B"], f_split + b_split + ms["W"]
    lines = [f"{f['device']}, torch {f['torch']}, megatron-core {f['megatron_core']}: a middle GPT stage of "
             f"{f['num_layers']} layers, hidden {f['hidden_size']}, {f['heads']} heads, seq {f['seq_length']}, "
             f"micro-batch {f['micro_batch_size']}, {f['dtype']}; medians of {f['repeats']} x {f['microbatches']} "
             f"microbatches",
             f"  1F1B's     F {ms['F']:8.2f} ms   B {ms['B']:8.2f} ms               F+B    {unsplit:8.2f} ms",
             f"  split      F {f_split:8.2f} ms   B' {b_split:7.2f} ms   W {ms['W']:7.2f} ms"
             f"   F+B'+W {split:8.2f} ms",
             f"  split cost {f['split_cost_ms']:+.2f} ms per microbatch, B'+W ({100 * (split / unsplit - 1):+.1f}% of "
             f"F+B), forward {f['forward_cost_ms']:+.2f} ms"]
    if f["peak_mib"]:
        peaks = ", ".join(f"{name} {mib:.0f}" for name, mib in f["peak_mib"].items())
        lines.append(f"  peak above the phase's start (MiB): {peaks}")
    lines.append(f"  B' keeps {f['stash_mib']:.1f} MiB alive until W (what 1F1B frees at the end of B); "
                 f"gradients: max relative difference {f['max_rel_grad_diff']:.1e} (tolerance {f['tolerance']:.0e})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
