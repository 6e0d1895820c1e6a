"""``--model hybrid``: megatron-core's HybridModel, its layers named by ``--hybrid-layer-pattern``.

Megatron-LM's pattern syntax (megatron.core.models.hybrid.hybrid_layer_allocation): one
symbol per layer, ``|`` between pipeline segments; segment ``vp_stage x PP + pp_rank``
is that stage's model chunk. This driver has no virtual pipeline, so a pattern has one
segment per pipeline stage. The checks are plain string checks, run before any rank
starts; megatron-core is not imported.
"""
from __future__ import annotations

PIPE = "|"
TRAINED = {"*": "attention", "-": "MLP", "E": "MoE"}
"""Symbols this driver builds (local megatron-core layers, mcore/hybrid_spec.py); E with --num-experts."""
NEEDS_CUDA = {"M": "Mamba", "G": "Gated DeltaNet", "D": "DeepSeek sparse attention", "+": "MLA"}
"""Megatron's other layer symbols: their kernels need CUDA (mamba-ssm, flash-linear-attention, TE)."""
MOE = "E"


def pattern_layers(pattern: str) -> int:
    """The number of layers a pattern names (its symbols without the ``|``)."""
    return len(pattern.replace(PIPE, ""))


def check_hybrid(c) -> None:
    """ValueError naming --hybrid-layer-pattern (or the megatron-core release needed)."""
    from ..mcore.compat import hybrid_model_unavailable

    pp = c.pipeline_model_parallel_size
    missing = hybrid_model_unavailable()
    if missing:
        raise ValueError(f"--model hybrid: {missing}; use --model gpt on this release")
    pattern = c.hybrid_layer_pattern
    if not pattern:
        raise ValueError(f"--model hybrid needs --hybrid-layer-pattern (e.g. {_example(pp)!r}: * attention, - MLP, "
                         "| between pipeline stages)")
    flag = f"--hybrid-layer-pattern {pattern!r}"
    if "/" in pattern:
        raise ValueError(f"{flag}: multi-token prediction ('/' patterns) is not offered by megatron-rrfp train")
    for symbol in dict.fromkeys(pattern.replace(PIPE, "")):
        if symbol in NEEDS_CUDA and c.cpu:
            raise ValueError(f"{flag}: {symbol} ({NEEDS_CUDA[symbol]}) layers need CUDA kernels; on CPU (--cpu) "
                             "use * (attention) and - (MLP)")
        if symbol == MOE and not c.num_experts:
            raise ValueError(f"{flag}: E (MoE) layers need --num-experts N (and, optionally, "
                             "--expert-model-parallel-size, --moe-router-topk, ...: the MoE flags of --model gpt)")
        if symbol not in TRAINED and symbol not in NEEDS_CUDA:
            raise ValueError(f"{flag}: unknown layer symbol {symbol!r}; use * (attention), - (MLP), E (MoE), | "
                             "between pipeline stages")
    if c.num_experts and MOE not in pattern:
        raise ValueError(f"--num-experts {c.num_experts} with {flag}: no E (MoE) layer to give experts; add E "
                         "layers or drop --num-experts")
    segments = pattern.split(PIPE)
    if len(segments) != pp:
        raise ValueError(f"{flag} has {len(segments)} pipeline segment(s) but --pipeline-model-parallel-size is {pp}: "
                         f"give each stage its layers, separated by '|' (e.g. {_example(pp, pattern)!r})")
    empty = [i for i, segment in enumerate(segments) if not segment]
    if empty:
        raise ValueError(f"{flag}: pipeline stage {empty[0]} has no layers (an empty segment between '|')")


def _example(pp: int, pattern: str = "") -> str:
    layers = pattern.replace(PIPE, "")
    if layers and len(layers) % pp == 0:  # the user's layers, split evenly
        size = len(layers) // pp
        return PIPE.join(layers[i * size:(i + 1) * size] for i in range(pp))
    return PIPE.join(["*-"] * pp)
