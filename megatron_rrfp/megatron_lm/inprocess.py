"""Megatron-LM's in-process restart (``--inprocess-restart``, nvidia-resiliency-ext) through the launcher.

Megatron-LM wraps ``pretrain`` in NVRx's ``inprocess.Wrapper`` (``megatron/training/inprocess_restart.py``):
on a fault the wrapper aborts the process groups, runs its finalize / health checks and calls
``pretrain`` again in the same process, with a fresh ``store`` prefix per restart. What the launcher
repairs or checks so that this works for its users (``install._apply`` calls ``prepare`` right after
Megatron parsed the flags, which ``maybe_wrap_for_inprocess_restart`` does before it wraps):

* **The wrapper reaches ``pretrain``.** NVRx passes its ``CallWrapper`` to the parameter whose
  annotation names ``CallWrapper`` (``inprocess/param_utils.py``). Since core_v0.18.0
  ``pretrain(..., inprocess_call_wrapper: Optional[Any] = None)`` (``megatron/training/training.py``)
  matches nothing: the wrapper never arrives, ``pretrain`` does not put the restart's prefix on the
  store, and the second ``init_process_group`` meets the first one's keys (gloo:
  "connectFullMesh ... Connection refused"; the other ranks hang). The launcher's ``pretrain``
  wrapper declares the parameter as ``Optional[CallWrapper]`` (``__signature__``), so NVRx injects it
  and Megatron's own code applies the prefix. Releases that annotate it correctly (0.16.x) are
  unchanged.
* **No GPU health checks on a CPU run.** NVRx 0.6+ adds GPU, NVLink and NIC checks (NVML) to the
  restart health check whenever ``LOCAL_RANK`` is set; on a CPU run (``launch --cpu``) every rank
  would end in ``HealthCheckError``. There they are left out (the user's and Megatron's checks stay).
* **Finalize without CUDA.** NVRx's ``ThreadedFinalize`` (Megatron's ``destroy_state`` after a
  fault) first requires a CUDA device; on a CPU run it runs the function in its thread alone.
* **The parsed flags survive the restart** (``ArgsOnReentry``, used by the launcher's ``pretrain``
  wrapper): since core_v0.18.0 they are parsed before ``pretrain``, and Megatron's finalize step
  forgets them, so the second call failed with "args is not initialized".
* **Blocking gloo collectives wait in slices** (CPU run): NVRx's abort ends NCCL operations only,
  and its asynchronous exception cannot reach a thread inside gloo's wait, so a healthy rank in
  Megatron's DP gradient all-reduce or TP broadcast waited for a failed peer until NVRx's hard
  timeout. ``torch.distributed``'s blocking collectives (and ``_coalescing_manager``) on a gloo group
  are issued asynchronously and waited for in slices of ``WAIT_SLICE_S``; a group whose operation
  an exception interrupted is kept for the life of the process (freeing it would join gloo's worker
  thread, still blocked until the peer's side of the group is gone). Megatron's point-to-point
  requests (its own 1F1B's receives) cannot be waited in slices (gloo ends a receive whose
  ``wait(timeout)`` expires), so they are waited for on a helper thread while the caller waits
  for that thread in slices; an interrupted request stays with its thread.
* **``--inprocess-granularity node``** builds one rank-assignment layer per host of exactly
  ``torch.cuda.device_count()`` ranks; a host running another number of ranks (any CPU run: the
  CPU redirection reports one device) cannot be assigned. Refused in one line before any rank
  starts work, naming ``--inprocess-granularity rank``.

``nvrx_conflict()`` (called by the launcher before anything imports ``megatron``) names an installed
nvidia-resiliency-ext that the megatron-core about to be imported rejects at import time: since
core_v0.18.0 ``megatron/core/dist_checkpointing/strategies/nvrx.py`` reads
``nvidia_resiliency_ext.__version__`` (NVRx 0.4.x has none: ``AttributeError`` on every rank) and
asserts ``NVRX_MIN_VERSION``.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

_PARAMETER = "inprocess_call_wrapper"
_NVRX_CHECKER = ("core", "dist_checkpointing", "strategies", "nvrx.py")


def prepare(args: Any, entry: Optional[Callable], *, cpu: bool) -> list[str]:
    """After Megatron-LM parsed ``args``: with ``--inprocess-restart``, check the flags, make NVRx's
    call wrapper reach ``entry`` (the launcher's ``pretrain`` wrapper) and, on CPU, leave NVRx's GPU
    health checks out. Returns what was changed (names for a log line); raises ValueError (one line,
    naming the flag) for a setting that cannot work."""
    if not getattr(args, "inprocess_restart", False):
        return []
    check_granularity(args)
    done = []
    if entry is not None and inject_call_wrapper(entry):
        done.append(f"pretrain's {_PARAMETER} annotated Optional[CallWrapper]")
    if cpu and leave_out_gpu_health_checks():
        done.append("NVRx's GPU/NVLink/NIC health checks left out (CPU run)")
    if cpu and finalize_without_cuda():
        done.append("NVRx's ThreadedFinalize runs without a CUDA device (CPU run)")
    if cpu and wait_in_slices_on_gloo():
        done.append(f"blocking gloo collectives wait in slices of {WAIT_SLICE_S:g} s, Megatron's p2p requests on "
                    "a helper thread (CPU run)")
    return done


def check_granularity(args: Any) -> None:
    if getattr(args, "inprocess_granularity", "node") != "node":
        return
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is None:
        return
    import torch

    devices = torch.cuda.device_count()
    if int(local) != devices:
        raise ValueError(f"--inprocess-granularity node expects one rank per CUDA device on each host "
                         f"({devices} device(s) here, {local} ranks on this host: LOCAL_WORLD_SIZE); "
                         "use --inprocess-granularity rank")


def call_wrapper_class() -> Optional[type]:
    """NVRx's ``inprocess.CallWrapper`` (None when nvidia-resiliency-ext is not installed)."""
    try:
        from nvidia_resiliency_ext.inprocess import CallWrapper
    except ImportError:
        return None
    return CallWrapper


def inject_call_wrapper(entry: Callable) -> bool:
    """Give ``entry`` (a wrapper of Megatron's ``pretrain``) a signature whose ``inprocess_call_wrapper``
    is annotated ``Optional[CallWrapper]``, where Megatron's own annotation names no CallWrapper.
    True if it changed anything."""
    wrapper_class = call_wrapper_class()
    if wrapper_class is None:
        return False
    signature = inspect.signature(entry)  # follows __wrapped__ to Megatron's pretrain
    parameter = signature.parameters.get(_PARAMETER)
    if parameter is None or _names(parameter.annotation, wrapper_class):
        return False
    parameters = [p.replace(annotation=Optional[wrapper_class]) if p.name == _PARAMETER else p
                  for p in signature.parameters.values()]
    entry.__signature__ = signature.replace(parameters=parameters)
    return True


def _names(annotation: Any, cls: type) -> bool:
    return annotation is cls or cls in getattr(annotation, "__args__", ())


def leave_out_gpu_health_checks() -> bool:
    """NVRx 0.6+: build ``Wrapper.restart_health_check`` without the GPU / NVLink / NIC checks it
    adds for ``LOCAL_RANK`` (NVML, on every restart), in every Wrapper made later in this process.
    True if this call left them out (False: NVRx has none, or they are out already)."""
    try:
        from nvidia_resiliency_ext.inprocess import wrap
    except ImportError:
        return False
    construct = getattr(wrap.Wrapper, "_construct_restart_health_check", None)
    if construct is None or getattr(construct, "_rrfp_cpu", False):
        return False

    def construct_without_gpu_checks(self):  # NVRx's own method less the LOCAL_RANK checks, whose
        checks = []  # constructors already call NVML: none is made
        if self.health_check is not None:
            instances = getattr(self.health_check, "instances", None)
            checks = list(instances) if instances is not None else [self.health_check]
        self.restart_health_check = wrap.Compose(*checks) if checks else None

    construct_without_gpu_checks._rrfp_cpu = True
    wrap.Wrapper._construct_restart_health_check = construct_without_gpu_checks
    return True


def finalize_without_cuda() -> bool:
    """NVRx's ``ThreadedFinalize`` (Megatron's ``destroy_state`` after a fault) raises "CUDA is not
    available" before running anything; on a CPU run it runs ``fn`` in a thread under the same
    timeout, without choosing a CUDA device. True if this call changed it."""
    try:
        from nvidia_resiliency_ext.inprocess import exception, finalize
    except ImportError:
        return False
    threaded = getattr(finalize, "ThreadedFinalize", None)
    if threaded is None or getattr(threaded.__call__, "_rrfp_cpu", False):
        return False

    def call_without_cuda(self, state):
        thread = threading.Thread(target=self.fn, args=self.args, kwargs=self.kwargs,
                                  name=f"{type(self).__name__}-{state.rank}", daemon=True)
        thread.start()
        thread.join(self.timeout.total_seconds())
        if thread.is_alive():
            raise exception.TimeoutError
        return state

    call_without_cuda._rrfp_cpu = True
    threaded.__call__ = call_without_cuda
    return True


WAIT_SLICE_S = 0.5
"""How long a sliced gloo wait blocks at a time: NVRx's asynchronous exception arrives between slices."""
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                "reduce", "barrier", "all_to_all_single", "gather", "scatter")
_KEPT: list = []  # (group, work) pairs an exception interrupted: never freed in this process


