"""The one place that knows megatron-core's version differences and CUDA assumptions.

Everything else in megatron_rrfp imports megatron-core through plain public names and
passes process groups and devices explicitly; whatever has to differ by megatron-core
release, or be bent to run on a CPU-only host, lives here in its own section.

Supported: megatron-core 0.15 - 0.19 (0.16.1 is what CPU CI installs; PyPI has no newer
release for Python 3.11).
"""
from __future__ import annotations

import contextlib
import importlib
import types

import torch
from packaging.version import Version

__all__ = ["MEGATRON_CORE_VERSION", "cpu_redirected_modules", "enable_cpu_reference_schedules"]


# --------------------------------------------------------------------------- versions


def _installed_version() -> Version:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return Version(version("megatron-core"))
    except PackageNotFoundError:  # e.g. a source checkout on PYTHONPATH
        from megatron.core import package_info

        return Version(package_info.__version__)


MEGATRON_CORE_VERSION: Version = _installed_version()


# --------------------------------------------------------------------------- CPU reference
#
# megatron-core's schedules are the reference our executor is checked against. They run
# over gloo on CPU except for a few hard-coded CUDA calls (as of 0.16.1):
#   schedules.py          total_num_tokens = torch.zeros([], ..., device="cuda")   (x3)
#   p2p_communication.py  torch.empty(..., device=torch.cuda.current_device())     (recv
#                         buffers, shape exchange) and torch.cuda.synchronize() after
#                         batch_isend_irecv
#   transformer/utils.py  get_default_causal_mask(): torch.ones(..., device="cuda"), used
#                         by local attention when attention_mask is None (middle stages)
#   utils.py              GlobalMemoryBuffer.get_tensor(): device=torch.cuda.current_device(),
#                         the baddbmm buffer of local DotProductAttention
#   tensor_parallel/mappings.py  torch.empty(..., device=torch.cuda.current_device()) for
#                         TP all-gather / reduce-scatter outputs (gather_output=True, SP)
#   tensor_parallel.random CudaRNGStatesTracker.fork(): swaps CUDA RNG states around
#                         dropout; GPTModel enters it in attention and transformer block
# Rather than patch functions (their bodies change every release), each affected module
# gets its own stand-in for its global name `torch`: identical except that "cuda" devices
# become "cpu" and torch.cuda.current_device/synchronize are CPU-safe. Nothing outside
# those modules sees a difference, and the patch survives edits to the function bodies.

# Modules whose module-level `torch` is replaced; missing ones (other releases) are skipped.
_CPU_REDIRECTED_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.transformer.utils",  # get_default_causal_mask: attention_mask=None
    "megatron.core.utils",  # GlobalMemoryBuffer.get_tensor: local attention's matmul buffer
    "megatron.core.tensor_parallel.mappings",  # TP gather / reduce-scatter output buffers
    "megatron.core.distributed.param_and_grad_buffer",  # DDP's grad buffers on current_device()
    "megatron.core.timers",  # Timer.start/stop synchronize CUDA; min/max gather on current_device()
    "megatron.core.optimizer.optimizer",  # FP32Optimizer._scale = torch.tensor([1.0], device='cuda')
    "megatron.core.optimizer.clip_grads",  # get_grad_norm_fp32: torch.zeros(1, device='cuda') buffers
)
# torch functions that take `device=`; only these are wrapped, so classes such as
# torch.Tensor stay real classes (isinstance checks keep working).
_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn",
              "randint", "empty_like", "zeros_like", "ones_like", "full_like", "as_tensor")

_enabled = False
_redirected: list[str] = []


def enable_cpu_reference_schedules() -> bool:
    """Let megatron-core's own pipeline schedules and GPTModel run over gloo on CPU.

    Covers ``forward_backward_no_pipelining``,
    ``forward_backward_pipelining_without_interleaving`` and
    ``forward_backward_pipelining_with_interleaving``. Process-local and idempotent;
    does nothing (returns False) when CUDA is available. Returns True once active.

    Interleaved schedule at PP=2: use ``config.batch_p2p_comm=False`` (or
    ``overlap_p2p_comm=True``); with batched p2p it silently computes wrong gradients.
    """
    global _enabled
    if torch.cuda.is_available():
        return False
    if _enabled:
        return True
    for name in _CPU_REDIRECTED_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if isinstance(getattr(module, "torch", None), types.ModuleType):
            module.torch = _CpuTorch()
            _redirected.append(name)
    _disable_cuda_rng_fork()
    _enabled = True
    return True


