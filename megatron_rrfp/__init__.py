"""megatron-rrfp: readiness-first pipeline-parallel training for Megatron-core.

Where things live (one folder per concern; the arrows only point down this list):

  policy/       the arbitration policy, torch-free: Task "0F3" (actions), layout
                (topology), hints, the Arbiter, plans and their dry run
  sim/          the simulator: the policy's dry run under sampled variability, lower
                bounds, `megatron-rrfp simulate`
  trace/        Chrome/Perfetto traces (send -> receive arrows; all ranks merged on one
                clock) and PNG timelines of simulated and measured runs
  runtime/      one rank's runtime: the readiness-first loop (executor; tasks as profiler /
                NVTX ranges, device-timed on CUDA), the message transport, the
                tensor-parallel agreement
  mcore/        Megatron-core's schedule contract: forward_backward_rrfp, version
                differences (compat), CPU redirects, grad sync, B/W split (wgrad)
  megatron_lm/  Megatron-LM without edits: install(), the --rrfp-* flags, the launcher,
                goodput/trace hooks around its training loop
  goodput/      the goodput ledger (writer, reader), accounting, recorder, report
  dist/         where a process sits in a job; the local multi-process launcher; --nproc
                (ranks forked after one import on CPU, torch's own launcher on GPUs)
  bench/        measured benchmarks with emulated device time, `bench` / `demo`, `compare`
  train/        `megatron-rrfp train`: driver, config, builders, models, data (indexed
                datasets), checkpoints (torch, torch_dist), Megatron-LM's logs /
                TensorBoard / W&B (metrics), launcher signals, --nproc's local ranks, the multimodal recipe

The policy names below import no torch; the Megatron-facing names load lazily.
"""
from .policy import Arbiter, ArbiterConfig, HintError, Kind, Plan, Task, Topology, make_hint

__version__ = "0.2.0"

_LAZY = {
    "forward_backward_rrfp": "mcore.schedule",
    "get_forward_backward_func": "mcore.schedule",
    "last_iteration_report": "mcore.schedule",
    "RRFPConfig": "mcore.config",
    "configure": "mcore.config",
    "shutdown": "mcore.session",
    "install": "megatron_lm.install",
    "uninstall": "megatron_lm.install",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'megatron_rrfp' has no attribute {name!r}")


__all__ = ["Arbiter", "ArbiterConfig", "HintError", "Kind", "Plan", "Task", "Topology", "__version__",
           "make_hint", *_LAZY]
