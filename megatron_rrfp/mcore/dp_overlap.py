"""Where data-parallel communication may overlap the task loop, and what makes it safe (the rule in one place).

The rounds protocol's deadlock argument (docs/design/rounds-protocol.md) covers the operations of
one pipeline, its TP groups and every group whose ranks dispatch one agreed task sequence.
Data-parallel reductions (``overlap_grad_reduce``) and the distributed optimizer's parameter
all-gathers (``overlap_param_gather``) join ranks of *other* pipelines, at points of each
one's own task sequence:

* without interleaving they sit where every replica of a stage reaches them in the same
  order relative to its rounds: a stage's reductions in its last backward (or its last B
  and last W under the split), its all-gathers in its first forward. Covered without more
  (docs/design/rounds-protocol.md, by stage);
* with interleaving on a single-queue GPU (CUDA, NCCL) chunk c's reductions and chunk
  c+1's all-gathers fall between rounds of other chunks, and rrfp's replicas of a stage
  order their chunks' tasks differently (readiness differs per pipeline), so NCCL would
  pair different collectives, or a cycle through two pipelines could form
  (``scripts/emulate_transport.py --protocols rounds-dp-unagreed`` shows both).

Three ways make them safe there (``--rrfp-dp-overlap``, ``dp_communication``):

* **epochs** (the DP epoch rule, docs/design/dp-epochs.md): DP collectives stay where megatron
  issues them, each at a fixed *DP point* of the stage's task sequence (its place in Megatron's
  order); between DP points a stage is readiness-first and its replicas independent; the rounds
  transport gives each message an epoch (the DP points before it) and issues rounds in epoch
  order. Overlapped and independent; it needs the rounds transport (on CPU too, when named);

* **lockstep** (``whole_stage_agreement``): the TP agreement spans every rank of the stage
  (TP x DP x CP: megatron's tensor-and-data-parallel group), so all DP replicas of a stage
  dispatch one agreed task sequence and issue their DP collectives at the same positions of
  it — the argument docs/design/rounds-protocol.md makes for expert all-to-alls, which already join
  replicas this way. Cost: one agreement exchange per decision over TP x DP ranks
  (host-side, gloo) instead of TP, and replicas of a stage move in lock-step: each stage
  takes the slower replica's every task and message;
* **after-loop**: the DP collectives leave the task loop (``grad_sync.GradSyncController``
  with ``in_loop=False``): every chunk's parameter all-gathers complete before the first
  task and every reduction launches after the last one, in chunk and bucket order. They then
  sit where the optimizer's own collectives sit, between two task loops, when no round of
  the pipeline is pending on any rank (the loop ends with the transport's flush), so the
  replicas stay independent and nothing in the loop joins two pipelines. Cost: the DP
  communication is no longer hidden behind compute.

``auto`` reads the epoch rule: the one choice the simulator and the bench put at or above Megatron's
overlapped schedule with light and heavy DP communication alike (after-loop leaves it exposed, lock-step
inherits the slower replica); which DP points it keeps is chosen per job by the simulator on the job's
first iteration (``epoch_tuning.py``), so light DP communication leaves the loop as after-loop's does.
Figures and when to name another: docs/production-configurations.md and docs/design/dp-epochs.md.
CPU runs (gloo, host-synchronous) and DP = 1 need nothing; a named choice
applies on any device where there is something to place.
"""
from __future__ import annotations


def overlapping_flags(models) -> list[str]:
    """The megatron flags that put DP communication inside the task loop."""
    ddp_config = getattr(models[0], "ddp_config", None)
    found = []
    if getattr(ddp_config, "overlap_grad_reduce", False):
        found.append("overlap_grad_reduce (--overlap-grad-reduce)")
    if getattr(ddp_config, "overlap_param_gather", False):
        found.append("overlap_param_gather (--overlap-param-gather)")
    return found


def whole_stage_agreement(models, *, device_type: str, data_parallel_size: int, forward_only: bool = False) -> bool:
    """Does DP communication here need a rule on CUDA (interleaving, DP > 1, an overlap flag), so
    that lock-step spans every DP replica of the stage (module docstring)?"""
    return device_type == "cuda" and dp_communication(
        models, device_type=device_type, data_parallel_size=data_parallel_size, choice=LOCKSTEP,
        forward_only=forward_only) == LOCKSTEP


IN_LOOP, LOCKSTEP, AFTER_LOOP, EPOCHS = "in-loop", "lockstep", "after-loop", "epochs"
DP_OVERLAP_CHOICES = ("auto", EPOCHS, LOCKSTEP, AFTER_LOOP)


def dp_communication(models, *, device_type: str, data_parallel_size: int, choice: str = "auto",
                     forward_only: bool = False) -> str:
    """Where this call's DP communication goes: ``IN_LOOP`` (where megatron issues it, covered
    as it is), ``EPOCHS`` (there, under the epoch rule), ``LOCKSTEP`` (in the loop, under the
    whole-stage agreement) or ``AFTER_LOOP``."""
    return dp_communication_of_layout(
        overlap=bool(overlapping_flags(models)), num_chunks=len(models), device_type=device_type,
        data_parallel_size=data_parallel_size, choice=choice, forward_only=forward_only)


def dp_communication_of_layout(*, overlap: bool, num_chunks: int, device_type: str, data_parallel_size: int,
                               choice: str = "auto", forward_only: bool = False) -> str:
    """``dp_communication`` from the layout (``overlap``: an overlap flag is set) without the models."""
    if forward_only or data_parallel_size <= 1 or not overlap:
        return IN_LOOP
    if choice == AFTER_LOOP:
        return AFTER_LOOP
    if num_chunks < 2 or (device_type != "cuda" and choice not in (LOCKSTEP, EPOCHS)):
        return IN_LOOP
    return EPOCHS if choice == "auto" else choice  # auto: the epoch rule (module docstring)


def describe(mode: str, choice: str, models, data_parallel_size: int) -> str:
    """One line for the job's log: what ``dp_communication`` chose and why."""
    flags = " ".join("--" + f.split("(--")[1].rstrip(")") for f in overlapping_flags(models))
    where = {LOCKSTEP: "in the task loop, every DP replica of a stage in the agreement (lock-step)",
             EPOCHS: "in the task loop at fixed DP points, rounds in epoch order (replicas independent between "
                     "DP points); the first iteration runs them after the loop and measures which DP points "
                     "to keep"}.get(mode, "parameter all-gathers before the task loop, reductions after it "
                                         "(replicas independent)")
    why = f"--rrfp-dp-overlap {choice}" + ("; 'after-loop' or 'lockstep' name the others" if choice == "auto" else "")
    layout = f"DP {data_parallel_size}" + (f" x {len(models)} chunks" if len(models) > 1 else "")
    return f"megatron-rrfp: {layout} with {flags}: {where} ({why})"


def overlapped_dp_communication_allowed(*, device_type: str, data_parallel_size: int, interleaved: bool,
                                        whole_stage: bool = True) -> bool:
    """May DP reductions / all-gathers run inside the task loop here? Always, given the
    whole-stage agreement where ``whole_stage_agreement`` asks for it."""
    return whole_stage or device_type != "cuda" or data_parallel_size <= 1 or not interleaved


__all__ = ["AFTER_LOOP", "DP_OVERLAP_CHOICES", "EPOCHS", "IN_LOOP", "LOCKSTEP", "describe",
           "dp_communication", "dp_communication_of_layout", "overlapped_dp_communication_allowed",
           "overlapping_flags", "whole_stage_agreement"]
