"""The one place that knows megatron-core's version differences (the schedule contract).

Everything else in megatron_rrfp calls megatron-core's per-microbatch functions and reads
its process groups through here; what has to be bent to run on a CPU-only host is in
``megatron_rrfp/cpu/``, where Megatron-LM's training loop is hooked in ``megatron_lm/layout.py``.

Supported: megatron-core 0.15 - 0.19 (0.16.1 is what CPU CI installs; PyPI has no newer
release for Python 3.11).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional

import torch
from packaging.version import Version

# --------------------------------------------------------------------------- versions


def _installed_version() -> Version:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return Version(version("megatron-core"))
    except PackageNotFoundError:  # e.g. a source checkout on PYTHONPATH
        from megatron.core import package_info

        return Version(package_info.__version__)


MEGATRON_CORE_VERSION: Version = _installed_version()


# --------------------------------------------------------------------------- schedule calls
#
# The executor runs each microbatch through megatron-core's own forward_step /
# backward_step, so loss scaling, per-token loss and MoE aux-loss scaling stay Megatron's.
# Their signatures move between releases (0.19's backward_step drops model_type); these
# wrappers pass only what the installed release accepts.



def _schedules():
    from megatron.core.pipeline_parallel import schedules

    return schedules


def _accepted(func, kwargs: dict) -> dict:
    params = inspect.signature(func).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def pipeline_device() -> torch.device:
    """Where this rank's activations live: its current CUDA device under an NCCL process group,
    CPU under gloo (a CPU run on a GPU host included: gloo cannot send CUDA tensors). Before
    any process group exists: CUDA where this process sees a device."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        on_cuda = "nccl" in str(dist.get_backend())  # "nccl", or "cpu:gloo,cuda:nccl"
    else:
        on_cuda = torch.cuda.is_available()
    return torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")


def get_model_config(model):
    from megatron.core.utils import get_model_config as _get

    return _get(model)


def model_type(model):
    from megatron.core.utils import get_model_type

    return get_model_type(model)


def forward_step(forward_step_func, data_iterator, model, num_microbatches, input_tensor, forward_data_store,
                 config, **kwargs):
    fn = _schedules().forward_step
    return fn(forward_step_func, data_iterator, model, num_microbatches, input_tensor, forward_data_store, config,
              **_accepted(fn, kwargs))


def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
    fn = _schedules().backward_step
    if "model_type" in inspect.signature(fn).parameters:  # <= 0.18
        return fn(input_tensor, output_tensor, output_tensor_grad, model_type, config)
    return fn(input_tensor, output_tensor, output_tensor_grad, config)


def combined_forward_backward_step(forward_step_func, data_iterator, f_model, num_microbatches, input_tensor,
                                   forward_data_store, b_model, b_input_tensor, b_output_tensor,
                                   b_output_tensor_grad, config, **kwargs):
    """megatron-core's combined-1F1B step (``--overlap-moe-expert-parallel-comm``): one microbatch's
    forward (``f_model``), another's backward (``b_model``), or both layer by layer on two streams.
    Returns (output, num_tokens, input gradient); the same signature in 0.15 - 0.19."""
    from megatron.core.pipeline_parallel.combined_1f1b import combined_forward_backward_step as fn

    return fn(forward_step_func, data_iterator, f_model, num_microbatches, input_tensor, forward_data_store,
              b_model, b_input_tensor, b_output_tensor, b_output_tensor_grad, config, **_accepted(fn, kwargs))


def set_combined_streams(config) -> None:
    """The computation and communication streams of megatron-core's combined step, set once per
    process as its own combined-1F1B schedules set them (0.19 adds ``high_priority``)."""
    from megatron.core.pipeline_parallel.utils import set_streams

    set_streams(**_accepted(set_streams, dict(high_priority=getattr(config, "high_priority_a2a_comm_stream", False))))


