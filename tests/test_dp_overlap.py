"""Where data-parallel communication may overlap RRFP's task loop (mcore/dp_overlap.py)."""
from __future__ import annotations

from types import SimpleNamespace

from megatron_rrfp.mcore.dp_overlap import dp_overlap_blockers, overlapped_dp_communication_allowed


def _ddp(grad: bool, param: bool):
    return SimpleNamespace(ddp_config=SimpleNamespace(overlap_grad_reduce=grad, overlap_param_gather=param))


def test_only_cuda_with_dp_and_interleaving_is_outside_the_argument():
    assert not overlapped_dp_communication_allowed(device_type="cuda", data_parallel_size=2, interleaved=True)
    for device, dp, interleaved in (("cpu", 2, True), ("cuda", 1, True), ("cuda", 2, False)):
        assert overlapped_dp_communication_allowed(device_type=device, data_parallel_size=dp, interleaved=interleaved)


def test_blockers_name_the_megatron_flags():
    chunks = [_ddp(True, True), _ddp(True, True)]
    assert dp_overlap_blockers(chunks, device_type="cuda", data_parallel_size=2, split_backward=False) == [
        "overlap_grad_reduce (--overlap-grad-reduce)", "overlap_param_gather (--overlap-param-gather)"]
    # the split backward already reduces after the last W; the all-gathers still overlap
    assert dp_overlap_blockers(chunks, device_type="cuda", data_parallel_size=2, split_backward=True) == [
        "overlap_param_gather (--overlap-param-gather)"]
    assert dp_overlap_blockers(chunks[:1], device_type="cuda", data_parallel_size=2, split_backward=False) == []
    assert dp_overlap_blockers([_ddp(False, False)] * 2, device_type="cuda", data_parallel_size=8,
                               split_backward=False) == []
