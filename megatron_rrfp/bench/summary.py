"""What ``megatron-rrfp bench`` reports from every rank's measurements: speedups, bubble, the
simulator's prediction for the same realizations (with and without each schedule's measured host
cost), makespan over the lower bound (and over the clairvoyant optimum with ``--optimal``), memory
beside every figure, and where the time went."""
from __future__ import annotations

import statistics
from dataclasses import asdict, replace
from typing import Optional

from ..runtime.report import BREAKDOWN_FIELDS
from .emulation import draw_seed
from .pairs import paired_arbiter, simulate_schedule
from .sweep import SIM_POLICY as _SIM_POLICY
from .sweep import limit_list, tradeoff_section

BREAKDOWN = (*BREAKDOWN_FIELDS, "wall_s")


def _byte_budgets(per_rank: list[dict], key: str, num_stages: int):
    """Per stage, the ``membytes.ByteBudget`` a rank of it ran the last call with; None if any ran without."""
    from ..policy.membytes import ByteBudget, StageBytes

    by_stage = {r["stage"]: r["runs"][key].get("byte_weights") for r in per_rank}
    if len(by_stage) != num_stages or not all(by_stage.values()):
        return None
    return tuple(ByteBudget(StageBytes(*by_stage[s][:4]), admit=by_stage[s][4], split=by_stage[s][5])
                 for s in range(num_stages))


