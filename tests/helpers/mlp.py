"""A cheap test model: residual MLP blocks of ColumnParallelLinear / RowParallelLinear.

It exercises TP, and its initialisation does not depend on the parallel layout (each
block is seeded by its *global* index), so any TP x PP x DP layout computes the same
function as one process.
"""
from __future__ import annotations

import re
from functools import partial

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule

from megatron_rrfp.train import models


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
    pre_process, post_process = models.stage_roles(pre_process, post_process, vp_stage)
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
    pre_process, post_process = models.roles_of(model)
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
