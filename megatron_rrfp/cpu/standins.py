"""The CUDA stand-ins: what megatron-core and Megatron-LM ask of ``torch.cuda`` and of
``torch.distributed``'s point-to-point calls, answered on CPU over gloo.

One set, used two ways: ``megatron_core.py`` gives a few megatron-core modules their own
``torch`` (``CpuTorch``); ``megatron_lm.py`` sets the same calls on ``torch.cuda`` process-wide.
"""
from __future__ import annotations

import contextlib
import os
import time
import types

import torch

# torch functions that take `device=`; only these are wrapped, so classes such as
# torch.Tensor stay real classes (isinstance checks keep working).
FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn",
             "randint", "empty_like", "zeros_like", "ones_like", "full_like", "as_tensor")


def to_cpu_device(device):
    """'cuda', 'cuda:1', torch.device('cuda') and bare CUDA ordinals become 'cpu'."""
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
        return "cpu"
    return device


def cpu_factory(factory):
    """``factory`` (torch.zeros, ...) with a CUDA ``device=`` mapped to CPU."""
    def call(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = to_cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    call.__name__ = factory.__name__
    call.__doc__ = f"torch.{factory.__name__} with CUDA devices mapped to CPU."
    return call


# --------------------------------------------------------------------------- streams and events
#
# On CPU every op has finished when it returns, so waits and synchronisation are no-ops and a
# stream is only a context. Events keep a wall-clock time: Megatron-LM's timers read
# elapsed_time (milliseconds, like CUDA's); MoE's alltoall dispatcher records and waits on one
# around its device-to-host copy; 0.19's grad buckets wait on the current stream.


class CpuEvent:
    """A CUDA event stand-in; ``elapsed_time`` in milliseconds, like CUDA's."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self._t = None

    def record(self, stream=None):
        self._t = time.perf_counter()

    def elapsed_time(self, end: CpuEvent) -> float:
        return (end._t - self._t) * 1000.0

    def synchronize(self):
        return None

    def wait(self, stream=None):
        return None

    def query(self) -> bool:
        return True


class CpuStream:
    """A CUDA stream stand-in: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self):
        return None

    def wait_stream(self, stream):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        event = event or CpuEvent()
        event.record()
        return event

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


CPU_STREAM = CpuStream()

CUDA_CALLS = {
    "current_device": lambda: "cpu",  # used as a device= argument, which the factories accept
    "synchronize": lambda device=None: None,
    "Stream": CpuStream,
    "Event": CpuEvent,
    "current_stream": lambda device=None: CPU_STREAM,
    "default_stream": lambda device=None: CPU_STREAM,
    "stream": lambda stream=None: contextlib.nullcontext(),
    # NVTX ranges (megatron-core's combined-1F1B nodes push and pop them; a CPU build of torch raises)
    "nvtx": types.SimpleNamespace(range_push=lambda msg: None, range_pop=lambda: None, mark=lambda msg: None,
                                  range=lambda msg, *args, **kwargs: contextlib.nullcontext()),
}
"""The ``torch.cuda`` calls megatron-core makes unconditionally, CPU-safe. On a CUDA build of
torch without a GPU they would otherwise initialise the driver (and, in a rank forked from
the launcher's server, fail as 'Cannot re-initialize CUDA in forked subprocess')."""


class CpuDeviceProperties:
    """What torch.cuda.get_device_properties answers about this host's "device"."""

    name = gcnArchName = "cpu"  # torch.compile's cache key reads gcnArchName on non-CUDA builds
    major = 0
    minor = 0
    is_integrated = False
    multi_processor_count = os.cpu_count() or 1
    total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0


class CpuCuda(types.ModuleType):
    """``torch.cuda`` inside one megatron-core module: ``CUDA_CALLS``, the rest torch's own."""

    def __init__(self):
        super().__init__("torch.cuda")
        for name, call in CUDA_CALLS.items():
            setattr(self, name, call)

    def __getattr__(self, name):  # only reached for names not set in __init__
        return getattr(torch.cuda, name)


# --------------------------------------------------------------------------- point-to-point
#
# On CUDA a buffer handed to an isend / irecv stays allocated until the communication stream
# is done with it (the caching allocator records the stream), whatever the Python side does
# meanwhile. Gloo reads and writes the buffer from its own thread, and only the tensor holds
# it: Megatron's deallocate_output_tensor replaces a sent output's ``.data`` right after the
# isend, and in megatron-core's interleaved schedule (overlap_p2p_comm, before 0.18) that
# happens before the send is waited on, so the storage could be freed and reused while gloo
# still sent it. A request here holds a detached alias of its buffer (same storage, a tensor
# of its own that ``.data =`` does not touch) until it is waited on.


class HeldRequest:
    """An isend / irecv request that keeps its buffer's storage until ``wait`` returns."""

    def __init__(self, work, tensor: torch.Tensor):
        self._work, self._buffer = work, tensor.detach()

    def wait(self, *args, **kwargs):
        done = self._work.wait(*args, **kwargs)
        self._buffer = None
        return done

    def __getattr__(self, name):  # is_completed, exception, ...: the request's own
        return getattr(self._work, name)


def _held(send_or_recv):
    def call(tensor, *args, **kwargs):
        work = send_or_recv(tensor, *args, **kwargs)
        return None if work is None else HeldRequest(work, tensor)

    call.__name__ = send_or_recv.__name__
    call.__doc__ = f"torch.distributed.{send_or_recv.__name__}, its buffer kept until the request is waited on."
    return call


def _host_splits(splits):
    """gloo's all_to_all_single takes split sizes as a list of ints (megatron passes numpy
    arrays or tensors)."""
    return None if splits is None else [int(n) for n in splits]


class CpuDistributed(types.ModuleType):
    """``torch.distributed`` inside one megatron-core module: isend / irecv keep their buffers
    until waited on (see above), all-to-all split sizes are lists (what gloo accepts)."""

    def __init__(self):
        super().__init__("torch.distributed")
        self.isend, self.irecv = _held(torch.distributed.isend), _held(torch.distributed.irecv)

    def __getattr__(self, name):  # only reached for names not set in __init__
        return getattr(torch.distributed, name)

    def P2POp(self, op, *args, **kwargs):  # noqa: N802 (torch's name)
        """torch's P2POp accepts only its own isend / irecv: batch_isend_irecv waits before
        megatron-core returns, so the batched path needs no holding."""
        op = {self.isend: torch.distributed.isend, self.irecv: torch.distributed.irecv}.get(op, op)
        return torch.distributed.P2POp(op, *args, **kwargs)

    @staticmethod
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        return torch.distributed.all_to_all_single(output, input, output_split_sizes=_host_splits(output_split_sizes),
                                                   input_split_sizes=_host_splits(input_split_sizes), group=group,
                                                   async_op=async_op)


class CpuTorch(types.ModuleType):
    """``torch`` inside one megatron-core module: CUDA devices become CPU, ``torch.cuda`` and
    ``torch.distributed`` are the stand-ins above; everything else is torch's own."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = CpuCuda()
        self.distributed = CpuDistributed()
        for name in FACTORIES:
            if hasattr(torch, name):
                setattr(self, name, cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):  # only reached for names not set in __init__
        return getattr(torch, name)
