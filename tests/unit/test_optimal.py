"""The clairvoyant optimum (megatron_rrfp/sim/optimal.py, OR-Tools CP-SAT): its orders replay through the
simulator to the solver's makespan, and it is never above a policy's makespan nor below the lower bound."""
from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from megatron_rrfp.cli import main
from megatron_rrfp.policy.actions import peak_in_flight
from megatron_rrfp.policy.arbiter import ArbiterConfig
from megatron_rrfp.policy.hints import HintError
from megatron_rrfp.policy.topology import Topology
from megatron_rrfp.sim import REFERENCE_J3, Realization, Variability, lower_bound, policy, sample_realization, simulate

pytest.importorskip("ortools", reason="pip install megatron-rrfp[optimal]")
from megatron_rrfp.sim.optimal import MAX_TASKS, check_size, optimal_schedule, replay, rounded  # noqa: E402

GRID = 128
"""Test realisations are snapped to multiples of 1/GRID (and a split backward halves them): with
a power-of-two solver scale the solver's times are then exactly the simulator's."""
SCALE = 1024


def on_grid(realization: Realization) -> Realization:
    def snap(table, least):
        return np.maximum(least, np.round(np.asarray(table, dtype=float) * GRID) / GRID).tolist()

    return Realization(snap(realization.forward, 1 / GRID), snap(realization.backward_total, 2 / GRID),
                       snap(realization.activation_latency, 0.0), snap(realization.gradient_latency, 0.0))


def solve(realization, topology, limit, split, **kwargs):
    return optimal_schedule(realization, topology, buffer_limit=limit, split_backward=split, scale=SCALE,
                            time_limit_s=kwargs.pop("time_limit_s", 30.0), **kwargs)


@pytest.mark.parametrize("pp, chunks, m, limit, split, knobs", [
    (2, 1, 4, 2, True, REFERENCE_J3),
    (2, 2, 4, 5, True, REFERENCE_J3),
    (3, 1, 3, 2, False, REFERENCE_J3),
    (3, 1, 3, 3, True, dict(REFERENCE_J3, images_per_sample=1.0, encoder_time_per_image=0.5)),
    (2, 2, 2, 2, True, dict(sigma_compute=0.0)),
])
def test_the_optimums_order_replays_to_the_solvers_makespan(pp, chunks, m, limit, split, knobs):
    topology = Topology(pp, chunks)
    realization = sample_realization(Variability(**knobs), topology, m, seed=3)
    result = solve(realization, topology, limit, split)
    assert result.proven
    # on the solver's own (rounded) times the simulator reproduces its makespan exactly
    assert replay(result.orders, topology, rounded(realization, topology, SCALE, split_backward=split)).makespan \
        == pytest.approx(result.solver_makespan, abs=1e-9)
    # on the exact times: what is reported, within the rounding of each task and message on the way
    assert result.makespan == replay(result.orders, topology, realization).makespan
    assert result.solver_makespan - 4 * pp * chunks * m / SCALE <= result.makespan <= result.solver_makespan
    run = replay(result.orders, topology, realization)
    assert max(run.peak_in_flight) <= max(limit, chunks)
    assert any(t.kind.value == "W" for t in result.orders[0]) == split


def _policies(topology: Topology, m: int, limit: int, split: bool) -> dict[str, ArbiterConfig]:
    """Every policy the optimum must not lose to: readiness-first at the limit, strict orders
    within it; with an unsplit optimum only the unsplit ones."""
    names = ["default", "bf", "1f1b", "1f1b-strict"] + (["bfw", "zbh1", "zbh1-strict"] if split else [])
    configs = {}
    for name in names:
        config = policy(name, limit)
        if not split:
            config = ArbiterConfig(hint=config.hint, buffer_limit=limit, strict=config.strict, split_backward_ok=False)
        configs[name] = config
    return configs


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(pp=st.integers(1, 3), chunks=st.integers(1, 2), m=st.integers(1, 4), limit=st.integers(1, 6),
       split=st.booleans(), sigma_compute=st.sampled_from([0.0, 0.3, 0.6]), c50=st.sampled_from([0.0, 0.1, 0.3]),
       sigma_msg=st.sampled_from([0.0, 1.5]), seed=st.integers(0, 10_000), in_order=st.booleans())