def combined_steps_blocker(config, models, forward_step_func) -> str:
    """Why megatron-core's combined-1F1B steps cannot run these models here ("" when they can): the
    forward step must build the schedule plan (``return_schedule_plan``, as Megatron-LM's
    ``pretrain_gpt.py``); ``delay_wgrad_compute`` calls ``backward_dw`` on every linear of a layer,
    which megatron-core's own non-TE linears lack before 0.19."""
    try:
        params = inspect.signature(forward_step_func).parameters
    except (TypeError, ValueError):
        params = {}
    if "return_schedule_plan" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return ("the forward step function takes no return_schedule_plan argument (megatron-core's combined step "
                "asks it for the model's schedule plan, as Megatron-LM's pretrain_gpt.py forward_step builds it)")
    if getattr(config, "delay_wgrad_compute", False):
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        for model in models:
            for name, module in model.named_modules():
                if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and \
                        not hasattr(module, "backward_dw"):
                    return (f"--delay-wgrad-compute calls backward_dw() on {name} ({type(module).__name__}), which "
                            f"megatron-core {MEGATRON_CORE_VERSION} defines only for Transformer Engine's linears; "
                            "use --transformer-impl transformer_engine or megatron-core >= 0.19, or drop "
                            "--delay-wgrad-compute")
    return ""


def first_val_step(first_val_step_flag, forward_only: bool, cond: bool) -> bool:
    return _schedules().check_first_val_step(first_val_step_flag, forward_only, cond)


def deallocate_output_tensor(out, deallocate_pipeline_outputs: bool) -> None:
    _schedules().deallocate_output_tensor(out, deallocate_pipeline_outputs)


def clear_embedding_activation_buffer(config, model, is_last_stage: bool):
    fn = getattr(_schedules(), "clear_embedding_activation_buffer", None)
    return fn(config, model, is_last_stage) if fn is not None else None


def finish_embedding_wgrad_compute(config, embedding_module, is_last_stage: bool, tp_group) -> None:
    fn = getattr(_schedules(), "finish_embedding_wgrad_compute", None)
    if fn is not None:
        params = list(inspect.signature(fn).parameters)
        fn(*(config, embedding_module, is_last_stage, tp_group)[: len(params)])


def finalize_model_grads(config, models, num_tokens, *, pg_collection, force_all_reduce) -> None:
    start_unissued_grad_syncs(models)
    fn = config.finalize_model_grads_func
    kwargs = _accepted(fn, dict(pg_collection=pg_collection, force_all_reduce=force_all_reduce))
    fn(models, num_tokens, **kwargs)


def mlp_submodules(mlp_spec):
    """The ``MLPSubmodules`` of a layer spec's ``mlp`` entry: a ``ModuleSpec`` up to 0.18, a
    ``functools.partial(MLP.as_mlp_submodule, submodules=...)`` in 0.19."""
    submodules = getattr(mlp_spec, "submodules", None)
    if submodules is None:
        submodules = getattr(mlp_spec, "keywords", {}).get("submodules")
    if submodules is None:
        raise TypeError(f"megatron_rrfp: cannot find the MLP submodules in the layer spec's mlp entry {mlp_spec!r} "
                        f"(megatron-core {MEGATRON_CORE_VERSION})")
    return submodules


def start_unissued_grad_syncs(models) -> None:
    """overlap_grad_reduce DDP on megatron-core 0.15: launch the reductions no hook launched.

    With the B/W split every B and W runs under no_sync (split/megatron_linear.py), so no parameter is
    ever counted ready. 0.16+'s finish_grad_sync then starts the reduction itself (a bucket
    group with no readiness counted stays in its ``is_first_batch`` mode); 0.15's has no such
    mode and asserts that a hook launched it. Starting it here is what 0.16+ does. Groups a
    hook did launch (sync enabled before the last backward, unsplit) have a handle: untouched.
    """
    for model in models:
        ddp_config = getattr(model, "ddp_config", None)
        if ddp_config is None or not getattr(ddp_config, "overlap_grad_reduce", False):
            continue
        groups = list(getattr(model, "bucket_groups", [])) + list(getattr(model, "expert_parallel_bucket_groups", []))
        for group in groups:
            if not hasattr(group, "is_first_batch") and getattr(group, "grad_reduce_handle", 0) is None:
                group.start_grad_sync()


