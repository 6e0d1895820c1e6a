"""The multi-process launcher, the CPU adapter and the reference models.

    python -m pytest tests/distributed/test_harness.py -q        # ~1 min on 2 cores

Rank functions are top-level (they are pickled into the rank processes) and import
megatron-core inside, so the failure tests that skip it start in ~1 s instead of ~5 s.
"""
from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

from helpers import mlp
from megatron_rrfp.launch import function as launcher_module
from megatron_rrfp.launch.function import DistributedTestFailure, launch

SEQ, MBS, VOCAB, MICROBATCHES = 8, 2, 64, 4


def _assert_all_reaped(outcomes_or_pids) -> None:
    """No launched rank is still a child of ours or of the fork server that forks the ranks:
    neither running nor an unreaped zombie."""
    assert multiprocessing.active_children() == []
    parents = {os.getpid()} | _fork_server_pids()
    for pid in (getattr(o, "pid", o) for o in outcomes_or_pids):
        assert not _is_child_of(pid, parents), f"rank process {pid} outlived launch()"


def _fork_server_pids() -> set[int]:
    # multiprocessing keeps its fork server's pid privately; the ranks are its children.
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    return set() if pid is None else {pid}


def _is_child_of(pid: int, parents: set[int]) -> bool:
    # /proc rather than os.kill(pid, 0): on a busy machine a reaped pid may be reused by
    # someone else's process, which is then not our child.
    try:
        with open(f"/proc/{pid}/status") as status:
            ppid = next(int(line.split()[1]) for line in status if line.startswith("PPid:"))
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): fall back to "does the pid exist"
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return ppid in parents


# --------------------------------------------------------------------------- rank functions