def summarize(config, per_rank: list[dict]) -> dict:
    """The report of one bench run; ``config`` is a ``bench.run.BenchConfig``."""
    from ..policy.topology import Topology
    from ..sim.bounds import median_lower_bound
    from ..sim.simulator import policy, simulate
    from ..sim.variability import sample_realization, with_host_cost
    from .breakdown import explain_gap, run_breakdown, stage_host_costs

    ranks = per_rank[0]["world_size"]
    first = per_rank[0]["runs"]
    tokens = config.num_microbatches * config.micro_batch_size * config.seq_length * config.data_parallel
    baseline = statistics.median(first["megatron-1f1b"]["walls"])
    topology = Topology(config.pipeline_size, config.num_chunks)
    variability = config.variability_model()
    bench_runs = config.runs()
    stage_limits = {run.key: _per_stage(per_rank, run.key, "buffer_limit") for run in bench_runs}
    # The simulator runs one limit on every stage: the smallest any stage used (auto may differ per stage).
    sim_limits = {key: min([v for v in limits if v] or [1]) for key, limits in stage_limits.items()}
    host_costs = {run.key: stage_host_costs(per_rank, run.key, config.pipeline_size) for run in bench_runs}
    sims: dict[str, list[float]] = {}
    sims_host: dict[str, list[float]] = {}  # the same, each task plus its schedule's measured host cost
    sims_dp: dict[str, list[float]] = {}  # the same with the emulated DP communication (sim/dp_comm.py)
    # per measured iteration, each DP replica's draw (as its ranks slept it); replica 0's for the bound and optimum
    draws = [[sample_realization(variability, topology, config.num_microbatches, seed=draw_seed(config.seed, i, r))
              for r in range(config.data_parallel)] for i in range(config.warmup, config.warmup + config.iterations)]
    realizations = [replicas[0] for replicas in draws]
    byte_budgets = {run.key: _byte_budgets(per_rank, run.key, config.pipeline_size) for run in bench_runs}
    orders: list[list] = []  # per realisation, every run's simulated orders: the optimum's warm starts
    for replicas in draws:
        orders.append([])
        for run in bench_runs:
            # the byte budget the executor ran with (1x: policy/membytes.py), so the simulation decides alike
            arbiter_config = paired_arbiter(config, replace(policy(_SIM_POLICY[run.schedule], sim_limits[run.key]),
                                                            memory_bytes=byte_budgets[run.key]))
            if config.overlap_moe_expert_parallel_comm:  # combined steps: pairs (bench/pairs.py)
                sims.setdefault(run.key, []).append(max(simulate_schedule(config, run.schedule, arbiter_config,
                                                                          topology, r) for r in replicas))
                if host_costs[run.key] is not None:
                    sims_host.setdefault(run.key, []).append(max(simulate_schedule(
                        config, run.schedule, arbiter_config, topology, with_host_cost(r, host_costs[run.key]))
                        for r in replicas))
                continue
            simulated = [simulate(arbiter_config, topology, config.num_microbatches, r) for r in replicas]
            sims.setdefault(run.key, []).append(max(s.makespan for s in simulated))  # the slower replica
            orders[-1].append(simulated[0].orders)
            if config.dp_reduce_ms or config.dp_gather_ms:
                sims_dp.setdefault(run.key, []).append(_with_dp_comm(config, arbiter_config, topology, replicas,
                                                                     rrfp=run.schedule != "megatron-1f1b",
                                                                     variability=variability,
                                                                     kept=first[run.key].get("dp_epoch_variant")))
            if host_costs[run.key] is not None:
                sims_host.setdefault(run.key, []).append(max(simulate(
                    arbiter_config, topology, config.num_microbatches,
                    with_host_cost(r, host_costs[run.key])).makespan for r in replicas))
    sim_base = statistics.median(sims["megatron-1f1b"])
    sim_host_base = statistics.median(sims_host["megatron-1f1b"]) if "megatron-1f1b" in sims_host else None
    megatron_peak = max(r["runs"]["megatron-1f1b"]["peak_activation_bytes"] for r in per_rank)
    runs = []
    for run in bench_runs:
        key = run.key
        walls, busy = first[key]["walls"], first[key]["busy"]
        median = statistics.median(walls)
        peak_bytes = [r["runs"][key]["peak_activation_bytes"] for r in per_rank]
        in_flight = [r["runs"][key]["peak_in_flight"] for r in per_rank]
        runs.append({
            "schedule": run.schedule,
            "buffer_limit_spec": str(run.limit) if run.swept else None,
            "iteration_time_s": {"median": median, "p90": _quantile(walls, 0.9), "all": walls},
            "speedup_vs_megatron_1f1b": baseline / median,
            "bubble_fraction": statistics.median([1 - b / (ranks * w) for b, w in zip(busy, walls)]),
            "tokens_per_s": tokens / median,
            "simulated_iteration_time_s": statistics.median(sims[key]),
            "simulated_speedup": sim_base / statistics.median(sims[key]),
            # the bound for what this run may do: its split, its per-stage limit, and message latency
            # where the bench delayed its messages (never Megatron's own p2p)
            # (the bound runs F and B in series: not a bound where combined steps overlap them)
            "over_lower_bound": float("nan") if config.overlap_moe_expert_parallel_comm else
            median / median_lower_bound(policy(_SIM_POLICY[run.schedule], sim_limits[key]), topology, realizations,
                                        stage_limits=stage_limits[key], latency=run.schedule != "megatron-1f1b"),
            "breakdown_s": _across_ranks([r["runs"][key]["breakdown"] for r in per_rank]),
            "peak_activation_bytes": {"max_over_ranks": max(peak_bytes), "per_rank": peak_bytes},
            "peak_in_flight": {"max_over_ranks": max(in_flight), "per_rank": in_flight},
            "activation_memory_vs_megatron_1f1b": max(peak_bytes) / megatron_peak if megatron_peak else None,
            "buffer_limit": {"spec": str(run.limit), "per_stage": stage_limits[key]} if run.swept else None,
            "task_breakdown": run_breakdown(per_rank, key),
            "host_cost_s_per_task": host_costs[key],
            "simulated_speedup_with_host_cost": sim_host_base / statistics.median(sims_host[key])
            if sim_host_base and key in sims_host else None,
            "simulated_iteration_time_s_with_host_cost": statistics.median(sims_host[key])
            if key in sims_host else None,
        })
        if key in sims_dp:  # the simulator's own DP model, for the emulated DP communication
            runs[-1]["simulated_iteration_time_s_with_dp_comm"] = statistics.median(sims_dp[key])
        runs[-1]["dp_epoch_variant"] = first[key].get("dp_epoch_variant")  # as the run chose it (epoch_tuning)
        runs[-1]["dp_epoch_trial"] = first[key].get("dp_epoch_trial")  # and what its trial measured
    for run in runs:
        run["gap_explanation"] = explain_gap(run, runs[0])
    if config.optimal:
        _add_optimum(config, runs, bench_runs, topology, realizations, orders, sim_limits, stage_limits)
    report = {"config": asdict(config), "variability": asdict(variability), "ranks": ranks,
              "activation_measure": per_rank[0]["runs"]["megatron-1f1b"]["activation_measure"], "runs": runs}
    if len(limit_list(config.buffer_limit)) > 1:
        megatron_in_flight = max(r["runs"]["megatron-1f1b"]["peak_in_flight"] for r in per_rank)
        report["tradeoff"] = tradeoff_section(config, runs, megatron_in_flight, megatron_peak)
    return report


