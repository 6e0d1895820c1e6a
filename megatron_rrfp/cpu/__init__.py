"""Megatron-core and Megatron-LM on a CPU-only host (gloo), unmodified: one set of CUDA stand-ins.

``standins.py`` answers what they ask of ``torch.cuda`` (devices, streams, events) and of
``torch.distributed``'s point-to-point calls (a buffer stays allocated until its request is
waited on, as CUDA's allocator keeps it); ``megatron_core.py`` gives megatron-core's schedules,
models and optimizer those stand-ins module by module (``enable_cpu_reference_schedules``,
``enable_cpu_optimizer``); ``megatron_lm.py`` sets them process-wide for Megatron-LM's
training loop (``enable_cpu_training``, used by ``launch --cpu``).
"""
from __future__ import annotations

from .megatron_core import (
    cpu_redirected_modules,
    cpu_tensor_types_named_as_cuda,
    enable_cpu_optimizer,
    enable_cpu_reference_schedules,
    runs_on_cuda,
)
from .megatron_lm import enable_cpu_training

__all__ = ["cpu_redirected_modules", "cpu_tensor_types_named_as_cuda", "enable_cpu_optimizer",
           "enable_cpu_reference_schedules", "enable_cpu_training", "runs_on_cuda"]