def data_parallel_size(pg_collection=None) -> int:
    """Data-parallel ranks of this rank's model replica (1 when parallel_state is not set up)."""
    dp = getattr(pg_collection, "dp", None) if pg_collection is not None else None
    if dp is not None:
        return dp.size()
    from megatron.core import parallel_state

    try:
        return parallel_state.get_data_parallel_world_size()
    except (AssertionError, AttributeError, RuntimeError):
        return 1


def expert_parallel_size() -> int:
    from megatron.core import parallel_state

    try:
        return parallel_state.get_expert_model_parallel_world_size()
    except (AssertionError, AttributeError, RuntimeError):
        return 1


@dataclass
class ScheduleGroups:
    pp: Any
    tp: Any
    cp: Any
    agreement_ranks: list
    collection: Optional[Any]  # what to hand to finalize_model_grads (None: Megatron's globals)


def process_groups(*, pg_collection=None, p2p_communicator=None, whole_stage: bool = False) -> ScheduleGroups:
    """The groups the schedule needs, from an explicit ProcessGroupCollection (0.15+) or
    from megatron's parallel_state.

    Agreement spans every rank of this pipeline stage that shares a collective inside a
    forward or backward with this one: tensor x context parallel ranks (attention, TP
    linears, the router's aux-loss reductions) and expert-tensor x expert parallel ranks
    (MoE's token all-to-alls, which span data-parallel replicas). ``create_agreement_groups``
    joins overlapping groups into one. ``whole_stage`` (the router's global aux loss reduces
    over tensor x data x context parallel ranks): every rank of the stage.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    if pg_collection is not None:
        pp, tp, cp = pg_collection.pp, pg_collection.tp, pg_collection.cp
        tp_cp = getattr(pg_collection, "tp_cp", None)
        if tp_cp is None and cp.size() > 1:
            raise ValueError("megatron_rrfp: pg_collection with context parallelism must carry 'tp_cp' "
                             "(the tensor x context parallel group) for the TP agreement")
        sharing = [tp_cp if tp_cp is not None else tp, getattr(pg_collection, "tp_ep", None)]
        if whole_stage:
            sharing.append(getattr(pg_collection, "tp_dp_cp", None))
    else:
        pp = p2p_communicator.pp_group if p2p_communicator is not None else \
            parallel_state.get_pipeline_model_parallel_group()
        tp = parallel_state.get_tensor_model_parallel_group()
        cp = parallel_state.get_context_parallel_group()
        sharing = [parallel_state.get_tensor_and_context_parallel_group(), _expert_group(parallel_state)]
        if whole_stage:
            sharing.append(parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True))
    agreement = sorted({r for group in sharing if group is not None for r in dist.get_process_group_ranks(group)})
    return ScheduleGroups(pp=pp, tp=tp, cp=cp, agreement_ranks=agreement, collection=pg_collection)


def _expert_group(parallel_state):
    """Expert-tensor x expert parallel ranks (None where megatron did not create them)."""
    try:
        return parallel_state.get_expert_tensor_and_model_parallel_group(check_initialized=False)
    except (AssertionError, AttributeError, RuntimeError, TypeError):
        return None


def reduces_over_data_parallel(config) -> bool:
    """The router's global aux loss all-reduces over data-parallel replicas in every MoE forward."""
    kind = getattr(config, "moe_router_load_balancing_type", None) or ""
    kinds = kind if isinstance(kind, (list, tuple)) else [kind]
    return getattr(config, "num_moe_experts", None) is not None and any("global" in k for k in kinds)


