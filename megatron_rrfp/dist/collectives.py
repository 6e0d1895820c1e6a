"""The project's own collectives through torch's current names: torch 2.13 deprecates
``all_gather_into_tensor`` (a FutureWarning per call) for ``all_gather_single``; an older
torch has only the old name."""
from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = ["all_gather_single"]
