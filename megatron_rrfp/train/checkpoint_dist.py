"""``--ckpt-format torch_dist``: checkpoints through megatron-core's ``dist_checkpointing``,
the format Megatron-LM saves by default.

Layout (Megatron-LM's)::

    DIR/latest_checkpointed_iteration.txt    "6", written by rank 0 after the collective save
    DIR/iter_0000006/                        dist_checkpointing: metadata.json, common.pt
                                             (up to 0.18; 0.19 keeps it inside), .metadata
                                             and the __*.distcp shards

State: ``model`` (the stage's ``sharded_state_dict``: GPTModel keys as Megatron-LM's local
spec names them), ``optimizer`` (megatron-core's ``optimizer.sharded_state_dict``),
``opt_param_scheduler``, ``iteration``, ``consumed_samples``, ``checkpoint_version`` and
``args`` (the run's sizes under Megatron-LM's argument names) as common state, and each
rank's RNG states as a ``rng_state`` sharded object (loaded only into the same layout).
Every rank takes part in save and load (collective). megatron-core's writer needs psutil.
"""
from __future__ import annotations

import argparse
import os
import shutil
from typing import Optional

import torch.distributed as dist

from . import checkpoint

CHECKPOINT_VERSION = 3.0  # Megatron-LM's current value


def is_dist_checkpoint(directory: str, iteration: int) -> bool:
    return os.path.isfile(os.path.join(checkpoint.iteration_dir(directory, iteration), "metadata.json"))


def _stage(model):
    return getattr(model, "module", model)  # through megatron DDP; Float16Module forwards itself


def _rng_object(layout: dict, *, replica: int):
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    shape = (layout["pipeline_model_parallel_size"], layout["tensor_model_parallel_size"])
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank())
    return ShardedObject("rng_state", checkpoint._rng_state(), shape, offset, replica_id=replica)


def _sharded_state(model, optimizer, *, layout: dict, loading: bool) -> dict:
    from megatron.core import parallel_state as ps

    model_state = _stage(model).sharded_state_dict()
    return {"model": model_state, "optimizer": optimizer.sharded_state_dict(model_state, is_loading=loading),
            "rng_state": _rng_object(layout, replica=ps.get_data_parallel_rank())}


def megatron_lm_args(layout: dict, consumed_samples: int, iteration: int) -> argparse.Namespace:
    """The run's sizes under Megatron-LM's argument names (its load_checkpoint reads ``args``)."""
    return argparse.Namespace(
        num_layers=layout["num_layers"], hidden_size=layout["hidden_size"],
        num_attention_heads=layout["num_attention_heads"], seq_length=layout["seq_length"],
        max_position_embeddings=layout["seq_length"], padded_vocab_size=layout["vocab_size"],
        tensor_model_parallel_size=layout["tensor_model_parallel_size"],
        pipeline_model_parallel_size=layout["pipeline_model_parallel_size"], world_size=layout["world_size"],
        consumed_train_samples=consumed_samples, consumed_valid_samples=0, iteration=iteration,
        untie_embeddings_and_output_weights=True, transformer_impl="local", ckpt_format="torch_dist")


def save(directory: str, *, iteration: int, consumed_samples: int, model, optimizer, scheduler,
         layout: dict) -> str:
    """Collective: one dist_checkpointing save, then rank 0 moves the tracker."""
    from megatron.core import dist_checkpointing

    path = checkpoint.iteration_dir(directory, iteration)
    if dist.get_rank() == 0:
        if os.path.isdir(path):  # a save of this iteration that did not finish (no tracker points here)
            shutil.rmtree(path)
        os.makedirs(path)
    dist.barrier()
    state = _sharded_state(model, optimizer, layout=layout, loading=False)
    state.update(opt_param_scheduler=scheduler.state_dict(), iteration=iteration, consumed_samples=consumed_samples,
                 checkpoint_version=CHECKPOINT_VERSION, layout=layout,
                 args=megatron_lm_args(layout, consumed_samples, iteration))
    dist_checkpointing.save(state, path)
    dist.barrier()
    if dist.get_rank() == 0:  # only now is iteration a resume point
        tracker = os.path.join(directory, checkpoint.TRACKER)
        with open(tracker + ".tmp", "w") as handle:
            handle.write(f"{iteration}\n")
        os.replace(tracker + ".tmp", tracker)
    dist.barrier()
    return path


def load(directory: str, *, iteration: Optional[int], model, optimizer, scheduler,
         layout: dict) -> checkpoint.Resumed:
    """Collective: restore every rank's state of ``iteration`` (default: the tracker's)."""
    from megatron.core import dist_checkpointing

    if iteration is None:
        iteration = checkpoint.latest_iteration(directory)
        if iteration is None:
            raise ValueError(f"--load {directory!r}: no {checkpoint.TRACKER} there (nothing saved yet?)")
    path = checkpoint.iteration_dir(directory, iteration)
    common = dist_checkpointing.load_common_state_dict(path)
    checkpoint.check_same_pattern(directory, common.get("layout") or {}, layout)
    state = _sharded_state(model, optimizer, layout=layout, loading=True)
    same_layout = common.get("layout") == layout
    if not same_layout:  # model and optimizer reshard; per-rank RNG states do not
        state.pop("rng_state")
    loaded = dist_checkpointing.load(state, path)
    _stage(model).load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if same_layout:
        checkpoint._set_rng_state(loaded["rng_state"])
    return checkpoint.Resumed(iteration=int(loaded["iteration"]), consumed_samples=int(loaded["consumed_samples"]),
                              path=path)


__all__ = ["CHECKPOINT_VERSION", "is_dist_checkpoint", "load", "megatron_lm_args", "save"]
