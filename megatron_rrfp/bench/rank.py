"""What each rank of `megatron-rrfp bench` / `demo` runs: every schedule on its stage, under the
same emulated device time (``emulation.py``), with the figures ``summary.py`` reports. Started by
``run.py``: on gloo ranks by the project's launcher, on GPUs by torch's launcher running this
module (``python -m megatron_rrfp.bench.rank RUN_DIR``), or by a user's own torchrun / srun.
``config`` is a ``bench.run.BenchConfig``."""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Optional

from .stages import build_stage, with_ddp
from .summary import BREAKDOWN
from .sweep import BenchRun


def run_order(runs: Sequence[BenchRun], iterations: int, interleave: bool) -> list[tuple[BenchRun, int]]:
    """(run, iteration index) in the order they execute: run by run, or iteration by iteration."""
    if interleave:
        return [(run, i) for i in range(iterations) for run in runs]
    return [(run, i) for run in runs for i in range(iterations)]


def bench_rank(config, progress_path: Optional[str] = None, table_path: Optional[str] = None) -> dict:
    """Run every schedule on this rank; returns measured figures (rank 0 holds the totals)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_with_interleaving,
        forward_backward_pipelining_without_interleaving,
    )

    from ..cpu import enable_cpu_reference_schedules
    from ..goodput.recorder import GoodputRecorder
    from ..mcore.compat import pipeline_device
    from ..mcore.config import RRFPConfig
    from ..mcore.schedule import forward_backward_rrfp, last_iteration_report
    from ..mcore.session import shutdown
    from ..mcore.state import ScheduleState
    from ..policy.topology import Topology
    from ..runtime.memory import ActivationMeter, model_tensors
    from ..sim.variability import sample_realization
    from .around_schedules import count_in_flight, count_received
    from .comm_emulation import comm_emulator
    from .emulation import DeviceTimeEmulator, SendTimeTable, draw_seed
    from .pairs import paired_arbiter

    enable_cpu_reference_schedules()  # a no-op in a rank on CUDA
    device = pipeline_device()
    stage_index = parallel_state.get_pipeline_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    topology = Topology(pp, config.num_chunks)
    stage, forward_step, data = build_stage(config)
    if device.type == "cuda":  # built on CPU (the same weights on any device), then moved
        for chunk in (stage if isinstance(stage, list) else [stage]):
            chunk.to(device)
        data = _on_device(data, device)
    stage = with_ddp(config, stage)
    parameters = [p for chunk in (stage if isinstance(stage, list) else [stage]) for p in chunk.parameters()]
    megatron_schedule = forward_backward_pipelining_with_interleaving if config.num_chunks > 1 \
        else forward_backward_pipelining_without_interleaving
    replica = parallel_state.get_data_parallel_rank()
    table = SendTimeTable(table_path, pp, config.num_chunks, config.num_microbatches, create=False,
                          replicas=config.data_parallel, replica=replica) if table_path else None
    emulator = DeviceTimeEmulator(stage=stage_index, topology=topology, num_microbatches=config.num_microbatches,
                                  table=table, device=device).install()
    emulator.comm = comm = comm_emulator(config, stage)  # None without emulated DP / expert communication
    megatron_in_flight = count_in_flight()
    megatron_meter = ActivationMeter(pipeline_device(),
                                     persistent=model_tensors(stage if isinstance(stage, list) else [stage]))
    variability = config.variability_model()
    rank = dist.get_rank()
    results: dict = {"rank": rank, "stage": stage_index, "world_size": dist.get_world_size(), "runs": {}}
    recorder = GoodputRecorder(config.goodput_ledger, rank=rank, world=dist.get_world_size(), job="bench")
    runs = config.runs()
    recorder.job_start(schedules=[run.key for run in runs], model=config.model, pp=pp, variability=config.variability)
    tokens = config.num_microbatches * config.micro_batch_size * config.seq_length * config.data_parallel
    ledger_iteration = 0
    total = len(runs) * (config.warmup + config.iterations)
    done = 0
    state = {}
    for run in runs:
        arbiter = paired_arbiter(config, run.arbiter())  # as RRFP's runtime runs it under the flag
        state[run.key] = {"arbiter": arbiter, "split_backward": arbiter.parsed_hint.for_layout(
            topology, split_backward=arbiter.split_backward_ok).split_backward, "walls": [], "busy": [],
            "spans": [], "breakdowns": [], "tasks": [], "memory": {
                "peak_activation_bytes": 0, "peak_in_flight": 0, "buffer_limit": None, "activation_measure": "",
                "byte_weights": (), "dp_epoch_variant": None, "dp_epoch_trial": None}}
    for run, iteration in run_order(runs, config.warmup + config.iterations, config.interleave):
        schedule, own = run.schedule, state[run.key]
        arbiter, split_backward, memory = own["arbiter"], own["split_backward"], own["memory"]
        realization = sample_realization(variability, topology, config.num_microbatches,
                                         seed=draw_seed(config.seed, iteration, replica))
        for p in parameters:
            p.grad = None
        for chunk in (stage if isinstance(stage, list) else [stage]):
            if hasattr(chunk, "zero_grad_buffer"):
                chunk.zero_grad_buffer()
        emulator.split_backward = split_backward and schedule != "megatron-1f1b"
        emulator.delay_rrfp_messages(bool(variability.c50) and schedule != "megatron-1f1b")
        emulator.begin_iteration(realization)
        kwargs = dict(forward_step_func=forward_step, data_iterator=data(iteration), model=stage,
                      num_microbatches=config.num_microbatches, seq_length=config.seq_length,
                      micro_batch_size=config.micro_batch_size)
        dist.barrier()
        if device.type == "cuda":
            # a measurement: both schedules' meters then read this call's own peak exactly
            torch.cuda.reset_peak_memory_stats(device)
        ledger_iteration += 1
        recorder.iteration_start(ledger_iteration)
        cpu = (time.process_time(), time.thread_time())
        start = time.time()
        if comm is not None:
            comm.begin_iteration()
        if schedule == "megatron-1f1b":
            megatron_in_flight.reset()
            megatron_in_flight.active = True
            count_received(megatron_meter)  # its receive buffers, as RRFP's meter counts its waiting messages
            with megatron_meter:
                megatron_schedule(**kwargs)
            count_received(None)
            megatron_in_flight.active = False
            own_spans = list(emulator.spans)
            breakdown, report = None, None
            measured = (megatron_meter.peak_bytes, megatron_in_flight.peak, None, megatron_meter.method)
        else:
            # --whole-stage-agreement: lockstep, named, applies on CPU too (mcore/dp_overlap.py)
            options = RRFPConfig(arbiter=arbiter, timeout_s=config.timeout_s, record_spans=True,
                                 transport=config.transport, **emulator.rrfp_options(),
                                 dp_overlap="lockstep" if config.whole_stage_agreement else config.dp_overlap)
            forward_backward_rrfp(rrfp_config=options, **kwargs)
            report = last_iteration_report()
            own_spans = report.spans
            breakdown = {name: getattr(report, name) for name in BREAKDOWN}
            measured = (report.peak_activation_bytes, report.peak_in_flight, report.buffer_limit or None,
                        report.activation_measure)
            memory["byte_weights"] = report.byte_weights  # the last call's: the simulation models it
            chosen = ScheduleState.get().epoch_variants  # the DP epoch rule's, once a call chose it
            memory["dp_epoch_variant"] = str(next(iter(chosen.values()))) if chosen else None
            trials = ScheduleState.get().epoch_trial_figures  # the measured trial, where the choice had one
            memory["dp_epoch_trial"] = next(iter(trials.values())) if trials else None
        if comm is not None:
            comm.after_call()  # the step's all-gathers without --overlap-param-gather
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # CPU-GPU sync point: the wall time includes the device's work
        elapsed = time.time() - start
        # CPU seconds of this process's other threads (transport, delivery, gloo) meanwhile
        other_cpu = (time.process_time() - cpu[0]) - (time.thread_time() - cpu[1])
        wall = torch.tensor([elapsed], dtype=torch.float64)
        recorder.iteration(ledger_iteration, tokens=tokens, report=report, memory=measured[:2])
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        compute = sum(s.end - s.start for s in own_spans if s.category in ("F", "B", "W", "F+B"))
        busy_total = torch.tensor([compute], dtype=torch.float64)
        dist.all_reduce(busy_total)
        if iteration >= config.warmup:
            own["walls"].append(float(wall))
            own["busy"].append(float(busy_total))
            own["spans"].append(own_spans)
            own["tasks"].append({"by_kind": emulator.tally.as_dict(), "other_threads_cpu_s": other_cpu,
                                 "rank_wall_s": elapsed, "busy_s": compute, "executor": breakdown,
                                 "dp_wait_s": comm.exposed_s if comm is not None else 0.0})
            if breakdown is not None:
                own["breakdowns"].append(breakdown)
        # memory over every call, warm-up included: the first call must fit too (docs/memory.md)
        memory["peak_activation_bytes"] = max(memory["peak_activation_bytes"], measured[0])
        memory["peak_in_flight"] = max(memory["peak_in_flight"], measured[1])
        memory["buffer_limit"], memory["activation_measure"] = measured[2], measured[3]
        done += 1
        if progress_path and rank == 0:
            with open(progress_path, "a", encoding="utf-8") as handle:
                handle.write(f"{done} {total} {run.key}\n")
    for run in runs:
        own = state[run.key]
        breakdowns = own["breakdowns"]
        results["runs"][run.key] = {"walls": own["walls"], "busy": own["busy"],
                                     "spans": [asdict(s) for s in _median_iteration(own["walls"], own["spans"])],
                                     "breakdown": {name: statistics.median(b[name] for b in breakdowns)
                                                   for name in BREAKDOWN} if breakdowns else None,
                                     "tasks": own["tasks"], **own["memory"]}
    recorder.job_end()
    shutdown()
    return results


def _median_iteration(walls: list[float], spans: list[list]) -> list:
    """The spans of the measured iteration whose wall time is the median (the lower one of an
    even count): what the timeline draws, rather than the last iteration, which a host's stall
    can make an outlier. Walls are every rank's maximum, so all ranks pick the same iteration."""
    if not spans:
        return []
    order = sorted(range(len(walls)), key=walls.__getitem__)
    return spans[order[(len(order) - 1) // 2]]


def _on_device(data, device):
    """``data(seed)`` with every tensor of every micro-batch moved to ``device``."""
    def move(batch):
        return {k: v.to(device, non_blocking=True) if hasattr(v, "to") else v for k, v in batch.items()} \
            if isinstance(batch, dict) else batch

    def on_device(seed: int):
        iterators = data(seed)
        if isinstance(iterators, list):
            return [map(move, it) for it in iterators]
        return map(move, iterators)
    return on_device



def run_in_this_process(config, progress_path: Optional[str] = None,
                         table_path: Optional[str] = None) -> list[dict]:
    """One rank of a job whose ranks torchrun / srun started: NCCL on its GPU with ``--device
    cuda``, else gloo. Returns every rank's figures on rank 0, [] elsewhere."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    if config.variability_model().c50 and table_path is None:
        raise ValueError("message-latency emulation needs the ranks on one host, started by `megatron-rrfp bench` "
                         "itself (it shares send times through /dev/shm); under your own torchrun use "
                         "--variability j0 or real hardware variability")
    if config.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if config.device == "cuda" else "gloo")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=config.tensor_parallel, pipeline_model_parallel_size=config.pipeline_size,
        virtual_pipeline_model_parallel_size=config.num_chunks if config.num_chunks > 1 else None,
        expert_model_parallel_size=config.workload.expert_parallel)
    try:
        figures = bench_rank(config, progress_path, table_path)
        everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(figures, everyone, dst=0)
        return everyone or []
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def rank_of_torch_launcher(run_dir: str) -> None:
    """``python -m megatron_rrfp.bench.run RUN_DIR``: one rank of ``_run_with_torch_launcher``."""
    import pickle

    with open(os.path.join(run_dir, "config.pkl"), "rb") as handle:
        config, progress_path, table_path = pickle.load(handle)
    per_rank = run_in_this_process(config, progress_path, table_path)
    if per_rank:
        with open(os.path.join(run_dir, "results.pkl"), "wb") as handle:
            pickle.dump(per_rank, handle)


if __name__ == "__main__":
    import sys

    from megatron_rrfp.bench.rank import rank_of_torch_launcher  # the imported module, not __main__

    rank_of_torch_launcher(sys.argv[1])
