"""Which host/device synchronising calls RRFP's own code makes inside the task loop.

``SyncProbe`` is a ``TorchFunctionMode`` (plus wrappers of ``torch.cuda``'s synchronize
functions) active on the training thread while ``PipelineIteration.run`` runs. It records
every call that would make the host wait for a CUDA stream — a host read of a tensor's
value (``item``, ``tolist``, ``bool`` ...), a copy to another device (``to(device)``,
``cuda()``, ``cpu()``, ``copy_``), an explicit synchronize — whose direct caller (the first
frame outside torch) is a megatron_rrfp module; each call is named ``func[dtype] at
module:line``. On CPU nothing actually waits; the probe
sees the calls that would, so the check runs without a GPU. Megatron-core's own calls
(its forward_step, the test's loss function) are not RRFP's and are not recorded.
"""
from __future__ import annotations

import os
import sys

import torch
from torch.overrides import TorchFunctionMode

import megatron_rrfp

PACKAGE = os.path.dirname(megatron_rrfp.__file__) + os.sep
TORCH = os.path.dirname(torch.__file__) + os.sep
_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__,
          torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}
_COPIES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.copy_}


def _caller() -> str | None:
    """file:line of the first frame outside torch and this probe, if it is megatron_rrfp's."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(TORCH) or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(PACKAGE):
        return None
    return f"{frame.f_code.co_filename[len(PACKAGE):]}:{frame.f_lineno}"


def _moves_device(func, args, kwargs) -> bool:
    if func is torch.Tensor.copy_:  # only a copy between devices waits
        return len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1].device != args[0].device
    if func is torch.Tensor.to:  # .to(dtype) alone stays on the device
        return any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args[1:]) or "device" in kwargs
    return True


class SyncProbe(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self._saved: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS or (func in _COPIES and _moves_device(func, args, kwargs)):
            where = _caller()
            if where is not None:
                dtype = str(args[0].dtype).replace("torch.", "") if args and isinstance(args[0], torch.Tensor) else "?"
                self.calls.append(f"{getattr(func, '__name__', func)}[{dtype}] at {where}")
        return func(*args, **kwargs)

    def __enter__(self):
        for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"),
                            (torch.cuda.Event, "synchronize")):
            original = getattr(owner, name)

            def wrapped(*a, _original=original, _name=name, **k):
                where = _caller()
                if where is not None:
                    self.calls.append(f"{_name} at {where}")
                return _original(*a, **k)
            self._saved.append((owner, name, original))
            setattr(owner, name, wrapped)
        return super().__enter__()

    def __exit__(self, *exc):
        for owner, name, original in self._saved:
            setattr(owner, name, original)
        self._saved = []
        return super().__exit__(*exc)


def syncs_in_task_loop(cases) -> dict:
    """Run ``cases`` (helpers.equivalence.Case) on this rank with the probe around every
    ``PipelineIteration.run``; returns {"calls": [...], "runs": n}."""
    from megatron_rrfp.runtime.executor import PipelineIteration

    from .equivalence import run_cases

    probe, runs, original = SyncProbe(), [0], PipelineIteration.run

    def probed(self):
        runs[0] += 1
        with probe:
            return original(self)

    PipelineIteration.run = probed
    try:
        results = run_cases(cases)
    finally:
        PipelineIteration.run = original
    return {"calls": sorted(set(probe.calls)), "runs": runs[0], "grad_rel_err": max(r["grad_rel_err"] for r in results)}
