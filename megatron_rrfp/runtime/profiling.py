"""Each executed task as profilers and traces see it.

Every task the executor runs is a ``torch.profiler.record_function`` range named like the
task ("0F3"), and on a CUDA host also an NVTX range of that name, so the PyTorch profiler
and Nsight Systems show RRFP's dynamic order the way they show Megatron's own schedules.

Trace spans. With spans recorded (``--rrfp-trace-dir``), a task on CUDA is timed with a pair
of CUDA events on the current stream, i.e. in *device* time: the host clock would measure
kernel launches, which run ahead of the GPU. The events are resolved once per iteration,
after the last task, against one anchor event that is synchronised (``resolve``): an event's
host time is the anchor's host time minus ``event.elapsed_time(anchor)``. Waits, agreement and
receives stay on the host clock (that is where they happen). Without recorded spans no event
is created and nothing synchronises.
"""
from __future__ import annotations

import contextlib
import time
from typing import Optional

import torch

from ..trace.chrome import Span


def _nvtx_available() -> bool:
    # torch.cuda.nvtx raises on CPU-only builds; a CUDA build without a visible GPU can
    # still push ranges (harmless), but there is nothing to see then.
    return torch.cuda.is_available()


class TaskClock:
    """Profiler ranges around tasks, and device-time spans on CUDA (see the module doc)."""

    def __init__(self, *, record_spans: bool, device_timing: Optional[bool] = None) -> None:
        self.nvtx = _nvtx_available()
        if device_timing is None:
            device_timing = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.device_timing = bool(record_spans and device_timing)
        self._timed: list[tuple[Span, object, object]] = []  # (span, start event, end event)

    @contextlib.contextmanager
    def task(self, name: str):
        """``record_function(name)`` (+ NVTX) around one task; yields its CUDA events or None."""
        with torch.profiler.record_function(name):
            if self.nvtx:
                torch.cuda.nvtx.range_push(name)
            events = None
            if self.device_timing:
                events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                events[0].record()
            try:
                yield events
            finally:
                if events is not None:
                    events[1].record()
                if self.nvtx:
                    torch.cuda.nvtx.range_pop()

    def on_device(self, span: Optional[Span], events) -> None:
        """Let ``resolve`` replace ``span``'s host times by its events' device times."""
        if span is not None and events is not None:
            self._timed.append((span, *events))

    def resolve(self, t0: float) -> None:
        """Device times of the recorded tasks, as seconds since ``t0`` on the host clock.
        One synchronisation (of an anchor event recorded after every task)."""
        if not self._timed:
            return
        anchor = torch.cuda.Event(enable_timing=True)
        anchor.record()
        anchor.synchronize()  # CPU-GPU sync point: once per traced iteration
        now = time.time() - t0
        for span, start, end in self._timed:
            span.start = now - start.elapsed_time(anchor) / 1e3
            span.end = now - end.elapsed_time(anchor) / 1e3
            span.args["clock"] = "device"
            # its sends leave when its kernels are done (the transport waits for them)
            span.args["flow_out"] = [(key, span.end - span.start) for key, _ in span.args.get("flow_out", ())]
        self._timed.clear()


__all__ = ["TaskClock"]
