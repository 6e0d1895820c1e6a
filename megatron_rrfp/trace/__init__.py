"""Timelines of simulated and measured runs: Chrome/Perfetto traces (pid = rank, name =
the action string "0F3") and PNG pictures."""
from .chrome import COLORS, Span, spans_from_simulation, write_chrome_trace
from .timeline import plot_timelines

__all__ = ["COLORS", "Span", "plot_timelines", "spans_from_simulation", "write_chrome_trace"]
