"""What the schedule keeps from one call to the next in a process, in one object.

``ScheduleState`` is the only state ``forward_backward_rrfp`` carries between calls. Its
life cycle:

* **made** by the first ``ScheduleState.get()`` (``configure()``, ``session.start()`` or
  the first schedule call), one per process;
* **calibrated**: a buffer limit that needs measuring (``1x`` in bytes, ``auto``) is
  calibrated per key — the models' identity, the layout, the hint and the number of
  microbatches M: the first training call with that key measures, the next one agrees
  with the other stages (a collective) and applies. A call with another M (Megatron's
  sequence-packing schedulers change M between iterations) has its own key and never
  uses another M's figures;
* **reused** by every later call: the session (process groups, transport threads) while
  its ranks, device and transport fit; each key's calibration; whether each model's pipeline
  can split the backward into B and W (``split_blocked``, asked once per model, a collective);
* **discarded on failure** (``discard()``): a failed call closes the session — messages of
  its iteration may still be on the wire — and the next call builds a new one; the
  completed calibrations stay (they were measured by calls that completed on every rank,
  and a failed call records no measurement), so every rank stays in the same step;
* **reset** (``ScheduleState.reset()``): thrown away whole — the session closed, every
  calibration, report and note forgotten — by ``session.shutdown()``, and by ``get()``
  itself when the default process group is not the one it was made under (an in-process
  restart re-creates the world: every rank sees it in the same call). Only the configured
  options (``configure()``) carry over into the new object: they come from the command
  line, not from the world.

Every rank of a pipeline calls the schedule the same number of times with the same M, so
each calibration's collective happens in the same call everywhere.

Outside it, by design (the B/W split, ``split/``, may import nothing of this layer but
``compat``), the process keeps only: ``split/store.py``'s ``_active`` (the store and key of
the B being deferred, set by ``WeightGradStore.deferring`` and cleared when it exits:
autograd's threads read it) and ``_FLAGGED`` (the parameters that B's placeholders flagged,
emptied when it exits); ``split/megatron_linear.py``'s ``_SELF_CHECK`` (the split self-check's
verdict on the installed megatron-core, found once, never reset); weakly keyed notes on
parameters and modules (``_PREHOOKED``, ``_NAMES``, ``_DDP_OF``, ``_FORWARD_HOOKED``), which
go with the model.
"""
from __future__ import annotations

import weakref
from typing import Any, ClassVar, Optional

import torch.distributed as dist


class ScheduleState:
    """The schedule's per-process state; see the module docstring for its life cycle."""

    _current: ClassVar[Optional[ScheduleState]] = None

    def __init__(self, options: Any = None) -> None:
        self.options = options  # the process-wide RRFPConfig (config.configure); None: the defaults
        self.world = dist.group.WORLD if dist.is_initialized() else None  # the default group it belongs to
        self.session: Any = None  # the runtime (session.Session: groups, transport, inbox)
        self.auto_limits: dict[tuple, Any] = {}  # auto_limit's calibrations, by (models, hint, budget, layout, M)
        self.byte_budgets: dict[tuple, Any] = {}  # byte_limit's calibrations, by (models, policy, layout, M)
        self.epoch_variants: dict[tuple, Any] = {}  # the DP epoch rule's variant, by epoch_variant_key
        self.epoch_measured: dict[tuple, Any] = {}  # epoch_tuning's measuring call's figures, by the same key
        self.epoch_trials: dict[tuple, Any] = {}  # epoch_tuning's trial of its choice against no DP point
        self.epoch_trial_figures: dict[tuple, dict] = {}  # what each finished trial measured and kept
        self.last_report: Any = None  # the last completed call's IterationReport
        self.dp_modes_said: set[int] = set()  # models whose DP-communication mode rank 0 has named
        self.ranks_on_host: Optional[int] = None  # ranks of the world on this host (a collective, asked once)
        # first model chunk -> True where some stage of its pipeline cannot split B and W (stage_work)
        self.split_blocked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def get(cls) -> ScheduleState:
        """This process's state: made on first use, made again after a new world."""
        state = cls._current
        if state is None:
            state = cls._current = cls()
        if dist.is_initialized():
            if state.world is None:
                state.world = dist.group.WORLD
            elif state.world is not dist.group.WORLD:  # the default group was destroyed and re-created
                state = cls.reset(timeout=0.5, abort=True)  # its groups belong to the old world
                state.world = dist.group.WORLD
        return state

    @classmethod
    def reset(cls, timeout: float = 5.0, *, abort: bool = False) -> ScheduleState:
        """Throw the process's state away whole (its session closed); returns the new one,
        which keeps only the configured options."""
        old = cls._current
        cls._current = cls(options=None if old is None else old.options)
        if old is not None:
            old.close_session(timeout, abort=abort)
        return cls._current

    def discard(self, timeout: float = 0.5) -> None:
        """After a failed call: close the session (its threads told to stop, on CUDA its NCCL
        pair communicators aborted; on gloo each peer sent a close frame, which ends its receive for
        a message that will never come) so the next call builds a new one. That alone does not make
        the job recoverable in-process (Megatron's own groups with a dead peer are broken too):
        restart from a checkpoint, or let Megatron-LM's ``--inprocess-restart`` re-create the world
        (``get()`` then resets the state)."""
        self.close_session(timeout, abort=True)

    def close_session(self, timeout: float = 5.0, *, abort: bool = False) -> None:
        old, self.session = self.session, None
        if old is not None:
            old.close(timeout, abort=abort)


def epoch_variant_key(models, topology, num_microbatches: int) -> tuple:
    """Which job a DP epoch rule variant belongs to: its model chunks, layout and M."""
    return tuple(map(id, models)), topology, num_microbatches


__all__ = ["ScheduleState", "epoch_variant_key"]