def wait_in_slices_on_gloo() -> bool:
    """Make ``torch.distributed``'s blocking collectives on gloo groups (and ``_coalescing_manager``
    without ``async_ops``) wait in slices, here and where megatron modules imported them by name.
    True if this call changed them."""
    import sys

    from torch.distributed import distributed_c10d as c10d

    if getattr(c10d.all_reduce, "_rrfp_sliced", False):
        return False
    import torch.distributed as dist

    replaced = {}  # id(original) -> its sliced version
    for name in (*_COLLECTIVES, "_coalescing_manager"):
        original = getattr(c10d, name, None)
        if original is None:
            continue
        sliced = (_sliced_coalescing if name == "_coalescing_manager" else _sliced)(original)
        replaced[id(original)] = sliced
        setattr(c10d, name, sliced)
        if getattr(dist, name, None) is original:
            setattr(dist, name, sliced)
    for module_name, module in list(sys.modules.items()):
        if module_name.split(".")[0] == "megatron" and module is not None:
            for attribute, value in list(vars(module).items()):
                if id(value) in replaced:
                    setattr(module, attribute, replaced[id(value)])
    _wait_for_megatron_p2p_on_a_thread()
    return True


_P2P_MODULE = "megatron.core.pipeline_parallel.p2p_communication"