def cpu_redirected_modules() -> tuple[str, ...]:
    """Modules whose `torch` was redirected (for debugging and tests)."""
    return tuple(_redirected)


def _to_cpu_device(device):
    """'cuda', 'cuda:1', torch.device('cuda') and bare CUDA ordinals become 'cpu'."""
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
        return "cpu"
    return device


def _cpu_factory(factory):
    def call(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    call.__name__ = factory.__name__
    call.__doc__ = f"torch.{factory.__name__} with CUDA devices mapped to CPU."
    return call


class _CpuCuda(types.ModuleType):
    """Stand-in for torch.cuda: the calls megatron makes unconditionally are CPU-safe."""

    def __init__(self):
        super().__init__("torch.cuda")

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return "cpu"  # only ever used as a device= argument by the redirected modules

    @staticmethod
    def synchronize(device=None):
        return None  # CPU ops and gloo waits are already synchronous


class _CpuTorch(types.ModuleType):
    """Stand-in for the module `torch` inside one megatron module (see section comment)."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            if hasattr(torch, name):
                setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):  # only reached for names not set in __init__
        return getattr(torch, name)


def _disable_cuda_rng_fork() -> None:
    """Make the CUDA RNG tracker's fork() a no-op context.

    It saves/restores CUDA RNG states (and raises unless model_parallel_cuda_manual_seed,
    which needs CUDA, added them). On CPU, dropout inside it simply draws from the CPU
    generator; our reference configs use dropout 0, so results do not depend on it.
    Patched on the class, so trackers created later (force_reset) are covered too.
    """
    from megatron.core.tensor_parallel import random as tp_random

    def fork(self, name=None):
        return contextlib.nullcontext()

    tp_random.CudaRNGStatesTracker.fork = fork


# --------------------------------------------------------------------------- CPU optimizer
#
# megatron-core 0.16.1's optimizer runs on CPU once its modules are in the redirect list
# above, except clip_grad_by_total_norm_fp32, which asserts 'torch.cuda.FloatTensor': on
# CPU the optimizer module gets the same arithmetic without the device assertion.


def enable_cpu_optimizer() -> None:
    """megatron-core's get_megatron_optimizer (and grad clipping) on a CPU-only host."""
    if not enable_cpu_reference_schedules():
        return  # CUDA is available: nothing to bend
    importlib.import_module("megatron.core.optimizer.optimizer").clip_grad_by_total_norm_fp32 = \
        _clip_grad_by_total_norm


@torch.no_grad()
def _clip_grad_by_total_norm(parameters, max_norm: float, total_norm: float, use_decoupled_grad: bool = False):
    """grad *= max_norm / (total_norm + 1e-6) when that is < 1 (megatron-core's rule)."""
    coefficient = max_norm / (total_norm + 1.0e-6)
    if coefficient < 1.0:
        for param in parameters:
            grad = getattr(param, "decoupled_grad" if use_decoupled_grad else "grad", None)
            if grad is not None:
                grad.mul_(coefficient)


# --------------------------------------------------------------------------- schedule calls
#
# The executor runs each microbatch through megatron-core's own forward_step /
# backward_step, so loss scaling, per-token loss and MoE aux-loss scaling stay Megatron's.
# Their signatures move between releases (0.19's backward_step drops model_type); these
# wrappers pass only what the installed release accepts.

import inspect  # noqa: E402
from dataclasses import dataclass as _dataclass  # noqa: E402
from typing import Any, Optional  # noqa: E402


def _schedules():
    from megatron.core.pipeline_parallel import schedules

    return schedules


def _accepted(func, kwargs: dict) -> dict:
    params = inspect.signature(func).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def pipeline_device() -> torch.device:
    """Where activations live: the current CUDA device, else CPU (gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


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
    fn = config.finalize_model_grads_func
    kwargs = _accepted(fn, dict(pg_collection=pg_collection, force_all_reduce=force_all_reduce))
    fn(models, num_tokens, **kwargs)


def expert_parallel_size() -> int:
    from megatron.core import parallel_state

    try:
        return parallel_state.get_expert_model_parallel_world_size()
    except (AssertionError, AttributeError, RuntimeError):
        return 1


@_dataclass
class ScheduleGroups:
    pp: Any
    tp: Any
    cp: Any
    agreement_ranks: list
    collection: Optional[Any]  # what to hand to finalize_model_grads (None: Megatron's globals)


def process_groups(*, pg_collection=None, p2p_communicator=None) -> ScheduleGroups:
    """The groups the schedule needs, from an explicit ProcessGroupCollection (0.15+) or
    from megatron's parallel_state. Agreement spans tensor x context parallel ranks: both
    run collectives inside every forward and backward."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if pg_collection is not None:
        pp, tp, cp = pg_collection.pp, pg_collection.tp, pg_collection.cp
        tp_cp = getattr(pg_collection, "tp_cp", None)
        if tp_cp is None and cp.size() > 1:
            raise ValueError("megatron_rrfp: pg_collection with context parallelism must carry 'tp_cp' "
                             "(the tensor x context parallel group) for the TP agreement")
        agreement = dist.get_process_group_ranks(tp_cp if tp_cp is not None else tp)
    else:
        pp = p2p_communicator.pp_group if p2p_communicator is not None else \
            parallel_state.get_pipeline_model_parallel_group()
        tp = parallel_state.get_tensor_model_parallel_group()
        cp = parallel_state.get_context_parallel_group()
        agreement = dist.get_process_group_ranks(parallel_state.get_tensor_and_context_parallel_group())
    return ScheduleGroups(pp=pp, tp=tp, cp=cp, agreement_ranks=sorted(agreement), collection=pg_collection)


def pipeline_parallel_size(schedule_pg_collection=None) -> int:
    if schedule_pg_collection is not None and getattr(schedule_pg_collection, "pp", None) is not None:
        return schedule_pg_collection.pp.size()
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_world_size()


# --------------------------------------------------------------------------- Megatron-LM hooks
#
# megatron_rrfp.integration attaches to Megatron-LM (megatron.training) without editing it.
# Where each hook attaches, by release (checked against the core_v0.16.1 and core_v0.19.0
# tags of Megatron-LM):
#   add_megatron_arguments     megatron.training.arguments, 0.15 - 0.19. parse_args() looks
#                              it up as a module global at call time, so a wrapper there is
#                              seen and the entry script's extra_args_provider stays free.
#   get_forward_backward_func  defined in megatron.core.pipeline_parallel.schedules and
#                              re-exported by megatron.core.pipeline_parallel. Bound *by name*
#                              at import time in megatron.training.training (also
#                              megatron.rl.rl_utils, megatron.post_training.generate), so the
#                              integration rebinds every loaded module that holds Megatron's
#                              function (rebind_loaded). 0.19 adds the keyword
#                              schedule_pg_collection=; a MultiModuleProcessGroupCollection
#                              there selects Megatron's multi-module bridge schedule.
#   initialize_megatron        megatron.training.initialize, bound by name in
#                              megatron.training and megatron.training.training (0.15 - 0.19);
#                              asserts CUDA unless allow_no_cuda=True.
#   fused kernels              megatron.legacy.fused_kernels.load, built by
#                              initialize._compile_dependencies (<= 0.16; 0.19 has no
#                              megatron.legacy and builds none).

import functools  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

_ARGUMENTS_MODULE = "megatron.training.arguments"
_SCHEDULE_LOOKUP_MODULES = ("megatron.core.pipeline_parallel", "megatron.core.pipeline_parallel.schedules")
_INITIALIZE_MODULE = "megatron.training.initialize"
_FUSED_KERNELS_MODULE = "megatron.legacy.fused_kernels"  # <= 0.16 only


def _optional_training_module(name: str) -> Optional[types.ModuleType]:
    """Import a megatron.training module; None where the training package is absent. A
    training package that is there but fails to import (a missing dependency) raises."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name in ("megatron", "megatron.training", name):
            return None
        raise


def megatron_arguments_module() -> Optional[types.ModuleType]:
    """megatron.training.arguments, or None on a megatron-core-only install (e.g. the
    0.16.1 wheel) where Megatron-LM's training package is absent. A training package
    that is there but fails to import (a missing dependency) raises as usual."""
    return _optional_training_module(_ARGUMENTS_MODULE)


def schedule_lookup_modules() -> list[types.ModuleType]:
    """Modules whose ``get_forward_backward_func`` is Megatron's schedule lookup."""
    return [importlib.import_module(name) for name in _SCHEDULE_LOOKUP_MODULES]


def megatron_schedule_lookup():
    """Megatron's own ``get_forward_backward_func`` (the function object, as defined)."""
    return _schedules().get_forward_backward_func


def rebind_loaded(name: str, old, new, *, exclude: tuple = ()) -> list[types.ModuleType]:
    """Set ``module.<name> = new`` in every loaded module whose ``<name>`` is ``old``.

    Needed because Megatron-LM binds some functions by name at import time (``from ...
    import get_forward_backward_func``); replacing only the defining module would miss
    those copies. Identity comparison, so nothing else is touched; ``exclude`` names
    modules to leave alone (the one defining ``old`` itself). Returns the modules.
    """
    rebound = []
    for module_name, module in list(sys.modules.items()):
        if module_name in exclude:
            continue
        # The module's own namespace only: getattr could run a lazy module __getattr__.
        if isinstance(module, types.ModuleType) and vars(module).get(name) is old:
            setattr(module, name, new)
            rebound.append(module)
    return rebound


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


# --------------------------------------------------------------------------- CPU training (launcher --cpu)
#
# Megatron-LM's training loop (megatron.training) assumes a CUDA device everywhere: it sets
# the device, seeds CUDA RNG, times with CUDA events, builds tensors with device="cuda" or
# .cuda(), and only initialises model parallelism when torch.cuda.device_count() > 0.
# `python -m megatron_rrfp.launch --cpu` makes an unmodified entry script train on CPU over
# gloo by redirecting those calls *process-wide*: unlike the per-module reference
# redirects above, every megatron.training module and lazily imported helper would need
# them, and the launcher's process runs nothing else. One-way on purpose: there is no
# disable (the process has no CUDA to go back to).
#   torch.cuda.device_count() -> 1        Megatron-LM then initialises model parallelism
#   current_device / set_device           "cpu" / no-op (device= arguments become CPU)
#   synchronize, streams, events          no-ops; Event times with perf_counter
#   CUDA RNG (manual_seed, get/set_rng_state)  the CPU generator (fork() is a no-op above,
#                                         so dropout draws from it)
#   memory statistics, empty_cache        0 / no-op
#   torch.<factory>(device="cuda"), Tensor.cuda(), Module.cuda()   stay on CPU
#   initialize_megatron                   called with allow_no_cuda=True
#   fused kernels (<= 0.16)               not built (torch fallbacks are used; pass the
#                                         --no-*-fusion flags)

_cpu_training = False


def enable_cpu_training() -> bool:
    """Make Megatron-LM's CUDA assumptions run on CPU (see the section comment).

    Process-wide and idempotent; returns False (and changes nothing) when CUDA is
    available. Call before the entry script runs; megatron.training hooks apply only if
    megatron.training is importable.
    """
    global _cpu_training
    if torch.cuda.is_available():
        return False
    if _cpu_training:
        return True
    enable_cpu_reference_schedules()
    _redirect_torch_cuda()
    _redirect_factories()
    if megatron_arguments_module() is not None:
        _initialize_without_cuda()
        _skip_fused_kernels()
    _cpu_training = True
    return True


class _CpuStream:
    """A CUDA stream stand-in: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self):
        return None

    def wait_stream(self, stream):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        event = event or _CpuEvent()
        event.record()
        return event

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _CpuEvent:
    """A CUDA event stand-in; elapsed_time in milliseconds, like CUDA's."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self._t = None

    def record(self, stream=None):
        self._t = time.perf_counter()

    def elapsed_time(self, end: "_CpuEvent") -> float:
        return (end._t - self._t) * 1000.0

    def synchronize(self):
        return None

    def wait(self, stream=None):
        return None

    def query(self) -> bool:
        return True


def _cpu_seed(seed) -> None:
    torch.default_generator.manual_seed(int(seed))  # not torch.manual_seed: it calls back into cuda


def _redirect_torch_cuda() -> None:
    cuda = torch.cuda
    stream = _CpuStream()
    redirects = {
        "device_count": lambda: 1,
        "current_device": lambda: "cpu",
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "Stream": _CpuStream,
        "Event": _CpuEvent,
        "current_stream": lambda device=None: stream,
        "default_stream": lambda device=None: stream,
        "stream": lambda s=None: contextlib.nullcontext(),
        "set_stream": lambda s: None,
        "empty_cache": lambda: None,
        "manual_seed": _cpu_seed,
        "manual_seed_all": _cpu_seed,
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "set_rng_state": lambda state, device="cuda": torch.set_rng_state(state),
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "memory_reserved": lambda device=None: 0,
        "max_memory_reserved": lambda device=None: 0,
        "memory_stats": lambda device=None: {},
        "reset_peak_memory_stats": lambda device=None: None,
    }
    for name, fn in redirects.items():
        setattr(cuda, name, fn)
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self


def _redirect_factories() -> None:
    """torch.zeros(..., device="cuda") and friends build CPU tensors instead."""
    for name in _FACTORIES:
        if hasattr(torch, name):
            setattr(torch, name, _cpu_factory(getattr(torch, name)))


def _initialize_without_cuda() -> None:
    initialize = importlib.import_module(_INITIALIZE_MODULE)
    original = initialize.initialize_megatron
    if getattr(original, "_rrfp_cpu", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize_megatron(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["allow_no_cuda"] = True
        return original(*bound.args, **bound.kwargs)

    initialize_megatron._rrfp_cpu = True
    importlib.import_module("megatron.training.training")  # load the modules that bind it by name
    rebind_loaded("initialize_megatron", original, initialize_megatron)


def _skip_fused_kernels() -> None:
    try:
        fused_kernels = importlib.import_module(_FUSED_KERNELS_MODULE)
    except ImportError:  # 0.19+: nothing is built
        return
    fused_kernels.load = lambda args: None


# --------------------------------------------------------------------------- Megatron-LM training-loop hooks
#
# megatron_rrfp.megatron_lm_hooks records goodput (--rrfp-goodput-ledger) and writes RRFP
# traces (--rrfp-trace-dir) around Megatron-LM's own training loop, without editing it, by
# wrapping names of megatron.training.training. Checked against the core_v0.16.1 and
# core_v0.19.0 tags of Megatron-LM:
#   pretrain                   the entry point. Entry scripts bind it by name (pretrain_gpt.py:
#                              `from megatron.training import pretrain`; megatron/training/
#                              __init__.py re-exports it), so it is rebound in every loaded module
#                              that holds it (rebind_loaded), before the entry script runs.
#                              0.16.1 - 0.19: it can end in sys.exit(exit_code) (train() on
#                              --exit-interval / --exit-duration-in-mins / a signal; 0 = clean).
#   setup_model_and_optimizer  called by pretrain through training.py's module globals, after
#                              initialize_megatron (args parsed, process groups up): the first
#                              point where a per-rank recorder can be built.
#   load_checkpoint            imported by name into training.py; setup_model_and_optimizer calls
#                              that module global when --load/--pretrained-checkpoint is given and
#                              gets (iteration, num_floating_point_operations_so_far). (RL's
#                              reference-weight loads in train() go through it too.)
#   save_checkpoint_and_time   defined in training.py; train() and checkpoint_and_decide_exit
#                              call it through module globals for interval/exit saves (first
#                              argument: the iteration). 0.19: pretrain's final save after
#                              train() also goes through it.
#   save_checkpoint            imported by name into training.py. 0.16.1: pretrain's final save
#                              (when --train-iters is not a multiple of --save-interval) calls it
#                              directly, not through save_checkpoint_and_time; both are wrapped and
#                              the inner one records only when it is not inside the outer one.
#   train_step                 defined in training.py; train() calls the module global right after
#                              `args.curr_iteration = iteration`, so the step's 1-based number is
#                              curr_iteration + 1 (0.16.1 - 0.19; 0.19 adds pg_collection= and
#                              p2p_communicator= keywords, passed through untouched).
#   _TRAIN_START_TIME          training.py's import-time wall clock, replaced by
#                              set_startup_timestamps(program_start=...) (0.16+); read at call time.
#   get_args, get_timers       megatron.training.global_vars (0.15 - 0.19).

_TRAINING_MODULE = "megatron.training.training"
_GLOBAL_VARS_MODULE = "megatron.training.global_vars"


@_dataclass(frozen=True)
class TrainingLoopNames:
    """Where each hook attaches in megatron.training.training (see the section comment)."""

    entry: str = "pretrain"
    setup: str = "setup_model_and_optimizer"
    load: str = "load_checkpoint"
    saves: tuple = ("save_checkpoint_and_time", "save_checkpoint")  # outer first
    step: str = "train_step"
    start_time: str = "_TRAIN_START_TIME"


TRAINING_LOOP_NAMES = TrainingLoopNames()  # the same in 0.16.1 and 0.19.0


def megatron_training_module() -> Optional[types.ModuleType]:
    """megatron.training.training, or None without Megatron-LM's training package."""
    return _optional_training_module(_TRAINING_MODULE)


def megatron_lm_globals() -> tuple:
    """(get_args, get_timers) of megatron.training.global_vars."""
    global_vars = importlib.import_module(_GLOBAL_VARS_MODULE)
    return global_vars.get_args, global_vars.get_timers


def train_start_time(training: types.ModuleType) -> Optional[float]:
    """Megatron-LM's process start (wall clock, seconds), when the module records one."""
    value = vars(training).get(TRAINING_LOOP_NAMES.start_time)
    return float(value) if isinstance(value, (int, float)) else None


def train_step_iteration(args) -> int:
    """The 1-based number of the iteration train_step is about to run."""
    return int(args.curr_iteration) + 1


def loaded_iteration(result) -> int:
    """Iteration a load_checkpoint call resumed from: (iteration, flops) in 0.15 - 0.19."""
    if isinstance(result, tuple) and result and isinstance(result[0], int):
        return result[0]
    return 0


def saved_iteration(args: tuple, kwargs: dict) -> Optional[int]:
    """The iteration argument of save_checkpoint(_and_time): first positional or iteration=."""
    value = args[0] if args else kwargs.get("iteration")
    return value if isinstance(value, int) else None


def tokens_per_iteration(args) -> int:
    """Tokens one training iteration processes, whole job: global batch x sequence length.

    The global batch is the current one (it grows under --rampup-batch-size), from the
    microbatch calculator when it is set up, else --global-batch-size.
    """
    batch = None
    try:
        from megatron.core.num_microbatches_calculator import get_current_global_batch_size

        batch = get_current_global_batch_size()
    except (ImportError, AttributeError, AssertionError, TypeError):  # calculator not set up
        pass
    if not isinstance(batch, int):
        batch = getattr(args, "global_batch_size", None) or 0
    return int(batch) * int(getattr(args, "seq_length", None) or 0)


def trace_points(args) -> tuple[Optional[int], Optional[int]]:
    """(--log-interval, --train-iters): traces are written at multiples of the first and at the
    second (update_train_iters has turned --train-samples into iterations by then)."""
    return getattr(args, "log_interval", None), getattr(args, "train_iters", None)


def parallel_sizes(args) -> dict:
    """pp/tp/cp/dp sizes of a Megatron-LM run, for the ledger's job_start record."""
    names = {"pp": "pipeline_model_parallel_size", "tp": "tensor_model_parallel_size",
             "cp": "context_parallel_size", "dp": "data_parallel_size"}
    return {key: getattr(args, name) for key, name in names.items() if isinstance(getattr(args, name, None), int)}
