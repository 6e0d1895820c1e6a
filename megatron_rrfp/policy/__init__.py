"""The arbitration policy: tasks, layout, hints, the arbiter, plans and their dry run.

Pure Python — no torch, no torch.distributed — so the simulator (``sim/``) and the real
executor (``runtime/``) drive the very same decisions.
"""
from .actions import Kind, Task
from .arbiter import DEFAULT_BUFFER_LIMIT, DEFAULT_HINT, Arbiter, ArbiterConfig
from .hint_specs import make_hint
from .hints import BUILTIN_HINTS, Hint, HintError
from .plan import Plan
from .topology import Topology

__all__ = ["BUILTIN_HINTS", "DEFAULT_BUFFER_LIMIT", "DEFAULT_HINT", "Arbiter", "ArbiterConfig", "Hint", "HintError",
           "Kind", "Plan", "Task", "Topology", "make_hint"]