def _add_optimum(config, runs, bench_runs, topology, realizations, orders, sim_limits, stage_limits) -> None:
    """``--optimal``: per run, the clairvoyant optimum of what it may do (its split, its per-stage
    memory, latency as its bound charges it) on each iteration's emulated times; the median
    measured time over the median optimum beside /LB (sim/optimal.py). Runs that agree on all
    three share the solves."""
    from tqdm import tqdm

    from ..sim.optimal import optimum_for_policy
    from ..sim.simulator import policy

    cache: dict = {}
    for run, report in tqdm(list(zip(bench_runs, runs)), desc="clairvoyant optimum per run", leave=False):
        optimum = optimum_for_policy(policy(_SIM_POLICY[run.schedule], sim_limits[run.key]), topology, realizations,
                                     stage_limits=stage_limits[run.key], latency=run.schedule != "megatron-1f1b",
                                     warm_starts=orders, time_limit_s=config.optimal_time_limit_s, cache=cache)
        report["optimum"] = optimum
        report["over_optimum"] = report["iteration_time_s"]["median"] / optimum["makespan_median"]


def _with_dp_comm(config, arbiter_config, topology, replicas, *, rrfp: bool, variability,
                  kept: Optional[str] = None) -> float:
    """The simulated iteration with ``sim/dp_comm.py``'s DP channel, one draw per DP replica (a
    reduction starts once every replica launched it): one bucket per chunk (the
    bench's DDP layout), the bench's emulated times (seconds, like the realization's); RRFP's
    choice of ``mcore/dp_overlap.py`` as it runs: after-loop as DP communication at the end, the
    epoch rule through ``sim/dp_epochs.py`` in the variant the run kept (``kept``, its name), else
    the one the simulator chooses for the bench's own jitter and DP communication."""
    from ..mcore.dp_overlap import AFTER_LOOP, EPOCHS, dp_communication_of_layout
    from ..mcore.epoch_tuning import MODELLED_REPLICAS
    from ..policy.epochs import candidate_variants, timeline_for
    from ..policy.plan import Plan
    from ..sim.dp_comm import DPComm, replicas_iteration_time
    from ..sim.dp_epochs import choose_variant, run_with_epochs
    from ..sim.simulator import simulate

    mode = rrfp and dp_communication_of_layout(
        overlap=config.overlap_grad_reduce or config.overlap_param_gather, num_chunks=topology.num_chunks,
        device_type=config.device, data_parallel_size=config.data_parallel, choice=config.dp_overlap)
    m = config.num_microbatches
    comm = DPComm(reduce_per_bucket=config.dp_reduce_ms / 1e3, gather_per_bucket=config.dp_gather_ms / 1e3,
                  buckets_per_chunk=1)
    deferred = frozenset()
    if mode == EPOCHS:
        variant = next((v for v in candidate_variants(topology.num_chunks) if str(v) == kept), None)
        if variant is None:  # the simulator's choice, made once per layout (it runs every variant)
            key = (arbiter_config, topology, m)
            if key not in _CHOSEN:
                _CHOSEN[key] = choose_variant(arbiter_config, topology, m, variability, comm,
                                              dp=min(config.data_parallel, MODELLED_REPLICAS))[0]
            variant = _CHOSEN[key]
        timeline = timeline_for(arbiter_config, topology, m, Plan.build(arbiter_config, topology, m).split_backward,
                                variant)
        traces = [run_with_epochs(arbiter_config, topology, m, r, timeline).trace for r in replicas]
        deferred = timeline.deferred
    else:
        traces = [simulate(arbiter_config, topology, m, r, record_trace=True).trace for r in replicas]
    return replicas_iteration_time(traces, topology.num_stages, topology.num_chunks, comm,
                                   overlap_grad_reduce=config.overlap_grad_reduce and mode != AFTER_LOOP,
                                   overlap_param_gather=config.overlap_param_gather and mode != AFTER_LOOP,
                                   deferred=deferred)


_CHOSEN: dict = {}  # (arbiter config, layout, M) -> the epoch rule's variant the simulator chose


def _per_stage(per_rank: list[dict], schedule: str, key: str) -> list:
    """``key`` of ``schedule`` per pipeline stage (its first rank: TP ranks agree)."""
    by_stage: dict[int, object] = {}
    for r in sorted(per_rank, key=lambda r: r["rank"]):
        by_stage.setdefault(r["stage"], r["runs"][schedule][key])
    return [by_stage[stage] for stage in sorted(by_stage)]


def _across_ranks(per_rank: list) -> Optional[dict]:
    """{metric: {min, median, max}} over ranks of each rank's median per iteration: compute
    (F/B/W), wait (bubble: blocked on readiness), backpressure, agree (TP), flush (last sends)."""
    if not per_rank or per_rank[0] is None:
        return None
    return {name: {"min": min(r[name] for r in per_rank), "median": statistics.median(r[name] for r in per_rank),
                   "max": max(r[name] for r in per_rank)} for name in BREAKDOWN}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]
