"""The DP epoch rule (``--rrfp-dp-overlap epochs``, docs/design/dp-epochs.md) on gloo ranks:
interleaved DP2 pipelines with --overlap-grad-reduce --overlap-param-gather
--use-distributed-optimizer, the rule forced on CPU (the rounds transport over gloo), losses and
every gradient against Megatron's own interleaved schedule, with the B/W split (the default
policy) and without it (bf). Deadlock freedom on a single-queue device is the emulation's
(tests/unit/test_transport_emulated.py)."""
from __future__ import annotations

import pytest

from megatron_rrfp.launch.function import launch


def _epochs_against_megatron(pp: int, hints: tuple) -> list:
    import torch.distributed as dist

    from megatron_rrfp.runtime import executor
    from megatron_rrfp.selfcheck.equivalence import gpt_equivalence

    books: list = []
    original = executor.PipelineIteration.__init__

    def recording(self, *args, **kwargs):  # which iterations ran under the rule, from outside the package
        books.append(kwargs.get("epochs") is not None)
        original(self, *args, **kwargs)

    executor.PipelineIteration.__init__ = recording
    try:
        ctx = {"world": dist.get_world_size(), "seed": 0, "stall_timeout_s": 60.0}
        results = [gpt_equivalence(ctx, pp=pp, chunks=2, overlap=True, dp_overlap="epochs", hint=hint, iterations=2,
                                   num_microbatches=2 * pp, device="cpu") for hint in hints]
    finally:
        executor.PipelineIteration.__init__ = original
    return results + [books]


def _check(results_per_rank: list, hints: tuple) -> None:
    for results in results_per_rank:
        *steps, books = results
        assert [status for status, _ in steps] == ["PASS"] * len(hints), steps
        assert all("2 chunks x DP=2, overlapped DP + distributed optimizer" in detail for _, detail in steps), steps
        assert any(books) and books.count(True) == 2 * len(hints), books  # every training call ran the rule


@pytest.mark.timeout(600)
def test_epoch_rule_dp2_pp2_two_chunks_equals_megatron_with_and_without_the_split():
    hints = ("default", "bf")  # default splits the backward (B, W) where the model allows; bf does not
    _check(launch(_epochs_against_megatron, world_size=4, tp=1, pp=2, timeout=540, args=(2, hints)), hints)


@pytest.mark.timeout(600)
def test_epoch_rule_dp2_pp4_two_chunks_equals_megatron_with_and_without_the_split():
    hints = ("default", "bf")
    _check(launch(_epochs_against_megatron, world_size=8, tp=1, pp=4, timeout=540, args=(4, hints)), hints)
