"""Options of the readiness-first schedule: one nested config, parsed and checked once.

``RRFPConfig`` holds the policy's ``ArbiterConfig`` (hint, buffer limit, strict) beside the
runtime's own options; the hint is parsed when the config is built, so a bad name or file
fails at start-up, and every schedule call reuses the parsed hint. ``configure()`` sets the
process-wide defaults (the Megatron-LM integration does this from the --rrfp-* flags); the
process's ``ScheduleState`` holds them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Optional

from ..checks import TIMEOUT_S
from ..policy.arbiter import ArbiterConfig
from ..runtime.executor import AroundTask
from ..runtime.inbox import Deliver
from .dp_overlap import DP_OVERLAP_CHOICES
from .state import ScheduleState

DEFAULT_TIMEOUT_S = 600.0


def collective_timeout_floor_s(timeout_s: float) -> float:
    """The least timeout (seconds) of any collective RRFP's task loop can block in (NCCL's
    watchdog, gloo's): ``--rrfp-timeout`` plus a margin of max(itself, 300 s). Every wait RRFP
    makes is at most ``timeout_s`` (stall timeout, flush, the ring rule, the TP agreement), and
    the margin covers the diagnosis, the communicators' abort and the launcher's reaction, so
    RRFP's state dump prints before a collective's own timeout tears the process down."""
    return timeout_s + max(timeout_s, 300.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class RRFPConfig:
    """Options of the readiness-first schedule (Megatron-LM flags in parentheses)."""

    arbiter: ArbiterConfig = field(default_factory=ArbiterConfig)
    """The policy: hint (--rrfp-hint), buffer limit (--rrfp-buffer-limit), strict (--rrfp-strict)."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """A rank with no progress for this long raises with a state dump (--rrfp-timeout)."""
    record_spans: bool = False
    """Keep per-task timestamps for traces (--rrfp-trace-dir turns it on)."""
    activation_budget_bytes: Optional[int] = None
    """buffer_limit "auto" only: bytes each stage may fill with activations (default: what its
    device has free; mcore/auto_limit.py)."""
    transport: str = "auto"
    """'rounds' (NCCL-safe rounds; CUDA's, and runs over gloo too), 'threads' (gloo threads,
    host tensors) or 'auto' (rounds on CUDA, threads on CPU); see mcore/session.py."""
    dp_overlap: str = "auto"
    """Where overlapped DP communication goes with interleaving and DP > 1 on CUDA: 'epochs' (the
    DP epoch rule), 'lockstep', 'after-loop' (each on any device when named) or 'auto' (epochs there;
    --rrfp-dp-overlap; mcore/dp_overlap.py)."""
    around_task: Optional[AroundTask] = None
    """Called as ``around_task(task, run)`` for each F / B / W this rank runs; ``run()`` does the
    task's work (instrumentation from outside the runtime: profiler ranges, the bench's emulated
    device time). None runs each task directly."""
    deliver_message: Optional[Deliver] = None
    """Called as ``deliver_message(message, put)`` on the transport's thread for each message that
    arrives; ``put(message)`` hands it to the task loop, now or later (the bench's emulated link
    latency). None hands every message over at once."""

    def __post_init__(self) -> None:
        budget = self.activation_budget_bytes
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"activation_budget_bytes must be a positive integer (bytes), got {budget!r}")
        TIMEOUT_S.check("timeout_s (--rrfp-timeout, seconds)", self.timeout_s)
        if self.transport not in ("auto", "threads", "rounds"):
            raise ValueError(f"transport must be 'auto', 'threads' or 'rounds', got {self.transport!r}")
        if self.dp_overlap not in DP_OVERLAP_CHOICES:
            raise ValueError(f"dp_overlap (--rrfp-dp-overlap) must be one of {', '.join(DP_OVERLAP_CHOICES)}, "
                             f"got {self.dp_overlap!r}")

    @classmethod
    def of(cls, **options) -> RRFPConfig:
        """Build from flat keywords: hint=, buffer_limit=, strict=, timeout_s=, record_spans=,
        activation_budget_bytes=, transport=, dp_overlap=."""
        return cls().with_options(**options)

    def with_options(self, **options) -> RRFPConfig:
        """A copy with flat keywords applied; ``None`` values are ignored (not given)."""
        options = {k: v for k, v in options.items() if v is not None}
        policy = {k: options.pop(k) for k in _ARBITER_FIELDS if k in options}
        unknown = set(options) - _OWN_FIELDS
        if unknown:
            raise TypeError(f"unknown rrfp option(s) {sorted(unknown)}; known: "
                            f"{sorted(_ARBITER_FIELDS | _OWN_FIELDS)}")
        arbiter = replace(self.arbiter, **policy) if policy else self.arbiter
        return replace(self, arbiter=arbiter, **options)


_ARBITER_FIELDS = frozenset(f.name for f in fields(ArbiterConfig))
_OWN_FIELDS = frozenset(f.name for f in fields(RRFPConfig)) - {"arbiter"}

def configure(**options) -> RRFPConfig:
    """Set the process-wide defaults used when Megatron calls the schedule without RRFP
    keywords. A bad hint or limit raises here, not mid-training."""
    state = ScheduleState.get()
    state.options = defaults().with_options(**options)
    return state.options


def defaults() -> RRFPConfig:
    """The process-wide options (``configure``), held by the process's ``ScheduleState``."""
    return ScheduleState.get().options or _DEFAULT


def set_defaults(config: RRFPConfig) -> None:
    ScheduleState.get().options = config


_DEFAULT = RRFPConfig()


__all__ = ["DEFAULT_TIMEOUT_S", "RRFPConfig", "collective_timeout_floor_s", "configure", "defaults", "set_defaults"]
