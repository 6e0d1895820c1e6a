"""The DP epoch rule (``--rrfp-dp-overlap epochs``, docs/design/dp-epochs.md) on gloo ranks:
interleaved DP2 pipelines with --overlap-grad-reduce --overlap-param-gather
--use-distributed-optimizer, the rule forced on CPU (the rounds transport over gloo), losses and
every gradient against Megatron's own interleaved schedule, with the B/W split (the default
policy) and without it (bf). Deadlock freedom on a single-queue device is the emulation's
(tests/unit/test_transport_emulated.py)."""
from __future__ import annotations

import pytest

from megatron_rrfp.launch.function import launch


class _Forced(dict):
    """The schedule state's variant table with one variant for every job (set from outside)."""

    def __init__(self, variant) -> None:
        super().__init__()
        self.variant = variant

    def get(self, key, default=None):
        return self.variant

    def __contains__(self, key) -> bool:
        return True


def _epochs_against_megatron(pp: int, hints: tuple, variants: tuple = (None,), chunks: int = 2,
                             iterations: int = 2, choice=None) -> list:
    """``choice``: the variant the simulator's choice returns (patched from outside), else its own."""
    import torch.distributed as dist

    from megatron_rrfp.mcore.grad_sync import GradSyncController
    from megatron_rrfp.mcore.state import ScheduleState
    from megatron_rrfp.runtime import executor
    from megatron_rrfp.selfcheck.equivalence import gpt_equivalence
    from megatron_rrfp.sim import dp_epochs

    books: list = []
    original, controlling = executor.PipelineIteration.__init__, GradSyncController.__init__
    controllers: list = []

    def recording(self, *args, **kwargs):  # which iterations ran under the rule, from outside the package
        sync = controllers[-1]  # the call builds its grad-sync controller right before the iteration
        # False: the measuring call (DP collectives out of the loop); else the variant's DP collectives
        # kept out of the loop, and whether the rule's book ran (a variant with no DP point runs none)
        books.append(sync.in_loop and (tuple(sorted(sync.after_loop_chunks)), sync.gathers_before,
                                       kwargs.get("epochs") is not None))
        original(self, *args, **kwargs)

    def controller(self, *args, **kwargs):
        controlling(self, *args, **kwargs)
        controllers.append(self)

    GradSyncController.__init__ = controller
    made, launching = ScheduleState.__init__, GradSyncController._launch_after_loop
    after_loop: list = []

    def recording_launches(controller, chunks):  # which chunks' reductions went after the loop
        chunks = list(chunks)
        if chunks:
            after_loop.append(tuple(chunks))
        return launching(controller, chunks)

    def forcing(state, *args, **kwargs):  # a state made between calls keeps the forced variant
        made(state, *args, **kwargs)
        if forced is not None:
            state.epoch_variants = _Forced(forced)

    choosing = dp_epochs.choose_variant
    if choice is not None:
        dp_epochs.choose_variant = lambda *args, **kwargs: (choice, choosing(*args, **kwargs)[1])
    executor.PipelineIteration.__init__, ScheduleState.__init__ = recording, forcing
    GradSyncController._launch_after_loop = recording_launches
    results = []
    try:
        ctx = {"world": dist.get_world_size(), "seed": 0, "stall_timeout_s": 60.0}
        for forced in variants:
            if forced is not None:
                ScheduleState.get().epoch_variants = _Forced(forced)
            results += [gpt_equivalence(ctx, pp=pp, chunks=chunks, overlap=True, dp_overlap="epochs", hint=hint,
                                        iterations=iterations, num_microbatches=2 * pp, device="cpu")
                        for hint in hints]
    finally:
        dp_epochs.choose_variant = choosing
        executor.PipelineIteration.__init__, ScheduleState.__init__ = original, made
        GradSyncController._launch_after_loop, GradSyncController.__init__ = launching, controlling
    return results + [after_loop, books]


