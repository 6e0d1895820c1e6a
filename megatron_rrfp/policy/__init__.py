"""The arbitration policy: tasks, layout, hints, the arbiter, plans and their dry run.

Pure Python — no torch, no torch.distributed — so the simulator (``sim/``) and the real
executor (``runtime/``) drive the very same decisions.

Words (docs/glossary.md has the full list):

* F / B / W — a forward; a backward (the full one, or with the B/W split only its
  input-gradient half, which torch.distributed.pipelining calls I); the deferred
  weight-gradient half. A task prints as chunk, kind, microbatch: ``"0F3"``.
* in flight — a stage's forwards run minus backwards run (minus W when split), per
  (microbatch, chunk) forward: the memory the buffer limit bounds.
* 1x — Megatron's own peak in flight for the layout; ``"1.5x"``, ``"2x"`` are buffer
  limits in that unit (settings, not speed-ups); ``auto`` grows from 1x into measured memory.
* order — one stage's task list; hint — a schedule read as a ranking of the ready tasks
  (``bf``, ``bfw``, ``1f1b``, ``zbh1``, ``gpipe``, a file, or ``default``, which picks one per
  layout and limit by the rows of ``default.DEFAULT_RULES``); plan — every stage's order for a
  layout, checked by a dry run; strict — run an order exactly, waiting where it waits.
* f0, j0-j3 — the simulator's time unit (one stage's nominal forward) and its variability
  levels, j0 none to j3 the paper's reference (sigma_c, c50, sigma_m: ``sim/variability.py``).
"""
from .actions import Kind, Task
from .arbiter import DEFAULT_BUFFER_LIMIT, DEFAULT_HINT, Arbiter, ArbiterConfig
from .hint_specs import make_hint
from .hints import BUILTIN_HINTS, Hint, HintError
from .plan import Plan
from .topology import Topology

__all__ = ["BUILTIN_HINTS", "DEFAULT_BUFFER_LIMIT", "DEFAULT_HINT", "Arbiter", "ArbiterConfig", "Hint", "HintError",
           "Kind", "Plan", "Task", "Topology", "make_hint"]
