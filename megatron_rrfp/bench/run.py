"""`megatron-rrfp bench` / `demo`: measured iteration times of Megatron-core's own 1F1B and
of RRFP on real megatron-core models, side by side in one run, under the *same* seeded
run-time variability (emulation.py), with the simulator's prediction printed beside.

Local mode (default) starts one gloo process per rank on this host's CPUs (they see no GPU);
``--device cuda`` starts one rank per GPU over NCCL through torch's launcher, the emulated
device time a sleep kernel on each rank's compute stream. Under torchrun/SLURM (WORLD_SIZE
set) each process runs one rank itself, on its device.

Formulas, per measured iteration (wall = slowest rank, between two barriers):
  bubble fraction = 1 - sum over ranks of busy time / (ranks x wall), busy = F/B/W spans
  tokens/s        = num_microbatches x micro_batch_size x seq_length x DP / wall
  speedup         = median wall of megatron-1f1b / median wall of the schedule
Memory, per rank and schedule (max over the measured iterations; the table shows the max
over ranks): peak activation bytes of the schedule call (runtime/memory.py: the CUDA
allocator's peak, or on CPU the bytes held for backward — saved tensors, waiting messages,
deferred W) and peak (microbatch, chunk) forwards in flight (RRFP: its arbiter; Megatron:
counted around its own tasks, bench/around_schedules.py).
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar, Optional

from ..checks import BUFFER_LIMITS, TIMEOUT_S, Bound, bound, check_fields, integer
from ..policy.arbiter import DEFAULT_BUFFER_LIMIT
from ..policy.budget import LimitSpec, check_limit_spec, starting_limit
from ..sim.variability import VARIABILITY_LEVELS, Variability
from .comm_emulation import check_communication
from .pairs import check_paired
from .rank import bench_rank, run_in_this_process
from .summary import summarize
from .sweep import BENCH_SCHEDULES, DEFAULT_SCHEDULES, BenchRun, bench_runs, limit_list
from .sweep import SIM_POLICY as _SIM_POLICY

# Per-rank seconds per iteration measured by RRFP's executor, and its wall time.


@dataclass(kw_only=True, slots=True)
class BenchConfig:
    """One benchmark run."""

    model: str = "gpt"
    """gpt (megatron-core GPTModel, local spec), hybrid (HybridModel, megatron-core >= 0.18: one attention
    and one MLP layer per model chunk, local layers) or multimodal (vision encoder + GPT decoder)."""
    pipeline_size: int = 4
    num_chunks: int = 1
    """Model chunks per stage: > 1 compares Megatron's *interleaved* schedule with RRFP on chunks."""
    tensor_parallel: int = 1
    data_parallel: int = 1
    num_microbatches: int = 16
    micro_batch_size: int = 2
    seq_length: int = 32
    hidden_size: int = 32
    schedules: Sequence[str] = DEFAULT_SCHEDULES
    """megatron-1f1b (the reference), rrfp-strict / rrfp-zbh1-strict (1F1B / ZB-H1 as fixed orders in
    RRFP's runtime), rrfp-default, rrfp-bf, rrfp-bfw, rrfp-zbh1 (readiness-first); see bench/sweep.py."""
    variability: str = "j3"
    """j0..j3 (see VARIABILITY_LEVELS)."""
    f0_ms: float = 50.0
    """Emulated forward time of one stage per microbatch; backward is 2x."""
    workload: Variability = field(default_factory=Variability)
    """Workload shape (straggler, sequence lengths, images per sample...); its f0 and jitter
    fields are replaced by ``f0_ms`` and the ``variability`` level."""
    iterations: int = 5
    warmup: int = 1
    interleave: bool = False
    """Alternate the schedules iteration by iteration (each schedule's warm-up first) instead of
    running each schedule's iterations back to back: a slow spell of a shared host then falls on
    every schedule alike, which is how ratios between schedules are measured on a loaded machine."""
    seed: int = 0
    buffer_limit: LimitSpec | Sequence[LimitSpec] = DEFAULT_BUFFER_LIMIT
    """RRFP's limit: an int, a multiple of Megatron's peak in flight ("1x") or "auto"; or a list
    of distinct ones: each readiness-first schedule runs once per limit (a trade-off sweep)."""
    out_dir: str = "rrfp-out/bench"
    goodput_ledger: Optional[str] = None
    """SQLite goodput ledger: every measured iteration of every schedule, in run order."""
    timeout_s: float = 1200.0
    # production parallelism (Megatron-LM's names; bench/cli.py keeps them in one group)
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (needs tensor_parallel > 1, gpt)."""
    overlap_grad_reduce: bool = False
    """Wrap the stages in megatron-core DDP with overlapped gradient reduction (and Megatron's
    no_sync / finalize_model_grads hooks), for every schedule alike."""
    use_distributed_optimizer: bool = False
    """DDP's distributed-optimizer layout (reduce-scatter); implies the DDP wrapping."""
    overlap_param_gather: bool = False
    """Megatron-LM's --overlap-param-gather (needs the two flags above): the parameter all-gathers
    launch at the iteration's start and each chunk's first forward waits for its first bucket;
    emulated only (``dp_gather_ms``; the bench has no optimizer step: bench/comm_emulation.py)."""
    dp_reduce_ms: float = 0.0
    """Emulated device time of one model chunk's DP gradient reduction, split over its DDP buckets by
    elements: what overlapping it is worth (at the end without --overlap-grad-reduce)."""
    dp_gather_ms: float = 0.0
    """Emulated device time of one model chunk's parameter all-gather (--use-distributed-optimizer)."""
    a2a_ms: float = 0.0
    """Emulated device time of each MoE expert all-to-all (dispatch / combine, in F and in B)."""
    overlap_moe_expert_parallel_comm: bool = False
    """megatron-core's combined forward-backward step for every schedule (bench/pairs.py): Megatron's
    combined-1F1B interleaved schedule as megatron-1f1b, RRFP pairing a ready forward with a ready backward."""
    delay_wgrad_compute: bool = False
    """With the flag above: the weight gradients inside the combined step (megatron-core >= 0.19 locally)."""
    transport: str = "auto"
    """RRFP's transport (RRFPConfig.transport): auto, threads, or rounds (the NCCL protocol CUDA runs, on gloo)."""
    dp_overlap: str = "auto"
    """RRFPConfig.dp_overlap: 'after-loop' takes RRFP's DP communication out of its task loop, on CPU too."""
    whole_stage_agreement: bool = False
    """Apply the whole-stage agreement (mcore/dp_overlap.py: CUDA applies it with interleaving, DP > 1
    and an overlap flag) on CPU too, to measure what it costs (the breakdown's agree_s)."""
    image_size: Optional[int] = None
    """multimodal: LLaVA's image side (--img-h); one image of (image_size / patch_dim)^2
    tokens per sample instead of the recipe's default images (bench/stages.py)."""
    patch_dim: int = 14
    device: str = "cpu"
    """cpu: gloo ranks on this host's CPUs, CUDA hidden from them; cuda: one rank per GPU over NCCL."""
    optimal: bool = False
    """Also each run's clairvoyant optimum on the iterations' emulated device times (sim/optimal.py,
    OR-Tools CP-SAT; small layouts): the measured time over it beside /LB."""
    optimal_time_limit_s: float = 10.0
    """Solver seconds per iteration and distinct (split, memory, latency) of the runs."""

    BOUNDS: ClassVar[dict[str, Bound]] = {
        "pipeline_size": integer(2, 256), "num_chunks": integer(1, 16), "tensor_parallel": integer(1, 64),
        "data_parallel": integer(1, 64), "num_microbatches": integer(1, 10_000), "micro_batch_size": integer(1, 4096),
        "seq_length": integer(1, 1 << 20), "hidden_size": integer(1, 1 << 16), "f0_ms": bound(0, 60_000, low_open=True),
        "iterations": integer(1, 10_000), "warmup": integer(0, 10_000), "seed": integer(0, 2**31 - 1),
        "buffer_limit": BUFFER_LIMITS, "timeout_s": TIMEOUT_S, "dp_reduce_ms": bound(0, 60_000),
        "dp_gather_ms": bound(0, 60_000), "a2a_ms": bound(0, 60_000),
        "optimal_time_limit_s": bound(0, 24 * 3600, low_open=True),
    }
    FLAGS: ClassVar[dict[str, str]] = {
        "pipeline_size": "--pipeline-model-parallel-size", "num_chunks": "--virtual-pipeline-model-parallel-size",
        "tensor_parallel": "--tensor-model-parallel-size", "data_parallel": "--data-parallel-size",
        "num_microbatches": "--num-microbatches", "micro_batch_size": "--micro-batch-size",
        "seq_length": "--seq-length", "hidden_size": "--hidden-size", "f0_ms": "--f0-ms", "iterations": "--iterations",
        "warmup": "--warmup",
        "seed": "--seed", "buffer_limit": "--buffer-limit", "timeout_s": "--timeout", "dp_reduce_ms": "--dp-reduce-ms",
        "dp_gather_ms": "--dp-gather-ms", "a2a_ms": "--a2a-ms", "optimal_time_limit_s": "--optimal-time-limit",
    }
    MAX_LOCAL_RANKS = 128
    _RANKS = "--pipeline-model-parallel-size x --tensor-model-parallel-size x --data-parallel-size"
    _HEADS = 4  # attention heads of the benchmark's tiny models (train.models.tiny_gpt_config, the ViT's spec)
    _VOCAB = 128

    def variability_model(self) -> Variability:
        if self.variability not in VARIABILITY_LEVELS:
            raise ValueError(f"--variability {self.variability!r}: choose one of {', '.join(VARIABILITY_LEVELS)}")
        return replace(self.workload, f0=self.f0_ms / 1000.0, **VARIABILITY_LEVELS[self.variability])

    def validate(self) -> None:
        self.variability_model()
        try:
            for limit in limit_list(self.buffer_limit):
                check_limit_spec(limit)
        except ValueError as exc:
            raise ValueError(f"--buffer-limit: {exc}") from None
        if not BUFFER_LIMITS.accepts(self.buffer_limit):
            raise ValueError(f"--buffer-limit must be {BUFFER_LIMITS.describe()}, got {self.buffer_limit!r}")
        unknown = [s for s in self.schedules if s not in BENCH_SCHEDULES]
        if unknown:
            raise ValueError(f"--schedules: unknown {unknown}; available: {', '.join(BENCH_SCHEDULES)}")
        if "megatron-1f1b" not in self.schedules:
            raise ValueError("--schedules must include megatron-1f1b: speedups are measured against it")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device {self.device!r}: choose cpu or cuda")
        if self.pipeline_size < 2:
            raise ValueError(f"--pipeline-model-parallel-size must be >= 2 (pipeline bubbles need a pipeline), got "
                             f"{self.pipeline_size}")
        if self.model not in ("gpt", "hybrid", "multimodal"):
            raise ValueError(f"--model {self.model!r}: choose gpt, hybrid or multimodal")
        if self.model == "hybrid":
            from ..mcore.compat import hybrid_model_unavailable

            if hybrid_model_unavailable():
                raise ValueError(f"--model hybrid: {hybrid_model_unavailable()}; use --model gpt on this release")
        if self.sequence_parallel and (self.tensor_parallel < 2 or self.model != "gpt"):
            raise ValueError(f"--sequence-parallel needs --tensor-model-parallel-size > 1 and --model gpt (got "
                             f"--tensor-model-parallel-size {self.tensor_parallel}, --model {self.model})")
        if self.num_chunks < 1 or (self.num_chunks > 1 and self.model == "multimodal"):
            raise ValueError(f"--virtual-pipeline-model-parallel-size {self.num_chunks}: interleaving is benchmarked "
                             "with --model gpt or hybrid")
        self._check_values_and_layout()
        check_communication(self)
        check_paired(self)
        if self.optimal:
            self._check_optimal()

    def _check_optimal(self) -> None:
        """--optimal: the solver is installed and the layout small enough, before any rank starts."""
        from ..policy.plan import Plan
        from ..policy.topology import Topology
        from ..sim.optimal import check_size, require_solver
        from ..sim.simulator import policy

        require_solver()
        topology = Topology(self.pipeline_size, self.num_chunks)
        split = any(Plan.build(policy(_SIM_POLICY[run.schedule], starting_limit(run.limit)), topology,
                               self.num_microbatches).split_backward for run in self.runs())
        check_size(topology, self.num_microbatches, split_backward=split)

    def _check_values_and_layout(self) -> None:
        """Every value in range and consistent with the layout, before any rank starts."""
        from ..policy.plan import Plan
        from ..policy.topology import Topology
        from ..sim.simulator import policy

        check_fields(self, self.BOUNDS, self.FLAGS)
        world = self.pipeline_size * self.tensor_parallel * self.data_parallel
        if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
            if os.environ["WORLD_SIZE"] != str(world):
                raise ValueError(f"{self._RANKS} = {world} ranks, but the launcher started WORLD_SIZE="
                                 f"{os.environ['WORLD_SIZE']}")
        elif self.device == "cuda":
            visible = _visible_gpus()
            if visible < world:
                raise ValueError(f"--device cuda runs one rank per GPU: {self._RANKS} = {world} GPUs needed, "
                                 f"{visible} visible; leave out --device cuda to run the ranks on CPU")
        elif world > self.MAX_LOCAL_RANKS:
            raise ValueError(f"{self._RANKS} = {world} local ranks; at most {self.MAX_LOCAL_RANKS} run on one "
                             "host (use torchrun / srun for more)")
        if self.hidden_size % self._HEADS or self._HEADS % self.tensor_parallel:
            raise ValueError(f"--hidden-size must be a multiple of the tiny models' {self._HEADS} attention heads "
                             f"and --tensor-model-parallel-size must divide them (1, 2 or 4); got --hidden-size "
                             f"{self.hidden_size}, --tensor-model-parallel-size {self.tensor_parallel}")
        if self.image_size is not None and (self.model != "multimodal" or self.image_size % self.patch_dim
                                            or (self.image_size // self.patch_dim) ** 2 >= self.seq_length):
            raise ValueError(f"--img-h {self.image_size} --patch-dim {self.patch_dim} need --model multimodal, a "
                             f"multiple of the patch, and fewer patches than --seq-length {self.seq_length}")
        if self.model == "multimodal" and self.image_size is None and self.seq_length <= 12:
            raise ValueError(f"--seq-length must be >= 13 with --model multimodal (3 images x 4 tokens leave room for "
                             f"text), got {self.seq_length}")
        if self.goodput_ledger is not None and os.path.isdir(self.goodput_ledger):
            raise ValueError(f"--goodput-ledger {self.goodput_ledger!r} is a directory; give the ledger file's path")
        self.variability_model().check_layout(self.pipeline_size)
        experts, ep = self.workload.num_experts, self.workload.expert_parallel
        if ep > 1 and (not experts or self.data_parallel % ep or self.model != "gpt"):
            raise ValueError(f"--expert-model-parallel-size {ep} needs --num-experts, --model gpt and a "
                             f"--data-parallel-size that it divides (got --num-experts {experts}, --model "
                             f"{self.model}, --data-parallel-size {self.data_parallel})")
        topology = Topology(self.pipeline_size, self.num_chunks)
        for name, limit in dict.fromkeys((_SIM_POLICY[run.schedule], starting_limit(run.limit)) for run in self.runs()):
            try:
                Plan.build(policy(name, limit), topology, self.num_microbatches)
            except ValueError as exc:
                raise ValueError(f"--schedules with --pipeline-model-parallel-size {self.pipeline_size} "
                                 f"--virtual-pipeline-model-parallel-size {self.num_chunks} --num-microbatches "
                                 f"{self.num_microbatches}: {exc}") from None

    def runs(self) -> list[BenchRun]:
        """What runs, in order: each schedule; a readiness-first one once per buffer limit."""
        return bench_runs(self.schedules, self.buffer_limit)


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# -- the parent: launch, progress, report ---------------------------------------------

def run_bench(config: BenchConfig, *, progress: bool = True) -> dict:
    config.validate()
    os.makedirs(config.out_dir, exist_ok=True)
    world = config.pipeline_size * config.tensor_parallel * config.data_parallel
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # torchrun / srun: we are one rank
        per_rank = run_in_this_process(config)
        if not per_rank:
            return {}  # rank 0 gathered every rank's figures and reports them
    else:
        per_rank = _run_locally(config, world, progress)
    report = summarize(config, per_rank)
    _write_outputs(config, report, per_rank)
    return report


def _run_locally(config: BenchConfig, world: int, progress: bool) -> list[dict]:
    from tqdm import tqdm

    from ..launch.function import launch
    from ..quiet import announce
    from .emulation import SendTimeTable, remove_stale_tables, shared_table_path

    announce()  # before the progress bar, never over it
    remove_stale_tables()
    tag = f"{os.getpid()}-{int(time.time())}"
    progress_path = os.path.join(config.out_dir, f".progress-{tag}")
    table_path = shared_table_path(tag)
    box: dict = {}

    def work() -> None:
        try:
            if config.device == "cuda":
                box["results"] = _run_with_torch_launcher(config, world, progress_path, table_path)
            else:
                box["results"] = launch(bench_rank, world_size=world, tp=config.tensor_parallel,
                                        pp=config.pipeline_size, ep=config.workload.expert_parallel,
                                        timeout=config.timeout_s,
                                        vpp=config.num_chunks if config.num_chunks > 1 else None,
                                        args=(config, progress_path, table_path))
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    try:  # the shared-memory table and the progress file go on any exit: error, Ctrl-C, SIGTERM
        with _termination_as_exit():
            SendTimeTable(table_path, config.pipeline_size, config.num_chunks, config.num_microbatches, create=True,
                          replicas=config.data_parallel)
            open(progress_path, "w").close()
            thread = threading.Thread(target=work, daemon=True)
            thread.start()
            total = len(config.runs()) * (config.warmup + config.iterations)
            with tqdm(total=total, desc="benchmark iterations", disable=not progress, unit="it") as bar:
                while thread.is_alive():
                    thread.join(0.5)
                    with open(progress_path, encoding="utf-8") as handle:
                        lines = handle.read().split()
                    done = int(lines[-3]) if len(lines) >= 3 else 0
                    if done > bar.n:
                        bar.set_postfix_str(lines[-1])
                        bar.update(done - bar.n)
    finally:
        for path in (progress_path, table_path):
            try:
                os.remove(path)
            except OSError:
                pass
    if "error" in box:
        raise box["error"]
    return box["results"]


@contextlib.contextmanager
def _termination_as_exit():
    """SIGTERM / SIGHUP raise SystemExit(128 + signal) in the main thread while inside, so
    ``finally`` clauses run (Ctrl-C already raises KeyboardInterrupt); elsewhere a no-op.
    A signal someone else handles or ignores (``nohup``) is left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_now(signum, frame):
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, exit_now) for sig in (signal.SIGTERM, signal.SIGHUP)
                if signal.getsignal(sig) is signal.SIG_DFL}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run_with_torch_launcher(config: BenchConfig, world: int, progress_path: str, table_path: str) -> list[dict]:
    """``--device cuda``: one rank per GPU, started by torch's launcher (``python -m
    torch.distributed.run --standalone``) running this module; every rank's figures back.
    (With ``device="cpu"`` the same path on gloo ranks: how the tests exercise it without GPUs.)"""
    import pickle
    import shutil
    import subprocess
    import tempfile

    from ..launch.env import for_gloo_ranks
    from ..launch.torchrun import run_module_subprocess

    run_dir = tempfile.mkdtemp(prefix="rrfp-bench-")
    try:
        with open(os.path.join(run_dir, "config.pkl"), "wb") as handle:
            pickle.dump((config, progress_path, table_path), handle)
        env = dict(os.environ)
        if config.device == "cpu":  # gloo ranks: no GPU (env.hide_cuda), loopback (containers' hostnames)
            for_gloo_ranks(env)
        status = run_module_subprocess(world, "megatron_rrfp.bench.rank", [run_dir], env=env,
                                       timeout_s=config.timeout_s)
        if status:
            raise RuntimeError(f"bench --device cuda: torch's launcher exited with status {status} (the failed "
                               "rank's error is above)")
        with open(os.path.join(run_dir, "results.pkl"), "rb") as handle:
            return pickle.load(handle)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"bench --device cuda: not finished after --timeout {config.timeout_s:g} s") from None
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _write_outputs(config: BenchConfig, report: dict, per_rank: list[dict]) -> None:
    from ..sim.curve import plot_tradeoff
    from ..sim.study import save_json
    from ..trace import Span, plot_timelines, write_chrome_trace

    save_json(report, os.path.join(config.out_dir, "bench.json"))
    timelines = {}
    for bench_run, run in zip(config.runs(), report["runs"]):
        key = bench_run.key
        spans = [Span(**s) for r in per_rank for s in r["runs"][key]["spans"]]
        for span in spans:  # one track per pipeline stage in the picture (rank = stage at TP=DP=1)
            span.rank = next(r["stage"] for r in per_rank if r["rank"] == span.rank) if config.tensor_parallel == \
                config.data_parallel == 1 else span.rank
        write_chrome_trace(spans, os.path.join(config.out_dir, f"trace-{key}.json"),
                           metadata={"schedule": run["schedule"], "buffer_limit_spec": run["buffer_limit_spec"],
                                     "measured": True, **{
                                         name: {str(r["rank"]): r["runs"][key][name] for r in per_rank}
                                         for name in ("peak_activation_bytes", "peak_in_flight", "buffer_limit")}})
        label = (f"{key} (peak activations {run['peak_activation_bytes']['max_over_ranks'] / 1e6:.2f} MB, "
                 f"{run['peak_in_flight']['max_over_ranks']} in flight)")
        timelines[label] = spans
    plot_timelines(timelines, os.path.join(config.out_dir, "timeline.png"),
                   title=f"measured: {config.model} PP={config.pipeline_size} M={config.num_microbatches} "
                         f"{config.variability} (median iteration)")
    if "tradeoff" in report:
        plot_tradeoff(report["tradeoff"], os.path.join(config.out_dir, "tradeoff.png"))
