"""A checked plan: one ``ArbiterConfig`` resolved for one pipeline layout.

``Plan.build(config, topology, num_microbatches)`` turns the parsed hint into every
stage's task order where one is needed (ordered hints; strict mode, where a rule hint's
fixed order is what the rule does under constant durations — materialised by a dry run
of the rule itself), validates each order (every task exactly once, nothing else) and
proves a strict plan can run to completion (a dry run; an order whose B precedes its own
F fails here, before any process waits on it). Plans are cached per layout, so the
executor pays this once per (layout, microbatch count), not per iteration.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Optional

from .actions import Task
from .arbiter import Arbiter, ArbiterConfig, config_memory
from .dryrun import DeadlockError, constant_durations, run
from .hints import HintError
from .topology import Topology


@dataclass(frozen=True, slots=True)
class Plan:
    config: ArbiterConfig
    topology: Topology
    num_microbatches: int
    orders: Optional[tuple[tuple[Task, ...], ...]]
    """Per-stage order for ordered hints and strict mode; None for readiness-first rule hints."""

    @staticmethod
    def build(config: ArbiterConfig, topology: Topology, num_microbatches: int) -> Plan:
        return _build(config, topology, num_microbatches)

    @property
    def hint(self):
        """The concrete hint for this layout (``default`` resolved)."""
        return self.config.parsed_hint.for_layout(
            self.topology, split_backward=self.config.split_backward_ok,
            memory=config_memory(self.config, self.topology, self.num_microbatches))

    @property
    def split_backward(self) -> bool:
        return self.hint.split_backward

    def arbiter(self, stage: int, *, forward_only: bool = False) -> Arbiter:
        order = None if self.orders is None else list(self.orders[stage])
        return Arbiter(self.config, stage=stage, topology=self.topology, num_microbatches=self.num_microbatches,
                       forward_only=forward_only, order=order)

    def arbiters(self, *, forward_only: bool = False) -> list[Arbiter]:
        return [self.arbiter(s, forward_only=forward_only) for s in range(self.topology.num_stages)]


@lru_cache(maxsize=64)
def _build(config: ArbiterConfig, topology: Topology, num_microbatches: int) -> Plan:
    hint = config.parsed_hint.for_layout(topology, split_backward=config.split_backward_ok,
                                         memory=config_memory(config, topology, num_microbatches))
    orders = hint.orders(topology, num_microbatches)
    if orders is None and config.strict:
        orders = _materialize(config, topology, num_microbatches)
    plan = Plan(config, topology, num_microbatches,
                None if orders is None else tuple(tuple(order) for order in orders))
    arbiters = plan.arbiters()  # validates every stage's order
    if not config.strict:  # strict runs the order's own memory; the limit does not bind it
        hint.check_memory(topology, num_microbatches, arbiters[0].buffer_limit)
        _announce_interleaved_bf(config, topology, num_microbatches)
    if config.strict:
        try:
            run(arbiters, topology, duration=constant_durations(plan.split_backward), name=hint.name)
        except DeadlockError as exc:
            raise HintError(f"strict hint {hint.name!r} cannot run to completion on PP={topology.num_stages}, "
                            f"chunks={topology.num_chunks}, M={num_microbatches}: a task waits on one listed "
                            f"after it.\n{exc}") from None
    return plan


INTERLEAVED_BF_LOSES_BELOW = 1.5
"""Named ``bf`` / ``bfw`` with 3+ chunks below this multiple of Megatron's memory lose to
Megatron's interleaved schedule under jitter (simulated: docs/simulator.md)."""


def _announce_interleaved_bf(config: ArbiterConfig, topology: Topology, num_microbatches: int) -> None:
    """One line (a warning, shown once per call site) where a user named ``bf`` / ``bfw`` for
    a layout where it is expected to lose; ``default`` never reads them there."""
    name = getattr(config.parsed_hint, "name", "")
    memory = config_memory(config, topology, num_microbatches)
    if name in ("bf", "bfw") and topology.num_chunks >= 3 and memory is not None and \
            memory.limit < math.floor(INTERLEAVED_BF_LOSES_BELOW * memory.megatron_peak + 1e-9):
        multiple = memory.limit / memory.megatron_peak
        warnings.warn(f"megatron-rrfp: hint {name!r} with {topology.num_chunks} chunks at {multiple:.3g}x "
                      f"Megatron's memory is slower than Megatron's interleaved schedule under run-time jitter "
                      f"(simulated: docs/simulator.md); hint 'default' reads zbh1 / Megatron's order here",
                      RuntimeWarning, stacklevel=3)


def _materialize(config: ArbiterConfig, topology: Topology, num_microbatches: int) -> list[list[Task]]:
    """The order a rule hint produces readiness-first with F = 1, B = 2 and no latency."""
    rule = replace(config, strict=False)
    arbiters = [Arbiter(rule, stage=s, topology=topology, num_microbatches=num_microbatches)
                for s in range(topology.num_stages)]
    rule_name = f"{arbiters[0].hint.name}-materialize"
    return run(arbiters, topology, duration=constant_durations(arbiters[0].split_backward), name=rule_name).orders


__all__ = ["Plan"]
