"""Peak activation memory of one schedule call on one rank, measured the same way around
any schedule (RRFP's executor, or Megatron-core's own schedules wrapped from outside)::

    meter = ActivationMeter(device, persistent=model_tensors([model]))
    with meter:
        forward_backward(...)
    meter.peak_bytes, meter.method

CUDA: the peak of ``torch.cuda.max_memory_allocated`` over the call, relative to what
was allocated when it started. By default the meter leaves the allocator's peak
statistics alone — Megatron-LM's ``report_memory`` and TensorBoard's
``mem-max-allocated-bytes`` keep showing the process's peak since start-up (model build,
checkpoint loads included) — and reads the call's peak as the process peak at its end:
exact (``method == "cuda-allocator"``) when the call set a new process peak, else an upper
bound (``"cuda-allocator-bound"``: the call stayed below an earlier peak). Only a meter
made with ``reset_peak=True`` (an explicit measurement: the benchmark, the self-check)
resets the statistics on entry, and is always exact.

CPU (``method == "saved-tensors"``): the exact bytes the iteration holds for backward,
each tensor storage counted once however many holders it has:

* every tensor autograd saves for backward inside the call (``saved_tensors_hooks``),
  from the forward that saved it until autograd frees that node's saved tensors (after
  its backward, or when its graph is dropped); a packed tensor is wrapped in a small
  holder whose destruction is the release, so nothing lives longer than it would have;
* what a schedule holds explicitly through ``hold`` / ``release``: received activations
  and gradients waiting in RRFP's executor, inputs and output gradients a split
  backward keeps for its deferred W (``split/megatron_linear.py``).

Storages of ``persistent`` tensors (parameters, buffers) are never counted: they are not
activations and outlive the iteration. Not counted either, in every schedule alike: a
stage input no autograd node saves (both schedules keep it until its backward only to
read its gradient; a transformer stage's first norm saves it anyway), data batches, and
outputs on their way out (Megatron deallocates them once sent). Thread-safe: autograd may free saved tensors on
its own threads, and the executor's transport delivers on others.
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Optional

import torch

CUDA_ALLOCATOR = "cuda-allocator"
CUDA_ALLOCATOR_BOUND = "cuda-allocator-bound"  # an earlier process peak hides the call's own
SAVED_TENSORS = "saved-tensors"


def _storage_key(tensor: torch.Tensor) -> Optional[tuple[int, int]]:
    """(data pointer, bytes) of the tensor's storage; None if it has none worth counting."""
    try:
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        return (storage.data_ptr(), nbytes) if nbytes else None
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, meta or wrapper tensors
        return None


def model_tensors(modules) -> list[torch.Tensor]:
    """Parameters and buffers of ``modules``: what the meter must not count. Through
    ``torch.nn.Module``'s own methods (megatron-core's DDP shadows ``buffers``)."""
    return [t for m in modules for t in (*torch.nn.Module.parameters(m), *torch.nn.Module.buffers(m))]


