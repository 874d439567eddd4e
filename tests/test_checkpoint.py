"""Checkpoint saving, loading errors, averaging formulas, and icefall's
--epoch/--iter/--avg/--use-averaged-model selection (shared by decode.py, streaming_decode.py and export_onnx.py)."""

import copy
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from icefall_lite.train.averaging import (
    average_checkpoints,
    average_checkpoints_with_averaged_model,
    checkpoint_suffix,
    load_averaged_weights,
    select_checkpoints,
    update_averaged_model,
)
from icefall_lite.train.checkpoint import (
    CheckpointError,
    atomic_torch_save,
    find_checkpoints,
    load_checkpoint,
    remove_checkpoints,
    save_checkpoint,
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
    with pytest.raises(CheckpointError, match="not an icefall or icefall-lite checkpoint"):
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


# --------------------------------------------------------------------------
# Checkpoint selection (--epoch/--iter/--avg/--use-averaged-model) and averaging arithmetic
# --------------------------------------------------------------------------

# name: ("model" constant, "model_avg" constant, batch_idx_train)
CONSTANT_CKPTS = {
    "epoch-1.pt": (1.0, 0.5, 10),
    "epoch-2.pt": (2.0, 1.5, 25),
    "epoch-3.pt": (4.0, 3.0, 40),
    "epoch-4.pt": (8.0, 7.0, 100),
    "checkpoint-100.pt": (-1.0, 0.25, 100),
    "checkpoint-200.pt": (-2.0, 0.75, 200),
    "checkpoint-300.pt": (-4.0, 2.0, 300),
    "checkpoint-400.pt": (-8.0, 9.0, 400),
}


def _constant_copy(model: nn.Module, value: float, dtype: torch.dtype) -> nn.Module:
    """A copy of ``model`` in ``dtype`` with every floating entry equal to ``value``."""
    out = copy.deepcopy(model).to(dtype)
    for tensor in out.state_dict().values():
        if tensor.dtype.is_floating_point:
            tensor.fill_(value)
    return out


def _floating_values(model: nn.Module) -> torch.Tensor:
    """All floating state entries of ``model`` flattened into one float64 vector."""
    return torch.cat([t.double().flatten() for t in model.state_dict().values() if t.dtype.is_floating_point])


@pytest.fixture(scope="module")
def constant_exp(tmp_path_factory) -> Path:
    """An exp dir whose checkpoints hold constant weights (CONSTANT_CKPTS)."""
    exp_dir = tmp_path_factory.mktemp("constant_exp")
    model = _model(0)
    for name, (value, avg_value, batch) in CONSTANT_CKPTS.items():
        save_checkpoint(
            exp_dir / name,
            _constant_copy(model, value, torch.float32),
            model_avg=_constant_copy(model, avg_value, torch.float64),
            params={"batch_idx_train": batch},
        )
    return exp_dir


def _averaged_formula(start: str, end: str) -> float:
    _, a_start, b_start = CONSTANT_CKPTS[start]
    _, a_end, b_end = CONSTANT_CKPTS[end]
    return (a_end * b_end - a_start * b_start) / (b_end - b_start)


@pytest.mark.parametrize(
    "epoch, iteration, avg, use_averaged, files, expected",
    [
        # averaged model between epoch-(E-A) (excluded) and epoch-E
        (4, 0, 2, True, ["epoch-2.pt", "epoch-4.pt"], _averaged_formula("epoch-2.pt", "epoch-4.pt")),
        (4, 0, 3, True, ["epoch-1.pt", "epoch-4.pt"], _averaged_formula("epoch-1.pt", "epoch-4.pt")),
        (3, 0, 1, True, ["epoch-2.pt", "epoch-3.pt"], _averaged_formula("epoch-2.pt", "epoch-3.pt")),
        # plain mean of the "model" entries of epoch-(E-A+1) .. epoch-E
        (4, 0, 3, False, ["epoch-2.pt", "epoch-3.pt", "epoch-4.pt"], (2.0 + 4.0 + 8.0) / 3),
        (4, 0, 4, False, ["epoch-1.pt", "epoch-2.pt", "epoch-3.pt", "epoch-4.pt"], (1.0 + 2.0 + 4.0 + 8.0) / 4),
        (2, 0, 1, False, ["epoch-2.pt"], 2.0),
        # --iter: checkpoints with batch <= iter, newest first; --epoch is ignored
        (
            99,
            350,
            2,
            True,
            ["checkpoint-100.pt", "checkpoint-300.pt"],
            _averaged_formula("checkpoint-100.pt", "checkpoint-300.pt"),
        ),
        (
            99,
            400,
            1,
            True,
            ["checkpoint-300.pt", "checkpoint-400.pt"],
            _averaged_formula("checkpoint-300.pt", "checkpoint-400.pt"),
        ),
        (99, 350, 2, False, ["checkpoint-300.pt", "checkpoint-200.pt"], (-4.0 - 2.0) / 2),
        (0, 400, 2, False, ["checkpoint-400.pt", "checkpoint-300.pt"], (-8.0 - 4.0) / 2),
    ],
)
def test_checkpoint_selection_and_averaging(constant_exp, epoch, iteration, avg, use_averaged, files, expected):
    model = _model(123)
    plan = load_averaged_weights(
        model,
        constant_exp,
        epoch=epoch,
        iter=iteration,
        avg=avg,
        use_averaged_model=use_averaged,
        device=torch.device("cpu"),
    )
    assert [f.name for f in plan.filenames] == files
    assert plan.averaged_model == use_averaged
    assert plan == select_checkpoints(
        constant_exp, epoch=epoch, iter=iteration, avg=avg, use_averaged_model=use_averaged
    )
    values = _floating_values(model)
    assert torch.allclose(values, torch.full_like(values, expected), rtol=1e-6, atol=0), (values.min(), values.max())


@pytest.mark.parametrize(
    "epoch, iteration, avg, use_averaged, message",
    [
        (
            4,
            0,
            4,
            True,
            "--avg 4 is too large for --epoch 4: --use-averaged-model true averages the model between "
            "epoch-(EPOCH-AVG).pt (excluded) and epoch-4.pt, so --avg must be below --epoch; use --avg 3 "
            "or less, or --use-averaged-model false. Found in {exp}: "
            "epoch-1.pt, epoch-2.pt, epoch-3.pt, epoch-4.pt.",
        ),
        (1, 0, 1, True, "so --avg must be below --epoch; use --use-averaged-model false. Found in"),
        (
            3,
            0,
            5,
            False,
            "--avg 5 is too large for --epoch 3: --use-averaged-model false averages "
            "epoch-(EPOCH-AVG+1).pt .. epoch-3.pt, so --avg must be at most --epoch; use --avg 3 or less.",
        ),
        (
            6,
            0,
            3,
            False,
            "--epoch 6 --avg 3 --use-averaged-model false needs epoch-4.pt, epoch-5.pt, epoch-6.pt in "
            "{exp}; missing: epoch-5.pt, epoch-6.pt. Found: epoch-1.pt, epoch-2.pt, epoch-3.pt, epoch-4.pt.",
        ),
        (5, 0, 2, True, "missing: epoch-5.pt."),
        (
            99,
            350,
            3,
            True,
            "Not enough checkpoints (3) found for --iter 350, --avg 3: --use-averaged-model true needs "
            "4 checkpoint-<batch>.pt files with batch <= 350 in {exp}. Found: checkpoint-400.pt, "
            "checkpoint-300.pt, checkpoint-200.pt, checkpoint-100.pt.",
        ),
        (99, 50, 1, False, "Not enough checkpoints (0) found for --iter 50, --avg 1"),
    ],
)
def test_too_few_checkpoints_name_the_files(constant_exp, epoch, iteration, avg, use_averaged, message):
    with pytest.raises(CheckpointError) as exc:
        select_checkpoints(constant_exp, epoch=epoch, iter=iteration, avg=avg, use_averaged_model=use_averaged)
    assert message.format(exp=constant_exp) in str(exc.value)


def test_empty_exp_dir_says_no_files(tmp_path):
    with pytest.raises(CheckpointError, match=r"Found in .*: no epoch-\*\.pt files\."):
        select_checkpoints(tmp_path, epoch=1, avg=2, use_averaged_model=False)
    with pytest.raises(CheckpointError, match=r"Found: no checkpoint-\*\.pt files\."):
        select_checkpoints(tmp_path, epoch=1, iter=10, avg=1, use_averaged_model=False)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(epoch=3, avg=0), "--avg must be >= 1, got 0"),
        (dict(epoch=3, iter=-1, avg=1), "--iter must be >= 0, got -1"),
        (dict(epoch=0, avg=1), "--epoch must be >= 1, got 0"),
    ],
)
def test_selection_rejects_bad_numbers(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        select_checkpoints(tmp_path, use_averaged_model=False, **kwargs)


def test_loading_into_another_model_size_lists_mismatched_shapes(constant_exp):
    with pytest.raises(CheckpointError) as exc:
        load_averaged_weights(
            _model(0, hidden=5), constant_exp, epoch=4, avg=2, use_averaged_model=True, device=torch.device("cpu")
        )
    text = str(exc.value)
    assert text.startswith(
        f"the averaged model from {constant_exp}/epoch-2.pt (excluded) to {constant_exp}/epoch-4.pt does not fit "
        "this model (were the model-size flags the same as in training?)."
    )
    assert "0.weight: checkpoint (3, 2) vs model (5, 2)" in text


def test_averaging_checkpoints_of_different_models_is_a_clear_error(tmp_path):
    save_checkpoint(tmp_path / "epoch-1.pt", _model(0, hidden=3))
    save_checkpoint(tmp_path / "epoch-2.pt", _model(0, hidden=4))
    with pytest.raises(
        CheckpointError,
        match=r"Cannot average .*epoch-1\.pt, .*epoch-2\.pt: they do not come from the "
        r"same model \(RuntimeError",
    ):
        load_averaged_weights(_model(0), tmp_path, epoch=2, avg=2, use_averaged_model=False, device=torch.device("cpu"))


def test_checkpoint_suffix_and_describe(constant_exp):
    assert checkpoint_suffix(10, 0, 3) == "epoch-10-avg-3"
    assert checkpoint_suffix(10, 350, 3) == "iter-350-avg-3"
    plan = select_checkpoints(constant_exp, epoch=4, avg=2, use_averaged_model=False)
    assert plan.describe() == f"the average of {constant_exp}/epoch-3.pt, {constant_exp}/epoch-4.pt"


def test_demo_trains_and_decodes_the_recipe_defaults() -> None:
    """demo.sh trains NUM_EPOCHS epochs into EXP_DIR and decodes --avg AVG (recipe_defaults.py's facts)."""
    import re

    from icefall_lite.recipe_defaults import AVG, EXP_DIR, NUM_EPOCHS

    demo = (Path(__file__).resolve().parents[1] / "egs/librispeech/ASR/demo.sh").read_text()
    assert re.search(r"^num_epochs=(\d+)", demo, re.M).group(1) == str(NUM_EPOCHS)
    assert re.search(r"^avg=(\d+)", demo, re.M).group(1) == str(AVG)
    assert re.search(r"^exp_dir=(\S+)", demo, re.M).group(1) == str(EXP_DIR)
