"""Interleaved (virtual) pipelines: RRFP vs megatron-core's interleaved schedule.

Model chunks, a data iterator per chunk, chunk priorities (forward: lower chunk first;
backward: higher chunk first) and the interleaved backpressure; random per-rank delays;
losses and every gradient within 1e-5 and the executed order asserted to differ.
"""
from __future__ import annotations

import pytest
from test_executor import _check

from helpers.interleaved import compare_interleaved_transports
from megatron_rrfp.launch.function import launch


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world,model,chunks,transports", [(2, "gpt", 2, ("threads",)),
                                                           (4, "mlp", 2, ("threads", "rounds")),
                                                           (4, "mlp", 4, ("threads", ("threads", "bf")))],
                         ids=["pp2-gpt-2chunks", "pp4-mlp-2chunks", "pp4-mlp-4chunks"])
def test_interleaved_chunks_match_megatron(world, model, chunks, transports):
    # PP=4 also over the device transport's rounds (on gloo): the ring's closing pair led by stage 0;
    # 4 chunks also under bf, whose ranking reads Megatron's interleaved table
    results = launch(compare_interleaved_transports, world_size=world, vpp=chunks, timeout=360,
                     args=(transports,), kwargs={"model": model, "iterations": 2})
    _check(results)
