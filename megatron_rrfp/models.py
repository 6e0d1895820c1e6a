"""Small models and synthetic data for tests, benchmarks and the training driver.

Two kinds of pipeline stage, both megatron-core style (``set_input_tensor(list)``, a
``config`` attribute, the stage's role in ``pre_process``/``post_process``):

- ``build_gpt_stage``: megatron-core's own ``GPTModel`` with the local (no Transformer
  Engine) layer spec: the real thing, tiny.
- ``MLPStage``: residual MLP blocks of ``ColumnParallelLinear``/``RowParallelLinear``;
  cheap, exercises TP, and its initialisation does not depend on the parallel layout
  (each block is seeded by its *global* index), so any TPxPPxDP layout computes the same
  function as one process.

Call ``megatron_rrfp.adapter.enable_cpu_reference_schedules()`` before running either on
a CPU-only host. ``pp1_parameter_names`` maps a stage's parameters to the names they
have in the PP=1 model, so a pipelined run can be compared with a sequential one.
"""
from __future__ import annotations

import re
from functools import partial

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule

__all__ = [
    "MLPStage", "build_gpt_stage", "build_mlp_stage", "gpt_forward_step", "mlp_forward_step",
    "pp1_parameter_names", "synthetic_gpt_batches", "synthetic_mlp_batches", "tiny_gpt_config",
]


# --------------------------------------------------------------------------- config


def tiny_gpt_config(**overrides) -> TransformerConfig:
    """A tiny fp32 TransformerConfig that runs on CPU; keyword ``overrides`` win.

    Parallel sizes default to megatron's initialised parallel_state (1 when it is not
    initialised): TransformerBlock splits layers by ``config.pipeline_model_parallel_size``
    but picks its share by parallel_state's rank, so the two must agree.
    ``num_layers`` defaults to 2 per (virtual) stage. Dropout is 0 so results do not
    depend on RNG streams (the CUDA RNG tracker is a no-op on CPU, see adapter), and all
    fusions are off (they need CUDA kernels).
    """
    tp, pp, vpp, cp = _parallel_sizes()
    defaults = dict(
        num_layers=2 * pp * (vpp or 1),
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,  # dtype of p2p receive buffers; required when PP > 1
        use_cpu_initialization=True,  # init full weights on CPU, then take this TP shard
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        deallocate_pipeline_outputs=True,  # as in Megatron-LM training: exercises custom_backward
    )
    defaults.update(overrides)
    return TransformerConfig(**defaults)


def _parallel_sizes() -> tuple[int, int, int | None, int]:
    """(tp, pp, vpp, cp) of megatron's parallel_state, or sizes 1 if not initialised."""
    if not parallel_state.model_parallel_is_initialized():
        return 1, 1, None, 1
    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_virtual_pipeline_model_parallel_world_size(),
            parallel_state.get_context_parallel_world_size())


def _stage_roles(pre_process, post_process, vp_stage) -> tuple[bool, bool]:
    """Default roles from parallel_state; with interleaving only the first (last) model
    chunk of the first (last) rank embeds (has the head)."""
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                             vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                             vp_stage=vp_stage)
    return pre_process, post_process


def _stage_seed(seed: int, pp_rank: int, vp_stage: int | None) -> int:
    # Distinct per (pp rank, model chunk), equal across TP and DP ranks: with
    # use_cpu_initialization every TP rank draws the *full* weight and keeps its shard.
    return seed + 1_000 * pp_rank + 100_000 * (vp_stage or 0)


# --------------------------------------------------------------------------- GPT


