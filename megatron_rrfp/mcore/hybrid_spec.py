"""A HybridModel stack spec whose attention, MLP and MoE layers are megatron-core's local modules.

megatron-core's own ``hybrid_stack_spec`` (megatron.core.models.hybrid.hybrid_layer_specs)
builds every layer from Transformer Engine modules, and ``HybridStack`` builds its final norm
as ``TENorm`` whatever the spec says, so a HybridModel cannot run without TE (e.g. on CPU).
``hybrid_stack_spec`` here is the stock spec with:

  ``*`` attention   TransformerLayer(input_layernorm + SelfAttention) of get_gpt_layer_local_spec
  ``-`` MLP         MLPLayer(pre_mlp_layernorm + MLP) of get_gpt_layer_local_spec
  ``E`` MoE         MoETransformerLayer with megatron-core's local MoE (no grouped GEMM)
  final norm        the local spec's norm (``LocalNormHybridStack``)

Their linears are megatron-core's ColumnParallelLinear / RowParallelLinear, which the
default policy's B/W split covers (split/megatron_linear.py). ``M`` (Mamba), ``G`` (GDN), ``D``/``+``
(MLA variants) keep the stock TE modules: they need CUDA kernels anyway, and their
gradients are all computed in B. No MTP block (``/`` in a pattern is refused by HybridModel).

Megatron-LM: ``pretrain_hybrid.py --spec megatron_rrfp.mcore.hybrid_spec hybrid_stack_spec``.
megatron-core >= 0.18 (``compat.hybrid_model_unavailable``); importing this module on older
releases raises ImportError.
"""
from __future__ import annotations

import dataclasses

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.models.hybrid import hybrid_layer_specs
from megatron.core.models.hybrid.hybrid_block import HybridStack
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

__all__ = ["LocalNormHybridStack", "hybrid_stack_spec", "LOCAL_LAYER_SYMBOLS", "CUDA_ONLY_LAYER_SYMBOLS"]

LOCAL_LAYER_SYMBOLS = frozenset("*-E")
"""Pattern symbols whose layers this spec builds from megatron-core's local modules."""
CUDA_ONLY_LAYER_SYMBOLS = {"M": "Mamba", "G": "Gated DeltaNet", "D": "DeepSeek sparse attention", "+": "MLA"}
"""Symbols left to the stock Transformer Engine spec (their kernels need CUDA)."""

_local = get_gpt_layer_local_spec().submodules  # the GPT local layer, split into its two halves
_norm = _local.input_layernorm  # WrappedTorchNorm, or apex's FusedLayerNorm where apex is installed


class LocalNormHybridStack(HybridStack):
    """HybridStack with the local spec's final norm instead of TENorm (same parameter names)."""

    def __init__(self, *args, post_layer_norm: bool = True, **kwargs) -> None:
        super().__init__(*args, post_layer_norm=False, **kwargs)  # skips building TENorm
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            self.final_norm = _norm(config=self.config, hidden_size=self.config.hidden_size,
                                    eps=self.config.layernorm_epsilon)


_attention_layer = ModuleSpec(
    module=TransformerLayer,
    submodules=TransformerLayerSubmodules(input_layernorm=_norm, self_attention=_local.self_attention,
                                          self_attn_bda=_local.self_attn_bda))
_mlp_layer = ModuleSpec(
    module=MLPLayer,
    submodules=TransformerLayerSubmodules(pre_mlp_layernorm=_local.pre_mlp_layernorm, mlp=_local.mlp,
                                          mlp_bda=_local.mlp_bda))
_moe_layer = ModuleSpec(
    module=MoETransformerLayer,
    # num_experts only selects the MoE branch of the spec; the count comes from config.num_moe_experts
    submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=_norm, mlp=get_moe_module_spec(use_te=False, num_experts=8, moe_grouped_gemm=False),
        mlp_bda=_local.mlp_bda))

hybrid_stack_spec = ModuleSpec(
    module=LocalNormHybridStack,
    submodules=dataclasses.replace(hybrid_layer_specs.hybrid_stack_spec.submodules, attention_layer=_attention_layer,
                                   mlp_layer=_mlp_layer, moe_layer=_moe_layer, mtp_block_spec=None))
"""HybridModel(hybrid_stack_spec=...) with local attention / MLP / MoE layers (see the module docstring)."""