def pipeline_parallel_size(schedule_pg_collection=None) -> int:
    if schedule_pg_collection is not None and getattr(schedule_pg_collection, "pp", None) is not None:
        return schedule_pg_collection.pp.size()
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_world_size()


def megatron_schedule_lookup():
    """Megatron's own ``get_forward_backward_func`` (the function object, as defined)."""
    return _schedules().get_forward_backward_func


def schedule_lookup_pipeline_size(pp_size: Optional[int], vp_size: Optional[int],
                                  schedule_pg_collection=None) -> int:
    """The pipeline size Megatron's ``get_forward_backward_func`` would act on.

    Megatron (0.16 - 0.19): if pp_size and vp_size are both None, parallel_state decides;
    otherwise pp_size is used as given. 0.19 also accepts ``schedule_pg_collection``; a
    plain ProcessGroupCollection carries the pipeline group, a multi-module one selects a
    schedule rrfp does not implement (raises rather than silently running 1F1B).
    """
    if _is_multi_module_collection(schedule_pg_collection):
        raise ValueError("megatron_rrfp: a multi-module (MultiModuleProcessGroupCollection) pipeline was passed to "
                         "get_forward_backward_func; rrfp does not run multi-module bridge schedules yet: use "
                         "--pipeline-schedule 1f1b for this model")
    if pp_size is not None:
        return pp_size
    return pipeline_parallel_size(schedule_pg_collection)


def _is_multi_module_collection(collection) -> bool:
    if collection is None:
        return False
    try:  # 0.19+
        from megatron.core.process_groups_config import MultiModuleProcessGroupCollection
    except ImportError:
        return False
    return isinstance(collection, MultiModuleProcessGroupCollection)


# --------------------------------------------------------------------------- HybridModel
#
# megatron.core.models.hybrid (HybridModel, HybridStack, --hybrid-layer-pattern with '|'
# between pipeline segments) first ships in 0.18.0. 0.15 - 0.17 have only MambaModel, whose
# hybrid_override_pattern cannot place segments on stages and refuses virtual pipelines:
# no stand-in for the same model, so --model hybrid is refused there.

HYBRID_MODEL_SINCE = Version("0.18.0")


def hybrid_model_unavailable() -> str:
    """Why HybridModel cannot be built with the installed megatron-core (empty if it can)."""
    if MEGATRON_CORE_VERSION.release >= HYBRID_MODEL_SINCE.release:
        return ""
    return (f"megatron-core's HybridModel needs megatron-core >= {HYBRID_MODEL_SINCE.major}."
            f"{HYBRID_MODEL_SINCE.minor} (installed: {MEGATRON_CORE_VERSION})")


# --pipeline-model-parallel-layout with more stages than ranks (interleaved, unequal chunks): rrfp's
# losses equal Megatron's on Megatron-LM core_v0.19.0 / megatron-core 0.19.2; on core_v0.16.1 / 0.16.1
# they differ from its interleaved schedule's (NaN with an embedding-only chunk), and 0.17 / 0.18
# were not run, so it is refused there (one stage per rank runs on both).
INTERLEAVED_LAYOUT_SINCE = Version("0.19.0")


def interleaved_layout_unverified() -> str:
    """Why rrfp refuses an interleaved --pipeline-model-parallel-layout here (empty if it runs)."""
    if MEGATRON_CORE_VERSION.release >= INTERLEAVED_LAYOUT_SINCE.release:
        return ""
    return (f"with more stages than ranks it is verified on megatron-core >= {INTERLEAVED_LAYOUT_SINCE.major}."
            f"{INTERLEAVED_LAYOUT_SINCE.minor} only (installed: {MEGATRON_CORE_VERSION}; on 0.16.1 rrfp's losses "
            "differ from Megatron's interleaved schedule's)")