class _Saved:
    """What autograd keeps instead of a saved tensor while the meter is active.

    Holds a detached alias (same storage; no grad_fn, so no reference cycle through the
    node that saved it); its destruction is the moment autograd let the tensor go."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: torch.Tensor, key: tuple[int, int], meter: ActivationMeter) -> None:
        self.tensor, self.key, self.meter = tensor.detach(), key, meter
        meter._add(key)

    def __del__(self) -> None:
        self.meter._remove(self.key)


class ActivationMeter:
    """Peak activation bytes of one schedule call on this rank (see the module docstring).

    A context manager; usable again for the next call. ``hold``/``release`` pair up per
    tensor; both are no-ops under the CUDA allocator (which sees every byte anyway)."""

    def __init__(self, device, *, persistent: Iterable[torch.Tensor] = (), reset_peak: bool = False) -> None:
        self.device = torch.device(device)
        self.reset_peak = reset_peak  # CUDA: reset the allocator's peak statistics on entry (module docstring)
        self._peak_before = 0
        self.method = CUDA_ALLOCATOR if self.device.type == "cuda" else SAVED_TENSORS
        self._persistent = set()
        if self.method == SAVED_TENSORS:
            self._persistent = {key[0] for key in map(_storage_key, persistent) if key is not None}
        self._lock = threading.Lock()
        self._refs: dict[int, list[int]] = {}  # data pointer -> [holders, bytes]
        self._held_explicitly: dict[int, list] = {}  # id(tensor) -> [storage key, holds]
        self._hooks = None
        self._base = 0
        self._window_peak = 0
        self.bytes = 0
        """Bytes held right now (CPU)."""
        self.peak_bytes = 0
        """Peak over the last (or current) call, relative to its start."""

    # -- the measured window ---------------------------------------------------------

    def __enter__(self) -> ActivationMeter:
        if self.method in (CUDA_ALLOCATOR, CUDA_ALLOCATOR_BOUND):
            self.method = CUDA_ALLOCATOR
            if self.reset_peak:
                torch.cuda.reset_peak_memory_stats(self.device)
            self._peak_before = torch.cuda.max_memory_allocated(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            with self._lock:
                self._base = self.bytes
                self.peak_bytes = 0
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.method in (CUDA_ALLOCATOR, CUDA_ALLOCATOR_BOUND):
            after = torch.cuda.max_memory_allocated(self.device)
            self.peak_bytes = max(0, after - self._base)
            # after a reset the peak before equals what was allocated: any use counts as new
            exact = self.reset_peak or after > self._peak_before
            self.method = CUDA_ALLOCATOR if exact else CUDA_ALLOCATOR_BOUND
        elif self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(*exc)

    # -- explicit holdings ---------------------------------------------------------

    def hold(self, tensor: torch.Tensor) -> None:
        """``tensor`` is kept for a later task (a waiting message, a deferred W's input).
        Each ``hold`` of a tensor needs one ``release`` of it."""
        if self.method != SAVED_TENSORS:
            return
        entry = self._held_explicitly.get(id(tensor))
        if entry is not None:
            entry[1] += 1
            return
        key = _storage_key(tensor)
        if key is not None and key[0] not in self._persistent:
            self._held_explicitly[id(tensor)] = [key, 1]
            self._add(key)

    def hold_until_freed(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage until the tensor's last reference goes: a buffer a
        schedule keeps without telling the meter (Megatron's received tensors, bench/around_schedules.py)."""
        key = _storage_key(tensor) if self.method == SAVED_TENSORS else None
        if key is not None and key[0] not in self._persistent:
            self._add(key)
            weakref.finalize(tensor, self._remove, key)

    def release(self, tensor: torch.Tensor) -> None:
        """The holder of ``tensor`` let it go (consumed by its task, or dropped)."""
        entry = self._held_explicitly.get(id(tensor))
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._held_explicitly[id(tensor)]
            self._remove(entry[0])

    # -- per-task windows (byte weights of the arbiter, policy/membytes.py) ----------

    def now(self) -> int:
        """Bytes held now, relative to the call's start (CUDA: allocated)."""
        if self.method == SAVED_TENSORS:
            return self.bytes - self._base
        return torch.cuda.memory_allocated(self.device) - self._base

    def open_window(self) -> int:
        """Start a window: ``window_peak()`` is then the peak since now. Returns ``now()``."""
        with self._lock:
            self._window_peak = self.bytes
        return self.now()

    def window_peak(self) -> Optional[int]:
        """Peak since ``open_window`` relative to the call's start; None on CUDA (the
        allocator's peak statistics are the user's, never reset here)."""
        return self._window_peak - self._base if self.method == SAVED_TENSORS else None

    # -- accounting ----------------------------------------------------------------

    def _pack(self, tensor: torch.Tensor):
        key = _storage_key(tensor)
        if key is None or key[0] in self._persistent:
            return tensor
        return _Saved(tensor, key, self)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _add(self, key: tuple[int, int]) -> None:
        pointer, nbytes = key
        with self._lock:
            entry = self._refs.get(pointer)
            if entry is None:
                self._refs[pointer] = [1, nbytes]
                self.bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.bytes - self._base)
                self._window_peak = max(self._window_peak, self.bytes)
            else:
                entry[0] += 1

    def _remove(self, key: tuple[int, int]) -> None:
        with self._lock:
            entry = self._refs.get(key[0])
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] == 0:
                del self._refs[key[0]]
                self.bytes -= entry[1]


def storage_bytes(tensor: Optional[torch.Tensor]) -> int:
    key = None if tensor is None else _storage_key(tensor)
    return 0 if key is None else key[1]


class TaskBytes:
    """What one call's tasks weigh in bytes, max over tasks (policy/membytes.StageBytes):
    a forward's held bytes and peak, a split B's peak, each above the bytes held before it.
    The received message a task consumes was counted before it and is released in it, so it
    is credited back: what its forward saves of it stays counted there, as in Megatron's."""

    def __init__(self, meter: ActivationMeter) -> None:
        self.meter = meter
        self.forward = self.forward_peak = 0
        self.split_peak: Optional[int] = 0  # None: not measurable (CUDA), or no split B ran
        self.split_backwards = 0
        self._start = 0

    def begin(self) -> None:
        self._start = self.meter.open_window()

    def end_forward(self, consumed: Optional[torch.Tensor]) -> None:
        credit = storage_bytes(consumed)
        held = self.meter.now() - self._start + credit
        peak = self.meter.window_peak()
        self.forward = max(self.forward, held)
        self.forward_peak = max(self.forward_peak, held if peak is None else peak - self._start + credit)

    def figures(self) -> dict:
        """Plain numbers (the report travels between processes; the meter does not)."""
        return {"forward": self.forward, "forward_peak": self.forward_peak, "split_peak": self.split_peak,
                "split_backwards": self.split_backwards}

    def end_split_backward(self) -> None:
        peak = self.meter.window_peak()
        self.split_backwards += 1
        if peak is None:
            self.split_peak = None
        elif self.split_peak is not None:
            self.split_peak = max(self.split_peak, peak - self._start)


__all__ = ["CUDA_ALLOCATOR", "CUDA_ALLOCATOR_BOUND", "SAVED_TENSORS", "ActivationMeter", "TaskBytes", "model_tensors",
           "storage_bytes"]