def build_gpt_stage(config: TransformerConfig, *, vocab_size: int, seq_length: int, seed: int,
                    pre_process: bool | None = None, post_process: bool | None = None,
                    vp_stage: int | None = None) -> GPTModel:
    """This rank's GPTModel stage (one model chunk when interleaving: pass ``vp_stage``).

    Initialisation is a function of (seed, pp rank, vp_stage) only: the CPU generator is
    seeded around construction (model_parallel_cuda_manual_seed needs CUDA) and restored
    afterwards. So stages differ from the same layers of a PP=1 model; to compare with
    one, copy its weights in with ``pp1_parameter_names``. Embeddings and output layer
    are untied, so PP>1 needs no embedding-group all-reduce.
    """
    pre_process, post_process = _stage_roles(pre_process, post_process, vp_stage)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_stage_seed(seed, pp_rank, vp_stage))
        return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                        vocab_size=vocab_size, max_sequence_length=seq_length,
                        pre_process=pre_process, post_process=post_process,
                        share_embeddings_and_output_weights=False, vp_stage=vp_stage)


def synthetic_gpt_batches(*, seed: int, micro_batch_size: int, seq_length: int,
                          vocab_size: int):
    """Endless deterministic GPT micro-batches, identical on every rank for one seed.

    Each is a dict shaped like Megatron-LM's ``get_batch``: tokens, labels, position_ids
    [b, s] int64; loss_mask [b, s] float; attention_mask [1, 1, s, s] bool, True where
    attention is *blocked* (causal).
    """
    from .data import gpt_batch  # one definition of Megatron-LM's get_batch layout

    generator = torch.Generator().manual_seed(seed)
    while True:
        text = torch.randint(vocab_size, (micro_batch_size, seq_length + 1), generator=generator)
        yield gpt_batch(text.numpy(), torch.device("cpu"))


def gpt_forward_step(data_iterator, model: GPTModel):
    """forward_step_func for megatron-core schedules (and our executor) on a GPT stage.

    Data: a stage (model chunk) draws one batch per micro-batch iff it embeds or has the
    head; a middle stage draws nothing and passes attention_mask=None (the causal mask is
    then built inside attention), like Megatron-LM's get_batch. Every stage's iterator
    must yield micro-batches in the same order.
    Loss: the 3-tuple form (summed loss, token count, report); the schedule divides by
    the token count and the number of micro-batches.
    """
    pre_process, post_process = _roles_of(model)
    batch = next(data_iterator) if (pre_process or post_process) else None
    if batch is None:
        output = model(None, None, None)
        return output, partial(_gpt_loss, None)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"] if post_process else None)
    return output, partial(_gpt_loss, batch["loss_mask"])


def _roles_of(model) -> tuple[bool, bool]:
    """(pre_process, post_process) of a stage, through DDP / Float16Module wrappers."""
    from megatron.core.utils import get_attr_wrapped_model

    return get_attr_wrapped_model(model, "pre_process"), get_attr_wrapped_model(model, "post_process")


def _gpt_loss(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)  # per-token cross entropy [b*s]
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


# --------------------------------------------------------------------------- MLP


class MLPStage(MegatronModule):
    """Residual MLP blocks ``x + W2 gelu(W1 x)`` as one pipeline stage; W1 is
    column-parallel, W2 row-parallel. Activations are [s, b, hidden_size] like GPT's.

    The first stage takes ``inputs`` from the batch; the others take what
    ``set_input_tensor`` gave them. The last stage adds a column-parallel head with
    gathered output; the loss is the squared error against ``targets``.
    Blocks are numbered globally (``first_block`` ...) and block i is initialised from
    ``seed + i``, so results do not depend on how blocks are spread over stages.
    """

    def __init__(self, config: TransformerConfig, *, seed: int, first_block: int,
                 num_blocks: int, pre_process: bool, post_process: bool):
        super().__init__(config=config)
        self.model_type = ModelType.encoder_or_decoder  # read by the schedules
        self.share_embeddings_and_output_weights = False  # read by finalize_model_grads
        self.pre_process = pre_process
        self.post_process = post_process
        self.first_block = first_block
        self.input_tensor = None
        self.blocks = torch.nn.ModuleList(
            _seeded(seed + first_block + i, _MLPBlock, config) for i in range(num_blocks))
        self.head = None
        if post_process:
            self.head = _seeded(seed - 1, tensor_parallel.ColumnParallelLinear,
                                config.hidden_size, config.hidden_size, config=config,
                                init_method=config.init_method, gather_output=True)

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, list):
            (input_tensor,) = input_tensor
        self.input_tensor = input_tensor

    def forward(self, inputs: torch.Tensor | None = None) -> torch.Tensor:
        x = inputs if self.pre_process else self.input_tensor
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x, _ = self.head(x)
        return x


