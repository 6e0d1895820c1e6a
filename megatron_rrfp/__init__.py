"""megatron-rrfp: readiness-first pipeline-parallel training for Megatron-core.

Where things live:
  actions.py    Task (F/B/W, microbatch, chunk) and its string form "0F3"
  topology.py   who feeds whom (interleaved virtual stages)
  hints.py      hint orders: bf, bfw, 1f1b, gpipe, explicit lists
  arbiter.py    the policy: (ready set, stage state) -> next task; backpressure
  simulator.py  discrete-event simulator driving the same arbiter
  transport.py  message-driven p2p: sender/receiver threads, directed process groups
  agreement.py  tensor-parallel agreement: one ready-set exchange per decision
  executor.py   the runtime loop of one rank (framework-agnostic)
  schedule.py   Megatron-core's schedule contract: forward_backward_rrfp
  grad_sync.py  when gradient reductions may run (no_sync, grad/param sync funcs)
  wgrad.py      B/W split of megatron-core linears for the BFW hint
  adapter.py    every megatron-core version difference and CPU redirect
  options.py    --pipeline-schedule / --rrfp-* flags
  trace.py      Chrome/Perfetto traces and PNG timelines
  bench.py      measured benchmark (emulation.py: identical emulated device time)
  ledger.py, goodput.py, goodput_recorder.py   the goodput ledger and report
  train.py      the project's training driver (builders, data, checkpoint, distenv)
  integration.py, launch.py, megatron_lm_hooks.py   Megatron-LM without edits

The policy modules import no torch; the Megatron-facing names below load lazily.
"""
from .actions import Kind, Task
from .arbiter import Arbiter, ArbiterConfig
from .hints import HintError, make_hint
from .topology import Topology

__version__ = "0.1.0"

_LAZY = {
    "forward_backward_rrfp": "schedule",
    "get_forward_backward_func": "schedule",
    "RRFPConfig": "schedule",
    "configure": "schedule",
    "last_iteration_report": "schedule",
    "install": "integration",
    "uninstall": "integration",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'megatron_rrfp' has no attribute {name!r}")


__all__ = ["Arbiter", "ArbiterConfig", "HintError", "Kind", "Task", "Topology", "make_hint", "__version__",
           *_LAZY]