def _check(results_per_rank: list, hints: tuple, variants: int = 1, *, measured: bool = True) -> list:
    """Every run PASSed; each job's first training call measured (no book: epoch_tuning.py) where
    ``measured``, and every other training call ran the rule."""
    ran_everywhere, after_loop = [], []
    for results in results_per_rank:
        *steps, launched, books = results
        after_loop += launched
        assert [status for status, _ in steps] == ["PASS"] * len(hints) * variants, steps
        assert all("chunks x DP=2, overlapped DP + distributed optimizer" in detail for _, detail in steps), steps
        ran = [b for b in books if b is not False]
        assert books.count(False) == (len(hints) * variants if measured else 0), books
        assert len(ran) == (2 - measured) * len(hints) * variants, books
        ran_everywhere += ran
    return ran_everywhere, after_loop


@pytest.mark.timeout(600)
def test_epoch_rule_dp2_pp2_two_chunks_equals_megatron_with_and_without_the_split():
    hints = ("default", "bf")  # default splits the backward (B, W) where the model allows; bf does not
    _, after_loop = _check(launch(_epochs_against_megatron, world_size=4, tp=1, pp=2, timeout=540, args=(2, hints)),
                           hints)
    assert after_loop.count((0, 1)) >= 4 * len(hints), after_loop  # each rank's measuring call: after its loop


@pytest.mark.timeout(600)
def test_epoch_rule_dp2_pp4_two_chunks_equals_megatron_with_and_without_the_split():
    hints = ("default", "bf")
    _check(launch(_epochs_against_megatron, world_size=8, tp=1, pp=4, timeout=540, args=(4, hints)), hints)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("chunks", [2, 3])
def test_epoch_rule_variants_with_dp_collectives_out_of_the_loop_equal_megatron(chunks):
    """The rule's other variants (the policy's order as the timeline; chunks reduced after the
    loop, so they hold no DP point; every all-gather before the loop): the same losses and
    gradients as Megatron's schedule."""
    from megatron_rrfp.policy.epochs import EpochVariant

    hints = ("default", "bf")
    every = frozenset(range(chunks))
    variants = (EpochVariant("policy", frozenset({0})), EpochVariant("megatron", every, gathers_before=chunks > 2))
    ran, after_loop = _check(launch(_epochs_against_megatron, world_size=4, tp=1, pp=2, timeout=540,
                                    args=(2, hints, variants, chunks)), hints, len(variants), measured=False)
    # the timelines of those variants ran; with every chunk after the loop no DP point is left, and no book runs
    assert set(ran) == {((0,), False, True), (tuple(every), chunks > 2, False)}, ran
    assert set(after_loop) == {(0,), tuple(every)}, after_loop  # and their reductions went after the loop


@pytest.mark.timeout(600)
def test_a_choice_with_dp_points_is_timed_against_none_and_the_faster_kept():
    """Where the simulator's choice keeps a DP point (Megatron's order, both chunks reducing in the
    loop: forced here), the next 2 x TRIAL_CALLS training calls alternate it with the fastest
    variant without one, then every rank keeps the same one; every call equals Megatron's."""
    from megatron_rrfp.mcore.epoch_tuning import TRIAL_CALLS
    from megatron_rrfp.policy.epochs import DEFAULT_VARIANT

    iterations = 2 + 2 * TRIAL_CALLS  # measure; choose and try; decide and keep
    results = launch(_epochs_against_megatron, world_size=4, tp=1, pp=2, timeout=540,
                     args=(2, ("default",), (None,), 2, iterations, DEFAULT_VARIANT))
    kept = set()
    for *steps, _, books in results:
        assert [status for status, _ in steps] == ["PASS"], steps
        assert books[0] is False, books  # the measuring call
        rule, fallback = books[1], books[2]
        assert rule == ((), False, True), books  # both chunks reduce in the loop, at DP points
        assert fallback[2] is False and set(fallback[0]) == {0, 1}, books  # no DP point: no book
        assert books[1:1 + 2 * TRIAL_CALLS] == [rule, fallback] * TRIAL_CALLS, books
        assert books[1 + 2 * TRIAL_CALLS] in (rule, fallback), books
        kept.add(books[1 + 2 * TRIAL_CALLS])
    assert len(kept) == 1, kept  # every rank kept the same variant