class _MLPBlock(torch.nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.fc1 = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, config.ffn_hidden_size, config=config,
            init_method=config.init_method, gather_output=False)
        self.fc2 = tensor_parallel.RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=True, input_is_parallel=True,
            skip_bias_add=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.fc1(x)
        out, _ = self.fc2(torch.nn.functional.gelu(hidden))
        return x + out


def _seeded(seed: int, cls, *args, **kwargs):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls(*args, **kwargs)


def build_mlp_stage(config: TransformerConfig, *, seed: int, pre_process: bool | None = None,
                    post_process: bool | None = None, vp_stage: int | None = None) -> MLPStage:
    """This rank's MLPStage: ``config.num_layers`` blocks split evenly over pp x vpp
    model chunks in Megatron's interleaved order (chunk = vp_stage * pp + pp_rank)."""
    pre_process, post_process = _stage_roles(pre_process, post_process, vp_stage)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    chunks = pp * vpp
    if config.num_layers % chunks:
        raise ValueError(f"num_layers={config.num_layers} does not split over pp={pp} x vpp={vpp}")
    per_chunk = config.num_layers // chunks
    chunk = (vp_stage or 0) * pp + parallel_state.get_pipeline_model_parallel_rank()
    return MLPStage(config, seed=seed, first_block=chunk * per_chunk, num_blocks=per_chunk,
                    pre_process=pre_process, post_process=post_process)


def synthetic_mlp_batches(*, seed: int, micro_batch_size: int, seq_length: int,
                          hidden_size: int):
    """Endless deterministic MLPStage micro-batches (inputs, targets: [s, b, h] float),
    identical on every rank for one seed."""
    generator = torch.Generator().manual_seed(seed)
    shape = (seq_length, micro_batch_size, hidden_size)
    while True:
        yield {"inputs": torch.randn(shape, generator=generator),
               "targets": torch.randn(shape, generator=generator)}


def mlp_forward_step(data_iterator, model: MLPStage):
    """forward_step_func for MLPStage; draws data like ``gpt_forward_step``."""
    pre_process, post_process = _roles_of(model)
    batch = next(data_iterator) if (pre_process or post_process) else None
    output = model(batch["inputs"] if pre_process else None)
    targets = batch["targets"] if post_process else None
    return output, partial(_mlp_loss, targets)


def _mlp_loss(targets, output_tensor):
    # Summed over hidden; one "token" per (s, b) position so the 3-tuple averaging matches
    # GPT's per-token loss.
    loss = torch.sum((output_tensor.float() - targets) ** 2)
    num_tokens = torch.tensor(targets.shape[0] * targets.shape[1], dtype=torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"mse loss": report}


# --------------------------------------------------------------------------- comparison

_GPT_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_MLP_BLOCK = re.compile(r"^blocks\.(\d+)\.")


def pp1_parameter_names(model: torch.nn.Module) -> dict[str, str]:
    """Map each parameter name of a stage to its name in the PP=1 model (same TP).

    GPT layers are renumbered from their global ``layer_number``; MLPStage blocks from
    ``first_block``; embedding, final norm and heads keep their names.
    """
    names = {}
    for name, _ in model.named_parameters():
        if match := _GPT_LAYER.match(name):
            layer = model.decoder.layers[int(match.group(1))]
            names[name] = _GPT_LAYER.sub(f"decoder.layers.{layer.layer_number - 1}.", name)
        elif match := _MLP_BLOCK.match(name):
            names[name] = _MLP_BLOCK.sub(f"blocks.{model.first_block + int(match.group(1))}.",
                                         name)
        else:
            names[name] = name
    return names