def _report_layout():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    return {
        "rank": dist.get_rank(), "pid": os.getpid(),
        "tp": (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
        "pp": (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()),
        "dp": (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()),
        "env": (os.environ.get("OMP_NUM_THREADS"), os.environ.get("RRFP_TEST_MARK"),
                os.environ.get("RRFP_PARENT_MARK")),
        "mlp_losses": _mlp_1f1b_losses(),
    }


def _mlp_1f1b_losses() -> list[float]:
    """Run megatron-core's own schedule over MLPStage; per-microbatch losses (last stage)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_rrfp.cpu import enable_cpu_reference_schedules
    from megatron_rrfp.train import models

    enable_cpu_reference_schedules()
    config = models.tiny_gpt_config(num_layers=4, hidden_size=16, ffn_hidden_size=32)
    stage = mlp.build_mlp_stage(config, seed=11)
    data = mlp.synthetic_mlp_batches(seed=5, micro_batch_size=MBS, seq_length=SEQ,
                                        hidden_size=16)
    losses = get_forward_backward_func()(
        forward_step_func=mlp.mlp_forward_step, data_iterator=data, model=stage,
        num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=MBS)
    return [float(d["mse loss"][0]) for d in losses]


def _gpt_grads(full_state=None, vpp=None) -> dict:
    """megatron-core's schedule for this layout over GPT stages; PP=1 names -> grads.

    With ``full_state`` (parameters of the PP=1 model by name) the stages are loaded from
    it, so a pipelined run computes the very same function as the sequential one. With
    ``vpp``, this rank holds ``vpp`` model chunks, each with its own data iterator.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_rrfp.cpu import enable_cpu_reference_schedules
    from megatron_rrfp.train import models

    enable_cpu_reference_schedules()
    # Interleaved at PP=2 needs unbatched p2p (batched gives wrong gradients, see adapter).
    config = models.tiny_gpt_config(num_layers=4, batch_p2p_comm=vpp is None)
    chunks = [models.build_gpt_stage(config, vocab_size=VOCAB, seq_length=SEQ, seed=7,
                                     vp_stage=None if vpp is None else v)
              for v in range(vpp or 1)]
    params = {}  # PP=1 name -> parameter
    for chunk in chunks:
        names = mlp.pp1_parameter_names(chunk)
        params.update((names[n], p) for n, p in chunk.named_parameters())
    if full_state is not None:
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(full_state[name])
    data = [models.synthetic_gpt_batches(seed=3, micro_batch_size=MBS, seq_length=SEQ,
                                         vocab_size=VOCAB) for _ in chunks]
    losses = get_forward_backward_func()(
        forward_step_func=models.gpt_forward_step,
        data_iterator=data if vpp else data[0], model=chunks if vpp else chunks[0],
        num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=MBS)
    return {
        "losses": [d["lm loss"] for d in losses],
        "grads": {n: p.grad.clone() for n, p in params.items()},
        "state": {n: p.detach().clone() for n, p in params.items()},
    }


def _raise_hang_die_or_return():
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == 0:
        raise ValueError("rank 0 exploded on purpose")
    if rank == 1:
        _sleep_forever()
    if rank == 2:
        os._exit(3)
    return "fine"


def _sleep_forever():
    while True:
        time.sleep(1)


def _hang_in_barrier_or_sleep():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.barrier()
    _sleep_forever()


# --------------------------------------------------------------------------- tests


def _sequential_reference() -> dict:
    return {"mlp_losses": _mlp_1f1b_losses(), "gpt": _gpt_grads()}


@pytest.fixture(scope="module")
def sequential():
    """Single-process (PP=1) runs that the distributed layouts must reproduce."""
    return launch(_sequential_reference, world_size=1, timeout=120)[0]


# Generous limits: other jobs may share the 2 cores, and a 4-rank megatron launch costs
# ~20 s of CPU (importing megatron.core is ~4 s per process).
@pytest.mark.timeout(300)  # covers the module fixture's launch too
@pytest.mark.parametrize("tp, pp", [(2, 2), (1, 4), (1, 2)], ids=["tp2pp2", "pp4", "dp2pp2"])
def test_launch_layouts_match_parallel_state(tp, pp, sequential, monkeypatch):
    # Set after the fork server started (the fixture launched): ranks see each call's environment.
    monkeypatch.setenv("RRFP_PARENT_MARK", f"tp{tp}pp{pp}")
    out = launch(_report_layout, world_size=4, tp=tp, pp=pp, timeout=120,
                 env={"RRFP_TEST_MARK": "seen"})
    dp = 4 // (tp * pp)
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    for rank, o in enumerate(out):
        # megatron's default order "tp-cp-ep-dp-pp": tp varies fastest, pp slowest.
        assert o["tp"] == (rank % tp, tp)
        assert o["dp"] == ((rank // tp) % dp, dp)
        assert o["pp"] == (rank // (tp * dp), pp)
        assert o["env"] == ("1", "seen", f"tp{tp}pp{pp}")
        last_stage = o["pp"][0] == pp - 1
        # MLPStage's init is layout independent, so every layout computes the PP=1 losses.
        if last_stage:
            assert o["mlp_losses"] == pytest.approx(sequential["mlp_losses"], rel=1e-5)
        else:
            assert o["mlp_losses"] == []
    _assert_all_reaped([o["pid"] for o in out])


@pytest.mark.timeout(90)
def test_failure_reports_every_rank_and_kills_the_hung_one(monkeypatch):
    monkeypatch.setattr(launcher_module, "GRACE_PERIOD_S", 2.0)
    start = time.monotonic()
    with pytest.raises(DistributedTestFailure) as info:
        launch(_raise_hang_die_or_return, world_size=4, init_megatron=False, timeout=50)
    assert time.monotonic() - start < 45  # not the 50 s timeout: the grace period ended it
    err = info.value
    assert [o.status for o in err.outcomes[:3]] == ["raised", "killed", "died"]
    # Rank 3 needs the dead ranks in its teardown barrier (after fn returned) or, when it was the
    # slowest to start, still in its process-group setup: it errors (connection reset) or blocks
    # until killed. Either way it is reported, not "ok".
    assert err.outcomes[3].status in ("raised", "killed")
    if err.outcomes[3].status == "raised":
        detail = err.outcomes[3].detail
        assert detail.startswith("fn returned, then teardown failed") or "in _setup" in detail, detail
    message = str(err)
    assert "ValueError: rank 0 exploded on purpose" in message
    assert "_raise_hang_die_or_return" in err.outcomes[0].detail
    assert "_sleep_forever" in err.outcomes[1].stacks  # faulthandler dump of the hung rank
    assert err.outcomes[1].exitcode == -9
    assert err.outcomes[2].exitcode == 3
    for rank in range(4):
        assert f"--- rank {rank} " in message
    _assert_all_reaped(err.outcomes)


@pytest.mark.timeout(60)
def test_timeout_kills_all_and_shows_stacks():
    start = time.monotonic()
    with pytest.raises(DistributedTestFailure) as info:
        # 10 s: enough for both ranks to import torch and reach fn on a busy 2-core box.
        launch(_hang_in_barrier_or_sleep, world_size=2, init_megatron=False, timeout=10)
    elapsed = time.monotonic() - start
    assert elapsed < 10 + launcher_module.STACK_DUMP_WAIT_S + 10
    err = info.value
    assert "timed out after 10 s" in str(err)
    assert [o.status for o in err.outcomes] == ["killed", "killed"]
    for outcome in err.outcomes:
        assert "most recent call first" in outcome.stacks  # a faulthandler dump per rank
    # Where a rank was when killed depends on how fast it started (a busy machine may not
    # even have finished importing torch in 10 s); check the frames when it got there.
    rank0, rank1 = (o.stacks for o in err.outcomes)
    if "_hang_in_barrier_or_sleep" in rank0:
        assert "in barrier" in rank0
    if "_hang_in_barrier_or_sleep" in rank1:
        assert "_sleep_forever" in rank1
    _assert_all_reaped(err.outcomes)


def test_bad_layout_is_rejected_before_starting():
    with pytest.raises(ValueError, match="tp\\*pp\\*cp=2\\*3\\*1"):
        launch(_sleep_forever, world_size=4, tp=2, pp=3)
    with pytest.raises(ValueError, match="vpp"):
        launch(_sleep_forever, world_size=2, vpp=2, pp=1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("vpp", [None, 2], ids=["1f1b", "interleaved"])
def test_megatron_pp2_gradients_equal_sequential_run(vpp, sequential):
    """The reference fact the executor is checked against: megatron-core's own PP=2
    schedules on CPU (via enable_cpu_reference_schedules) equal a single-process run.

    The PP=1 run's initial parameters are loaded into the PP=2 stages (by PP=1 name), so
    both compute the same function on the same micro-batches.
    """
    reference = sequential["gpt"]
    stages = launch(_gpt_grads, world_size=2, vpp=vpp, timeout=120,
                    kwargs={"full_state": reference["state"], "vpp": vpp})
    pipelined = {**stages[0]["grads"], **stages[1]["grads"]}
    assert sorted(pipelined) == sorted(reference["grads"])
    assert not set(stages[0]["grads"]) & set(stages[1]["grads"])  # each param on one stage
    for name, grad in reference["grads"].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(pipelined[name], grad, rtol=1e-5, atol=1e-7,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert stages[0]["losses"] == []
    torch.testing.assert_close(stages[1]["losses"], reference["losses"], rtol=1e-5, atol=0)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["fail", "hang"])
def test_the_gpu_selfcheck_never_waits_on_a_failed_rank_and_names_it(mode, tmp_path):
    """The self-check's runner (selfcheck/runner.py, as scripts/gpu_selfcheck.py
    runs it) on 2 gloo ranks: rank 1 raises in a multi-rank step (or hangs in it) while rank 0
    waits in that step's all-reduce. Rank 0 leaves at once after the failure (after the 5 s
    step timeout for a hang), names rank 1 (the unfinished ranks), prints the verdict and
    exits 1; nothing waits for gloo's 30 min (nor the launch's own 150 s timeout)."""
    from helpers.selfcheck_ranks import selfcheck_ranks

    with pytest.raises(DistributedTestFailure) as failed:
        launch(selfcheck_ranks, world_size=2, init_megatron=False, timeout=150,
               args=(mode, str(tmp_path / "store"), 5.0))
    rank0 = failed.value.outcomes[0]
    assert rank0.status == "died" and rank0.exitcode == 1, failed.value  # left by itself, not killed at 150 s
    out = rank0.stdout_tail
    if mode == "fail":
        assert "[rank 0] FAIL collective: rank 1 failed (collective: ValueError: injected failure" in out, out
    else:
        assert "[rank 0] FAIL collective: rank(s) [0, 1] did not finish it within --step-timeout 5 s" in out, out
    assert "gpu_selfcheck: FAIL (collective on rank 0" in out and "after:" not in out, out
