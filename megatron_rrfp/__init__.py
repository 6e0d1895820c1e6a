"""megatron-rrfp: readiness-first pipeline-parallel training for Megatron-core.

Where things live:
  actions.py   Task (F/B/W, microbatch, chunk) and its string form "0F3"
  topology.py  who feeds whom (interleaved virtual stages)
  hints.py     hint orders: bf, bfw, 1f1b, gpipe, explicit lists
  arbiter.py   the policy: (ready set, stage state) -> next task; backpressure
  simulator.py discrete-event simulator driving the same arbiter
  trace.py     Chrome/Perfetto traces and PNG timelines
"""
from .actions import Kind, Task
from .arbiter import Arbiter, ArbiterConfig
from .hints import HintError, make_hint
from .topology import Topology

__version__ = "0.1.0"

__all__ = ["Arbiter", "ArbiterConfig", "HintError", "Kind", "Task", "Topology", "make_hint", "__version__"]
