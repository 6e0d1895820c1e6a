"""Emulated device time of data-parallel and expert communication, the same for every schedule.

The bench's tiny models reduce their gradients over gloo in microseconds; a real job's
bucket reductions, the distributed optimizer's parameter all-gathers and MoE's all-to-alls
take device time. This runs the simulator's model (``sim/dp_comm.py``: its ``DPChannel``
and ``bucket_durations``) on one rank's **DP channel** (NCCL's own stream), in wall-clock
seconds: collectives on it run one at a time in launch order, beside compute, and whoever
needs a result sleeps until the channel delivers it.

* **reductions** (``dp_reduce_s`` per model chunk: each DDP bucket group its share of the
  chunk's gradient elements, so "at the end" — one bucket per chunk, DDP without
  ``--overlap-grad-reduce`` — and overlapped, with several buckets, move the same bytes):
  megatron-core's ``_ParamAndGradBucketGroup.start_grad_sync`` launches a group (DDP's hooks,
  ``grad_sync.SplitReadiness``, or ``finish_grad_sync`` without overlap); like a collective it
  starts on the channel once *every DP replica* of the rank has launched it (each rank publishes
  its launch time in the job's store, ``ReplicaClock``: the simulator's
  ``replicas_iteration_time``); ``finish_grad_sync`` (``finalize_model_grads``, after the
  schedule) sleeps until the group is done. A launch inside a task happens after that task's
  emulated sleep (``emulation.py`` sleeps before the real compute), i.e. at the task's end;
  expert-parallel bucket groups run on this rank's launch alone;
* **parameter all-gathers** (``dp_gather_s`` per chunk, distributed optimizer): the bench has
  no optimizer step, so they are emulated only, where Megatron-LM puts them: without
  ``--overlap-param-gather`` after the step, every chunk's in turn (``after_call`` sleeps
  their sum inside the measured iteration); with it, launched when the iteration starts in
  chunk order, and chunk c's first forward waits for its first bucket group (DDP's forward
  pre-hook; the rest hide behind that forward, as in the simulator); RRFP's after-loop choice
  (``--rrfp-dp-overlap after-loop``) forces them before the first task
  (``start_param_sync(force_sync=True)``), which then waits for every chunk's;
* **all-to-alls** (``a2a_s`` each): megatron-core's ``_AllToAll`` (the alltoall dispatcher's
  dispatch and combine, in F and in B) sleeps ``a2a_s`` in place: a blocking collective inside
  the task, counted as the task's device time (``take_task_device``); inside a combined step
  holding a forward and a backward (``counting_all_to_alls``) they are counted, not slept: the
  pair's time is the longer of its compute and its all-to-alls (``emulation.py``).

``exposed_s`` is what the rank slept waiting on the channel in one iteration: the DP
communication the schedule did not hide (the breakdown's ``dp_wait_s``).
"""
from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from typing import Optional

from ..policy.actions import Kind, Task
from ..sim.dp_comm import DPChannel, bucket_durations

