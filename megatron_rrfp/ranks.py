"""What every rank of a job shares once it runs: a line printed in one write, the maximum of a
few numbers over the ranks, and the all-gather under torch's current name.

Below every layer of the package (it imports none of it), so the runtime, the B/W split,
megatron-core's adapter, Megatron-LM's and ``train``'s drivers and the launchers all print and
agree the same way. Importing it imports no torch (the launchers import it before any rank does).
"""
from __future__ import annotations

import sys
from typing import Optional, TextIO


def print_line(text: str, file: Optional[TextIO] = None) -> None:
    """``print(text, flush=True)`` in one write. Every rank shares the launcher's stdout and
    stderr; with ``PYTHONUNBUFFERED`` / ``python -u`` print writes the text and its newline
    separately, and another rank's line landing in between breaks both lines for whoever
    reads them (a log parser, Megatron-LM's own tools). A pipe write up to 4 KiB is atomic."""
    stream = sys.stdout if file is None else file
    stream.write(text + "\n")
    stream.flush()


def max_over_ranks(values: list[float]) -> list[float]:
    """COLLECTIVE over the default group (every rank, same call): the element-wise maximum of
    ``values`` across ranks, in one all-reduce (on the current GPU under NCCL); ``values``
    itself without a process group."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [float(v) for v in values]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def all_gather_single(output_tensor, input_tensor, group=None, async_op: bool = False):
    """``torch.distributed.all_gather_single``: torch 2.13 deprecates ``all_gather_into_tensor``
    (a FutureWarning per call) for it; an older torch has only the old name."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output_tensor, input_tensor, group=group, async_op=async_op)


__all__ = ["all_gather_single", "max_over_ranks", "print_line"]