def test_the_optimum_is_never_above_a_policy_nor_below_the_bound(pp, chunks, m, limit, split, sigma_compute, c50,
                                                                sigma_msg, seed, in_order):
    """``in_order``: the optimum that keeps microbatches in order, as every policy does: it must not
    lose to them either."""
    topology = Topology(pp, chunks)
    limit = min(limit, m * chunks)
    realization = on_grid(sample_realization(Variability(sigma_compute=sigma_compute, c50=c50, sigma_msg=sigma_msg),
                                             topology, m, seed))
    result = solve(realization, topology, limit, split, in_order=in_order)  # from scratch: no policy's order
    assume(result.proven)
    cap = max(limit, chunks)
    assert result.makespan >= lower_bound(realization, topology, m, split_backward=split,
                                          in_flight_caps=[cap] * pp) - 1e-9
    assert result.makespan == pytest.approx(result.solver_makespan, abs=1e-9)  # times on the grid: exact
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # bf / bfw's announcement with many chunks
        for name, config in _policies(topology, m, limit, split).items():
            try:
                run = simulate(config, topology, m, realization, name=name)
            except (HintError, ValueError):  # a layout Megatron's interleaved order refuses, gpipe below its room
                continue
            if config.strict and max(peak_in_flight(order) for order in run.orders) > cap:
                continue  # a fixed order above the limit: not a schedule the optimum may run
            assert result.makespan <= run.makespan + 1e-9, (name, result.makespan, run.makespan)


def test_above_its_size_the_optimum_is_refused_in_one_line(capsys):
    with pytest.raises(ValueError, match=r"--optimal: PP 4 x 4 chunks x M 32 is 1536 tasks.*at most 800") as info:
        check_size(Topology(4, 4), 32, split_backward=True)
    assert "\n" not in str(info.value) and str(MAX_TASKS) in str(info.value)
    assert main(["simulate", "--pp", "8", "-m", "64", "--seeds", "1", "--optimal"]) != 0
    err = capsys.readouterr().err.strip()
    assert "--optimal" in err and "--num-microbatches" in err and len(err.splitlines()) == 1


def test_simulate_prints_each_policy_over_the_optimum_beside_the_bound(capsys):
    assert main(["simulate", "--pp", "2", "-m", "4", "--reference", "--seeds", "2", "--optimal",
                 "--policies", "default,bf"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("policy"))
    assert header.split()[4:6] == ["/opt", "/LB"]
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["default"], ["bf"])}
    assert float(rows["default"][4]) >= 1.0 and float(rows["bf"][4]) >= 1.0
    assert "optimum (clairvoyant, CP-SAT, split backward" in out and "proven on 2 of 2 seeds" in out


def test_without_the_solver_the_error_names_the_extra():
    code = ("import sys; sys.modules['ortools'] = None\n"
            "from megatron_rrfp.cli import main\n"
            "sys.exit(main(['simulate', '--pp', '2', '-m', '4', '--seeds', '1', '--optimal']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "pip install megatron-rrfp[optimal]" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_keeping_microbatches_in_order_costs_the_optimum_its_reordering():
    """PP2, M4, 1x, j3 (seed 0): the clairvoyant optimum runs microbatch 1 last on both stages; kept in
    order it still beats the default by deferring a W on the last stage behind a forward about to arrive."""
    topology = Topology(2, 1)
    realization = sample_realization(Variability(**REFERENCE_J3), topology, 4, seed=0)
    free, ordered = (solve(realization, topology, 2, True, in_order=flag) for flag in (False, True))
    assert free.proven and ordered.proven
    assert free.makespan < ordered.makespan
    assert [t.microbatch for t in free.orders[0] if t.kind.value == "F"] != [0, 1, 2, 3]
    for order in ordered.orders:
        for kind in "FBW":
            assert [t.microbatch for t in order if t.kind.value == kind] == [0, 1, 2, 3]
    default = simulate(policy("default", 2), topology, 4, realization)
    assert ordered.makespan < default.makespan
