"""Messages a rank must refuse, and a rank's state after a failed iteration.

In process (milliseconds): the wire header's checks (magic, kind, dtype, dimensions, size).
One distributed launch (PP=2, real transport, real megatron-core stage) batches the rest:
an iteration that fails and then one that succeeds in the same processes (the runtime is
cleaned up: timers stopped, no_sync exited, a fresh transport), a forged header and a
message for a microbatch the iteration does not have (each fails the receiving rank at
once with PipelineStallError naming the sender), and re-created process groups.
"""
from __future__ import annotations

import pytest
import torch

from helpers import messages
from megatron_rrfp.launch.function import launch
from megatron_rrfp.runtime.transport import (
    HEADER_LEN,
    MAX_DIMS,
    MAX_MESSAGE_BYTES,
    TransportError,
    decode_header,
    encode_header,
    header_from_fields,
)


def _fields(**changes) -> list[int]:
    fields = encode_header("activation", 3, 1, torch.empty(2, 5)).tolist()
    names = ["magic", "kind", "microbatch", "chunk", "dtype", "ndim"]
    for name, value in changes.items():
        if name.startswith("dim"):
            fields[len(names) + int(name[3:])] = value
        else:
            fields[names.index(name)] = value
    return fields


def test_a_well_formed_header_decodes():
    header = header_from_fields(_fields())
    assert (header.kind, header.microbatch, header.chunk, header.dtype, header.shape) == \
        ("activation", 3, 1, torch.float32, (2, 5))
    assert decode_header(torch.tensor(_fields())) == header


@pytest.mark.parametrize("changes, problem", [
    (dict(magic=0), "corrupt or foreign message header"),
    (dict(kind=2), "unknown message kind code 2"),
    (dict(kind=-1), "unknown message kind code -1"),
    (dict(dtype=99), "unknown dtype code 99"),
    (dict(dtype=-3), "unknown dtype code -3"),
    (dict(ndim=MAX_DIMS + 1), "9 dimensions"),
    (dict(ndim=-1), "-1 dimensions"),
    (dict(dim0=-2), "dimensions must be >= 0"),
    (dict(dim3=7), "padding 0"),  # a dimension beyond ndim
    (dict(dim0=2**31, dim1=2**31), "over the"),
    (dict(ndim=8, **{f"dim{i}": 2**8 for i in range(8)}), "over the"),  # 2**64 elements: no int64 overflow
    (dict(microbatch=-1), "microbatch -1"),
    (dict(chunk=-5), "chunk -5"),
], ids=lambda v: str(v))
def test_malformed_headers_are_refused_before_any_allocation(changes, problem):
    with pytest.raises(TransportError, match="invalid message header|corrupt or foreign") as info:
        header_from_fields(_fields(**changes))
    assert problem in str(info.value)


def test_a_short_or_long_header_is_refused():
    with pytest.raises(TransportError, match=f"expected {HEADER_LEN} fields"):
        header_from_fields(_fields()[:-1])
    with pytest.raises(TransportError, match=f"expected {HEADER_LEN} fields"):
        header_from_fields(_fields() + [0])


def test_the_size_limit_admits_large_real_activations():
    seq, batch, hidden = 8192, 4, 16384  # a long-sequence bf16 activation: 1 GiB
    fields = encode_header("activation", 0, 0, torch.empty(0, dtype=torch.bfloat16)).tolist()
    fields[5], fields[6:9] = 3, [seq, batch, hidden]
    assert header_from_fields(fields).shape == (seq, batch, hidden)
    assert seq * batch * hidden * 2 < MAX_MESSAGE_BYTES


@pytest.mark.timeout(300)
def test_failed_then_successful_iterations_bad_messages_and_new_groups_in_the_same_processes():
    results = launch(messages.failure_and_recovery, world_size=2, timeout=240)
    by_rank = {r["rank"]: r for r in results}
    first, last = by_rank[0], by_rank[1]
    # 1. an iteration that fails (stage 1's forward step raises): both ranks raise, fast
    assert last["failed"]["error"] == "RuntimeError" and "bad batch" in last["failed"]["message"]
    assert first["failed"]["error"] == "PipelineStallError" and first["failed"]["seconds"] < 15
    for r in results:  # ... and leave nothing behind
        assert r["after_failure"] == {"timer_running": False, "no_sync_open": 0, "session_discarded": True}, r
    # 2. the next iteration in the same processes is exact
    assert all(r["recovered_matches_reference"] for r in results), results
    # 3. a forged header: the receiver fails at once naming the sender, then recovers
    assert last["forged"]["error"] == "PipelineStallError", last["forged"]
    assert "rank 0" in last["forged"]["message"] and "invalid message header" in last["forged"]["message"]
    assert last["forged"]["seconds"] < 5
    # 4. an activation for a microbatch this iteration does not have
    stray = last["stray"]
    assert stray["error"] == "PipelineStallError" and stray["seconds"] < 5, stray
    assert "unexpected activation for microbatch 99, chunk 0 from rank 0" in stray["message"]
    # 5. after every failure and after re-created process groups: exact again, fresh runtime
    assert all(r["after_bad_messages_matches_reference"] for r in results), results
    assert all(r["new_groups_new_session"] and r["new_groups_matches_reference"] for r in results), results


def test_a_discarded_inbox_drops_what_waits_and_refuses_late_arrivals():
    from megatron_rrfp.runtime.inbox import Inbox

    inbox = Inbox()
    inbox.put("stale 1")
    inbox.put("stale 2")
    assert inbox.close() == 2
    inbox.put("arrived after the failure")
    assert inbox.drain() == []
