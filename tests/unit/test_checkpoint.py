"""Per-rank checkpoints (train/checkpoint.py) in one process: a real save and load of a
model, an Adam optimizer, an LR scheduler and every RNG; what is fsynced before the
tracker moves; and the clear error for a truncated file and for a planted one (which
must not run). Multi-rank save / resume is covered by tests/e2e/test_train.py."""
from __future__ import annotations

import os
import pickle
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_rrfp.train import checkpoint

LAYOUT = {"world_size": 1, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}


@pytest.fixture
def one_rank(monkeypatch):
    """checkpoint's collectives on a single rank, without a process group."""
    monkeypatch.setattr(checkpoint, "dist", SimpleNamespace(get_rank=lambda: 0, barrier=lambda: None))


def _training_state(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def _save(directory, iteration=6, **state):
    return checkpoint.save(str(directory), iteration=iteration, consumed_samples=48, layout=LAYOUT, **state)


def test_save_then_load_restores_everything_with_weights_only_loading(tmp_path, one_rank):
    model, optimizer, scheduler = _training_state(seed=1)
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    _save(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())

    other_model, other_optimizer, other_scheduler = _training_state(seed=2)
    resumed = checkpoint.load(str(tmp_path), iteration=None, model=other_model, optimizer=other_optimizer,
                              scheduler=other_scheduler, layout=LAYOUT)
    assert (resumed.iteration, resumed.consumed_samples) == (6, 48)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other_model.state_dict().values()))
    exp_avg = [o.state_dict()["state"][0]["exp_avg"] for o in (optimizer, other_optimizer)]
    assert torch.equal(*exp_avg)
    assert other_scheduler.state_dict() == scheduler.state_dict()
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    assert torch.serialization.get_unsafe_globals_in_checkpoint(resumed.path) == []  # plain values and tensors


def test_the_file_and_its_directory_are_fsynced_before_the_tracker_moves(tmp_path, one_rank, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", os.path.basename(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "fsync", fsync)
    monkeypatch.setattr(checkpoint.os, "replace", replace)
    model, optimizer, scheduler = _training_state(seed=1)
    _save(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler)
    assert events == [
        ("fsync", "rank_00000.pt.tmp"), ("rename", "rank_00000.pt"), ("fsync", "iter_0000006"),  # the rank's file
        ("fsync", tmp_path.name),  # the iteration directory's entry
        ("fsync", checkpoint.TRACKER + ".tmp"), ("rename", checkpoint.TRACKER), ("fsync", tmp_path.name),
    ], events


def test_a_truncated_checkpoint_is_a_clear_error(tmp_path, one_rank):
    model, optimizer, scheduler = _training_state(seed=1)
    path = os.path.join(_save(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler), "rank_00000.pt")
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) // 2)
    with pytest.raises(ValueError, match=r"rank_00000.pt cannot be loaded \(.*\): it is truncated or corrupt") as info:
        checkpoint.load(str(tmp_path), iteration=6, model=model, optimizer=optimizer, scheduler=scheduler,
                        layout=LAYOUT)
    assert "--load-iteration N" in str(info.value) and "\n" not in str(info.value)


class _Planted:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


# torch's note on the bare pickle below (protocol 4), just before the load refuses it
@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
def test_a_planted_checkpoint_runs_no_code_and_is_a_clear_error(tmp_path, one_rank):
    model, optimizer, scheduler = _training_state(seed=1)
    directory = _save(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler)
    marker = tmp_path / "code-ran"
    torch.save({"model": _Planted(str(marker))}, os.path.join(directory, "rank_00000.pt"), pickle_protocol=2)
    with pytest.raises(ValueError, match="GLOBAL posix.system") as info:
        checkpoint.load(str(tmp_path), iteration=6, model=model, optimizer=optimizer, scheduler=scheduler,
                        layout=LAYOUT)
    assert "never code" in str(info.value)
    assert not marker.exists()
    with open(os.path.join(directory, "rank_00000.pt"), "wb") as handle:  # a bare pickle, not a torch file
        pickle.dump({"weights": [1, 2]}, handle)
    with pytest.raises(ValueError, match="cannot be loaded"):
        checkpoint.load(str(tmp_path), iteration=6, model=model, optimizer=optimizer, scheduler=scheduler,
                        layout=LAYOUT)


def test_a_foreign_tensor_file_and_a_garbled_tracker_are_clear_errors(tmp_path, one_rank):
    model, optimizer, scheduler = _training_state(seed=1)
    directory = _save(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler)
    torch.save({"weight": torch.zeros(2)}, os.path.join(directory, "rank_00000.pt"))
    with pytest.raises(ValueError, match="not a megatron-rrfp train checkpoint \\(missing iteration"):
        checkpoint.load(str(tmp_path), iteration=6, model=model, optimizer=optimizer, scheduler=scheduler,
                        layout=LAYOUT)
    (tmp_path / checkpoint.TRACKER).write_text("six\n")
    with pytest.raises(ValueError, match="holds 'six', not an iteration number"):
        checkpoint.latest_iteration(str(tmp_path))


def test_a_resume_with_another_hybrid_pattern_is_refused_in_one_line(tmp_path, one_rank):
    """The layout record holds --hybrid-layer-pattern (--model hybrid only, so a GPT
    checkpoint's record is unchanged); another pattern is refused before anything loads."""
    from megatron_rrfp.train.config import TrainConfig
    from megatron_rrfp.train.driver import checkpoint_layout

    hybrid = checkpoint_layout(TrainConfig(model="hybrid", hybrid_layer_pattern="*-|*-", num_layers=4), 2)
    assert hybrid["hybrid_layer_pattern"] == "*-|*-"
    assert "hybrid_layer_pattern" not in checkpoint_layout(TrainConfig(), 2)
    model, optimizer, scheduler = _training_state(seed=1)
    checkpoint.save(str(tmp_path), iteration=2, consumed_samples=16, layout={**LAYOUT, "hybrid_layer_pattern": "*-|*-"},
                    model=model, optimizer=optimizer, scheduler=scheduler)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    with pytest.raises(ValueError) as refused:
        checkpoint.load(str(tmp_path), iteration=None, model=model, optimizer=optimizer, scheduler=scheduler,
                        layout={**LAYOUT, "hybrid_layer_pattern": "**|--"})
    message = str(refused.value)
    assert "\n" not in message and "--hybrid-layer-pattern '*-|*-', this run has '**|--'" in message, message
    assert all(not p.any() for p in model.parameters())  # nothing loaded
    resumed = checkpoint.load(str(tmp_path), iteration=None, model=model, optimizer=optimizer, scheduler=scheduler,
                              layout={**LAYOUT, "hybrid_layer_pattern": "*-|*-"})
    assert resumed.iteration == 2 and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