__all__ = ["CommEmulator", "CommTimes", "ReplicaClock", "check_communication", "comm_emulator"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CommTimes:
    dp_reduce_s: float = 0.0
    """Device time of one model chunk's whole gradient reduction (split over its buckets by elements)."""
    dp_gather_s: float = 0.0
    """Device time of one model chunk's parameter all-gather (distributed optimizer)."""
    overlap_param_gather: bool = False
    a2a_s: float = 0.0
    """Device time of one expert all-to-all (each dispatch / combine, forward and backward)."""

    @property
    def active(self) -> bool:
        return bool(self.dp_reduce_s or self.dp_gather_s or self.a2a_s)


def check_communication(config) -> None:
    """The emulated communication options of a ``bench.run.BenchConfig`` need the layout they model."""
    ddp = config.overlap_grad_reduce or config.use_distributed_optimizer
    if config.dp_reduce_ms and (not ddp or config.data_parallel < 2):
        raise ValueError(f"--dp-reduce-ms {config.dp_reduce_ms} needs --dp > 1 and DDP (--overlap-grad-reduce "
                         "and/or --use-distributed-optimizer; without overlap the reductions run at the end)")
    if config.dp_gather_ms and (not config.use_distributed_optimizer or config.data_parallel < 2):
        raise ValueError(f"--dp-gather-ms {config.dp_gather_ms} needs --dp > 1 and --use-distributed-optimizer "
                         "(parameter all-gathers exist only with the distributed optimizer)")
    if config.overlap_param_gather and not (config.use_distributed_optimizer and config.overlap_grad_reduce):
        raise ValueError("--overlap-param-gather needs --use-distributed-optimizer --overlap-grad-reduce "
                         "(Megatron-LM's check)")
    if config.a2a_ms and config.workload.expert_parallel < 2:
        raise ValueError(f"--a2a-ms {config.a2a_ms} needs --num-experts and --expert-model-parallel-size > 1 "
                         "(the all-to-alls it times)")
    if config.transport not in ("auto", "threads", "rounds"):
        raise ValueError(f"--rrfp-transport {config.transport!r}: choose auto, threads or rounds")
    if config.whole_stage_agreement and config.dp_overlap == "after-loop":
        raise ValueError("--whole-stage-agreement forces lock-step; --rrfp-dp-overlap after-loop takes the DP "
                         "communication out of the loop instead: choose one")
    if config.whole_stage_agreement and (config.num_chunks < 2 or config.data_parallel < 2
                                       or not (config.overlap_grad_reduce or config.overlap_param_gather)):
        raise ValueError("--whole-stage-agreement needs --chunks > 1, --dp > 1 and --overlap-grad-reduce "
                         f"(where CUDA applies it); got --chunks {config.num_chunks}, --dp {config.data_parallel}")


def comm_emulator(config, stage) -> Optional[CommEmulator]:
    """The installed emulator of a bench rank (``stage``: its DDP chunk or chunks), or None."""
    times = CommTimes(dp_reduce_s=config.dp_reduce_ms / 1e3, dp_gather_s=config.dp_gather_ms / 1e3,
                      overlap_param_gather=config.overlap_param_gather, a2a_s=config.a2a_ms / 1e3)
    if not times.active:
        return None
    clock = ReplicaClock.of_this_rank() if config.data_parallel > 1 else None
    return CommEmulator(times, stage if isinstance(stage, list) else [stage], clock).install()


class ReplicaClock:
    """When every DP replica of this rank has launched a reduction: ranks publish their launch
    times (``time.time()``: the bench's ranks share one host's clock) in the job's store."""

    def __init__(self, store, prefix: str, replica: int, replicas: int) -> None:
        self.store, self.prefix, self.replica, self.replicas = store, prefix, replica, replicas

    @classmethod
    def of_this_rank(cls) -> ReplicaClock:
        import torch.distributed as dist
        from megatron.core import parallel_state

        store = dist.distributed_c10d._get_default_store()  # the job's rendezvous store, on every rank
        prefix = (f"rrfp-bench-dp/{parallel_state.get_pipeline_model_parallel_rank()}/"
                  f"{parallel_state.get_tensor_model_parallel_rank()}")
        return cls(store, prefix, parallel_state.get_data_parallel_rank(),
                   parallel_state.get_data_parallel_world_size())

    def launched(self, key: str, when: float) -> None:
        self.store.set(f"{self.prefix}/{key}/{self.replica}", repr(when))

    def all_launched(self, key: str) -> float:
        """The last replica's launch time (waits for every replica's record)."""
        return max(float(self.store.get(f"{self.prefix}/{key}/{r}")) for r in range(self.replicas))


_active: list = [None]  # the process's installed CommEmulator (one per bench rank)


class CommEmulator:
    """One rank's DP channel; ``install`` once, ``begin_iteration`` / ``after_call`` around each call."""

    def __init__(self, times: CommTimes, chunks: list, clock: Optional[ReplicaClock] = None) -> None:
        self.times, self.chunks, self.clock = times, chunks, clock
        self._share: dict[int, float] = {}  # id(bucket group) -> its share of its chunk's elements
        self._first_group: list = []  # per chunk: the bucket group its first forward waits for
        for chunk in chunks:
            groups = [*getattr(chunk, "bucket_groups", ()), *getattr(chunk, "expert_parallel_bucket_groups", ())]
            sizes = [sum(b.grad_data.numel() for b in g.buckets) for g in groups]
            for group, share in zip(groups, bucket_durations(1.0, sizes) if sum(sizes) else [0.0] * len(groups)):
                self._share[id(group)] = share
            # DDP gathers in forward order: the last bucket group holds the chunk's first parameters
            self._first_group.append(groups[-1] if groups else None)
        self._lock = threading.Lock()
        self._done: dict[int, float] = {}  # id(bucket group) -> when its reduction is done
        self._launches: list[int] = []  # id(bucket group) launched here, not yet on the channel
        dense = [g for chunk in chunks for g in getattr(chunk, "bucket_groups", ())]  # over the DP replicas
        self._index = {id(g): i for i, g in enumerate(dense)}
        self._iteration = 0
        self._gathered: list[float] = []  # per chunk: when its first forward may start
        self._all_gathered: list[float] = []  # per chunk: when its last bucket group is gathered
        self._chunk_of = {id(g): c for c, chunk in enumerate(chunks)
                          for g in (*getattr(chunk, "bucket_groups", ()),
                                    *getattr(chunk, "expert_parallel_bucket_groups", ()))}
        self._forwards_seen: set[int] = set()
        self._channel = DPChannel()
        self.exposed_s = 0.0
        self._task_device = 0.0
        self.counting_all_to_alls = False

    # -- set-up ------------------------------------------------------------------------

    def install(self) -> CommEmulator:
        _patch_megatron()
        _active[0] = self
        return self

    def begin_iteration(self) -> None:
        now = time.time()
        self._iteration += 1  # every rank runs the same calls: the replicas' keys match
        self._done.clear()
        self._launches.clear()
        self._forwards_seen.clear()
        self.exposed_s, self._channel = 0.0, DPChannel(now)
        self._gathered = [0.0] * len(self.chunks)
        self._all_gathered = [0.0] * len(self.chunks)
        if self.times.overlap_param_gather and self.times.dp_gather_s:
            # launched after the previous step in chunk order; a chunk's first group first
            for chunk in range(len(self.chunks)):
                self._gathered[chunk] = self._queue(now, self.times.dp_gather_s * self._first_share(chunk))
                self._all_gathered[chunk] = self._queue(now, self.times.dp_gather_s * (1 - self._first_share(chunk)))

    def after_call(self) -> None:
        """After the schedule: the all-gathers of a step without --overlap-param-gather."""
        if self.times.dp_gather_s and not self.times.overlap_param_gather:
            self._sleep_until(self._queue(time.time(), self.times.dp_gather_s * len(self.chunks)))

    # -- hooks -------------------------------------------------------------------------

    def before_task(self, task: Task) -> float:
        """A chunk's first forward waits for its parameters (overlapped all-gather); returns the wait."""
        if task.kind is not Kind.F or task.chunk in self._forwards_seen or task.chunk >= len(self._gathered):
            return 0.0
        self._forwards_seen.add(task.chunk)
        return self._sleep_until(self._gathered[task.chunk])

    def take_task_device(self) -> float:
        """Emulated device time spent inside the task just run (all-to-alls), then reset."""
        seconds, self._task_device = self._task_device, 0.0
        return seconds

    def launched(self, group) -> None:
        share = self._share.get(id(group))
        if share is None or id(group) in self._done or id(group) in self._launches:
            return
        now = time.time()
        if self.clock is None or id(group) not in self._index:
            self._done[id(group)] = self._queue(now, self.times.dp_reduce_s * share)
            return
        self.clock.launched(self._key(id(group)), now)
        self._launches.append(id(group))

    def gathered_now(self, group) -> None:
        """A forced (synchronous) all-gather: wait until the chunk's gathers are done."""
        chunk = self._chunk_of.get(id(group))
        if chunk is not None and chunk < len(self._all_gathered):
            self._sleep_until(self._all_gathered[chunk])

    def finished(self, group) -> None:
        while self._launches and id(group) not in self._done:  # on the channel in launch order
            gid = self._launches.pop(0)
            start = self.clock.all_launched(self._key(gid))
            self._done[gid] = self._queue(start, self.times.dp_reduce_s * self._share[gid])
        done = self._done.get(id(group))
        if done is not None:
            self._sleep_until(done)

    def all_to_all(self) -> None:
        if self.times.a2a_s:
            if not self.counting_all_to_alls:
                time.sleep(self.times.a2a_s)
            self._task_device += self.times.a2a_s

    # -- internals ---------------------------------------------------------------------

    def _key(self, group_id: int) -> str:
        return f"{self._iteration}/{self._index[group_id]}"

    def _first_share(self, chunk: int) -> float:
        group = self._first_group[chunk]
        return self._share.get(id(group), 1.0) if group is not None else 1.0

    def _queue(self, at: float, seconds: float) -> float:
        """Put ``seconds`` on the channel no earlier than ``at``; returns when it is done."""
        with self._lock:
            return self._channel.queue(at, seconds)

    def _sleep_until(self, when: float) -> float:
        delay = when - time.time()
        if delay <= 0:
            return 0.0
        time.sleep(delay)
        self.exposed_s += delay
        return delay


def _patch_megatron() -> None:
    """Route megatron-core's bucket-group reductions and all-to-alls through the active emulator (once)."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
    from megatron.core.tensor_parallel import mappings

    if getattr(_ParamAndGradBucketGroup, "_rrfp_comm_emulated", False):
        return

    def then(method, notify: str):  # a bucket-group method, then the emulator's ``notify(group)``
        @functools.wraps(method)
        def run(group, *args, **kwargs):
            result = method(group, *args, **kwargs)
            if _active[0] is not None:
                getattr(_active[0], notify)(group)
            return result
        return run

    def timed(step):  # _AllToAll's forward or backward, then its emulated device time
        def run(ctx, *args, **kwargs):
            out = step(ctx, *args, **kwargs)
            _emulate_all_to_all()
            return out
        return staticmethod(run)

    _ParamAndGradBucketGroup.start_grad_sync = then(_ParamAndGradBucketGroup.start_grad_sync, "launched")
    _ParamAndGradBucketGroup.finish_grad_sync = then(_ParamAndGradBucketGroup.finish_grad_sync, "finished")
    plain_gather = _ParamAndGradBucketGroup.start_param_sync
    forced_gather = then(plain_gather, "gathered_now")

    @functools.wraps(plain_gather)
    def start_param_sync(group, *args, force_sync: bool = False, **kwargs):  # forced: RRFP's after-loop choice
        return (forced_gather if force_sync else plain_gather)(group, *args, force_sync=force_sync, **kwargs)

    _ParamAndGradBucketGroup.start_param_sync = start_param_sync
    mappings._AllToAll.forward, mappings._AllToAll.backward = \
        timed(mappings._AllToAll.forward), timed(mappings._AllToAll.backward)
    _ParamAndGradBucketGroup._rrfp_comm_emulated = True


def _emulate_all_to_all() -> None:
    if _active[0] is not None:
        _active[0].all_to_all()