def _wait_for_megatron_p2p_on_a_thread() -> None:
    """megatron-core's p2p module on a CPU run sees ``torch.distributed`` through the CPU
    redirection's stand-in (cpu/megatron_core.py): its isend / irecv / batch_isend_irecv return
    ``_ThreadWaitedRequest``s there, and nowhere else (rrfp's own transport is untouched)."""
    import sys

    import torch

    distributed = getattr(getattr(sys.modules.get(_P2P_MODULE), "torch", None), "distributed", None)
    if distributed is None or distributed is torch.distributed:
        return  # not redirected: nothing of Megatron's p2p runs on gloo in this process
    for name in ("isend", "irecv", "batch_isend_irecv"):
        issue = getattr(distributed, name)
        if not getattr(issue, "_rrfp_thread_waited", False):
            setattr(distributed, name, _thread_waited(issue))


def _thread_waited(issue: Callable) -> Callable:
    import functools

    @functools.wraps(issue)
    def call(*args, **kwargs):
        issued = issue(*args, **kwargs)
        if isinstance(issued, list):  # batch_isend_irecv
            return [_ThreadWaitedRequest(work) for work in issued]
        return None if issued is None else _ThreadWaitedRequest(issued)

    call._rrfp_thread_waited = True
    return call


class _ThreadWaitedRequest:
    """A gloo point-to-point request whose ``wait`` runs on a helper thread while the caller waits
    for that thread in slices of ``WAIT_SLICE_S``, so an asynchronous exception (NVRx's restart)
    reaches the caller. An interrupted request is kept, with its thread, for the life of the process."""

    def __init__(self, work: Any) -> None:
        self._work, self._done = work, False

    def wait(self, *args, **kwargs) -> bool:
        if self._done:
            return True
        finished, failure = threading.Event(), []

        def wait_for_it() -> None:
            try:
                self._work.wait(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                failure.append(exc)
            finally:
                finished.set()

        threading.Thread(target=wait_for_it, name="rrfp-gloo-p2p-wait", daemon=True).start()
        try:
            while not finished.wait(WAIT_SLICE_S):
                pass
        except BaseException:
            _KEPT.append((None, self._work))
            raise
        if failure:
            raise failure[0]
        self._done = True
        return True

    def __bool__(self) -> bool:
        return True

    def __getattr__(self, name):  # is_completed, exception, ...: the request's own
        return getattr(self._work, name)


def _gloo_group(group: Any) -> Any:
    """The process group ``group`` names if it is a gloo group this rank belongs to, else None."""
    from torch.distributed import distributed_c10d as c10d

    try:
        resolved = c10d._get_default_group() if group is None or group is c10d.GroupMember.WORLD else group
        return resolved if c10d.get_backend(resolved) == "gloo" else None
    except (ValueError, RuntimeError):
        return None


def _wait(work: Any, group: Any) -> None:
    """``work.wait()`` in slices; on an exception while it is pending, keep ``group`` and ``work``."""
    import datetime

    try:
        while True:
            try:
                work.wait(timeout=datetime.timedelta(seconds=WAIT_SLICE_S))
                return
            except RuntimeError:
                if work.is_completed():  # it failed, or it completed just after the slice ran out:
                    work.wait()  # raises the operation's own error, or returns
                    return
    except BaseException:
        if not work.is_completed():
            _KEPT.append((group, work))
        raise


def _sliced(original: Callable) -> Callable:
    import functools

    from torch.distributed import distributed_c10d as c10d

    signature = inspect.signature(original)

    @functools.wraps(original)
    def collective(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        group = None if bound.arguments.get("async_op") else _gloo_group(bound.arguments.get("group"))
        if group is None or group in c10d._world.pg_coalesce_state:
            return original(*args, **kwargs)
        bound.arguments["async_op"] = True
        work = original(*bound.args, **bound.kwargs)
        if work is not None and hasattr(work, "is_completed"):
            _wait(work, group)
        return None

    collective._rrfp_sliced = True
    return collective


def _sliced_coalescing(original: Callable) -> Callable:
    import contextlib

    @contextlib.contextmanager
    def coalescing_manager(group=None, device=None, async_ops=False):
        gloo = None if async_ops else _gloo_group(group)
        if gloo is None:
            with original(group, device, async_ops) as manager:
                yield manager
            return
        with original(group, device, True) as manager:
            yield manager
        for work in manager.works:
            if work is not None and hasattr(work, "is_completed"):
                _wait(work, gloo)

    coalescing_manager._rrfp_sliced = True
    return coalescing_manager


def nvrx_conflict() -> Optional[str]:
    """A one-line error when the installed nvidia-resiliency-ext would make ``import megatron.core``
    fail (the megatron package found on ``sys.path`` checks NVRx's version at import); else None.
    Reads files and package metadata only: imports neither megatron nor NVRx."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("nvidia-resiliency-ext")
    except PackageNotFoundError:
        return None
    spec = importlib.util.find_spec("megatron")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        checker = Path(location, *_NVRX_CHECKER)
        if checker.is_file():
            found = re.search(r'^NVRX_MIN_VERSION\s*=\s*"([^"]+)"', checker.read_text(), re.MULTILINE)
            if found is None:
                return None
            from packaging.version import Version

            needed = found.group(1)
            if Version(installed) >= Version(needed) and _has_version_attribute():
                return None
            return (f"nvidia-resiliency-ext {installed} is installed, but {checker} (imported with megatron.core) "
                    f"needs nvidia-resiliency-ext >= {needed} and reads nvidia_resiliency_ext.__version__: "
                    f"pip install 'nvidia-resiliency-ext>={needed}' (wheels for glibc >= 2.39), or pip uninstall "
                    "nvidia-resiliency-ext")
    return None


def _has_version_attribute() -> bool:
    spec = importlib.util.find_spec("nvidia_resiliency_ext")
    if spec is None or spec.origin in (None, "namespace"):
        return False  # a namespace package (0.4.x) has no __init__ and no __version__
    return "__version__" in Path(spec.origin).read_text()




class ArgsOnReentry:
    """Megatron-LM's parsed arguments, given back to a ``pretrain`` that NVRx calls again.

    Since core_v0.18.0 the entry scripts parse the flags before ``pretrain`` (``parse_and_validate_args``;
    ``pretrain`` takes a config container and no ``args_defaults``), while the finalize step of
    ``megatron/training/inprocess_restart.py`` (``destroy_state`` -> ``destroy_global_vars``) still
    forgets them: the second call fails at once with "args is not initialized". ``enter`` keeps a copy
    of the arguments at the first call and, at a later call that finds none, sets the global variables
    from a fresh copy of it, as ``parse_and_validate_args`` did. Releases whose ``pretrain`` parses the
    flags itself (0.16.x) are left alone."""

    def __init__(self) -> None:
        self.snapshot: Any = None

    def enter(self, pretrain: Callable) -> bool:
        """At each ``pretrain`` call; True when it gave the arguments back."""
        if "args_defaults" in inspect.signature(pretrain).parameters:
            return False  # this pretrain parses its own flags
        try:
            from megatron.training import global_vars
        except ImportError:  # a stand-in for megatron.training
            return False
        if not hasattr(global_vars, "_GLOBAL_ARGS") or not hasattr(global_vars, "set_global_variables"):
            return False  # not Megatron-LM's global_vars

        current = global_vars._GLOBAL_ARGS
        if current is not None:
            if self.snapshot is None and getattr(current, "inprocess_restart", False):
                import copy

                self.snapshot = copy.deepcopy(current)
            return False
        if self.snapshot is None:
            return False
        import copy

        global_vars.set_global_variables(copy.deepcopy(self.snapshot))
        return True


__all__ = ["ArgsOnReentry", "WAIT_SLICE_S", "call_wrapper_class", "check_granularity", "inject_call_wrapper",
           "finalize_without_cuda", "leave_out_gpu_health_checks", "nvrx_conflict", "prepare", "wait_in_slices_on_gloo"]
