"""Checkpoint saving, loading errors and averaging formulas."""

import pytest
import torch
import torch.nn as nn

from icefall_lite.checkpoint import (
    CheckpointError,
    atomic_torch_save,
    average_checkpoints,
    average_checkpoints_with_averaged_model,
    find_checkpoints,
    load_checkpoint,
    remove_checkpoints,
    save_checkpoint,
    update_averaged_model,
)


def _model(seed: int, hidden: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, hidden), nn.Linear(hidden, 1))


def test_save_load_roundtrip(tmp_path):
    model = _model(0)
    save_checkpoint(tmp_path / "a.pt", model, params={"batch_idx_train": 7, "cur_epoch": 2})
    other = _model(1)
    ckpt = load_checkpoint(tmp_path / "a.pt", other)
    assert ckpt["batch_idx_train"] == 7
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    assert [p.name for p in tmp_path.iterdir()] == ["a.pt"]  # no temp file left


def test_truncated_checkpoint_gives_clear_error(tmp_path):
    save_checkpoint(tmp_path / "a.pt", _model(0))
    data = (tmp_path / "a.pt").read_bytes()
    (tmp_path / "b.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"b\.pt cannot be read.*truncated"):
        load_checkpoint(tmp_path / "b.pt", _model(0))


def test_foreign_and_missing_checkpoint(tmp_path):
    torch.save({"state_dict": {}}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="not an icefall-lite checkpoint"):
        load_checkpoint(tmp_path / "foreign.pt", _model(0))
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.pt", _model(0))


def test_other_model_size_lists_mismatched_shapes(tmp_path):
    save_checkpoint(tmp_path / "a.pt", _model(0, hidden=4))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "a.pt", _model(0, hidden=3))
    msg = str(e.value)
    assert "0.weight: checkpoint (4, 2) vs model (3, 2)" in msg
    assert "1.weight: checkpoint (1, 4) vs model (1, 3)" in msg


def test_atomic_save_failure_leaves_no_file(tmp_path):
    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        atomic_torch_save({"x": Unpicklable()}, tmp_path / "c.pt")
    assert list(tmp_path.iterdir()) == []


def test_find_and_remove_checkpoints(tmp_path):
    for b in (10, 200, 30):
        save_checkpoint(tmp_path / f"checkpoint-{b}.pt", _model(0))
    (tmp_path / "epoch-1.pt").write_bytes(b"")
    assert [p.name for p in find_checkpoints(tmp_path)] == ["checkpoint-200.pt", "checkpoint-30.pt", "checkpoint-10.pt"]
    remove_checkpoints(tmp_path, keep_last_k=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-200.pt", "checkpoint-30.pt", "epoch-1.pt"]


def test_running_average_equals_mean_and_range_formula(tmp_path):
    """model_avg updated every `period` batches is the mean of the snapshots; the
    range formula recovers the mean over the snapshots between two checkpoints."""
    period = 2
    model = nn.Linear(1, 1, bias=False)
    model_avg = nn.Linear(1, 1, bias=False).double()
    snapshots = []
    for b in range(1, 9):
        with torch.no_grad():
            model.weight.fill_(float(b * b))
        if b % period == 0:
            snapshots.append(float(b * b))
            if b == period:
                model_avg.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
            else:
                update_averaged_model(period, b, model, model_avg)
        if b in (4, 8):
            save_checkpoint(tmp_path / f"checkpoint-{b}.pt", model, model_avg, params={"batch_idx_train": b})
    assert float(model_avg.weight) == pytest.approx(sum(snapshots) / len(snapshots))
    avg = average_checkpoints_with_averaged_model(tmp_path / "checkpoint-4.pt", tmp_path / "checkpoint-8.pt")
    # snapshots at b = 6, 8: 36 and 64
    assert float(avg["weight"]) == pytest.approx((36 + 64) / 2)
    plain = average_checkpoints([tmp_path / "checkpoint-4.pt", tmp_path / "checkpoint-8.pt"])
    assert float(plain["weight"]) == pytest.approx((16 + 64) / 2)
