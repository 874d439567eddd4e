"""The encoder's subsampling factor (``--subsampling-factor``, 4 as icefall or 6): frame counts and receptive
field checked by brute force, the flag's validation, and checkpoints of one factor refused by a model of
another (the factor changes no parameter shape, so nothing else would notice)."""

import argparse
import copy
from pathlib import Path

import pytest
import torch

from conftest import tiny_transducer
from icefall_lite.data.corrupt import CorruptionConfig, CorruptionError
from icefall_lite.nn.encoder import Conv2dSubsampling, subsampled_length, subsampling_extra_frames
from icefall_lite.nn.model import MODEL_PRESETS, add_model_arguments, model_config_from_args
from icefall_lite.train.averaging import load_weights_from_flags
from icefall_lite.train.checkpoint import CheckpointError, save_checkpoint
from icefall_lite.train.resume import init_from_weights

FACTORS = (4, 6)


def _dependencies(subsampling: Conv2dSubsampling, num_frames: int) -> list:
    """For every output frame, the set of input frames whose change changes it (brute force)."""
    torch.manual_seed(0)
    x = torch.randn(1, num_frames, 80)
    with torch.no_grad():
        base = subsampling(x)
        deps = [set() for _ in range(base.size(1))]
        for j in range(num_frames):
            moved = x.clone()
            moved[0, j] += 10.0
            changed = (subsampling(moved) - base).abs().amax(dim=-1)[0] > 0
            for p in torch.nonzero(changed).flatten().tolist():
                deps[p].add(j)
    return deps


@pytest.mark.parametrize("factor", FACTORS)
def test_output_frames_and_receptive_field_by_brute_force(factor):
    torch.manual_seed(0)
    subsampling = Conv2dSubsampling(80, 16, factor).eval()
    num_frames = 47
    deps = _dependencies(subsampling, num_frames)
    assert len(deps) == int(subsampled_length(torch.tensor(num_frames), factor))
    extra = subsampling_extra_frames(factor)
    assert extra == 5  # worked by hand: 3 + 2 * s1 + 2 * s1 * s2 - f, 9 - 4 and 11 - 6
    for p, frames in enumerate(deps):
        assert frames == set(range(factor * p, factor * p + factor + extra)), p
    # Every frame count from the first that gives one frame (9 at 4x, 11 at 6x): the formula is the
    # convolutions' output length.
    shortest = factor + extra
    assert int(subsampled_length(torch.tensor(shortest - 1), factor)) == 0
    for t in range(shortest, 60):
        got = subsampling(torch.randn(1, t, 80)).size(1)
        assert got == int(subsampled_length(torch.tensor(t), factor)), t
    assert len(deps) * factor <= num_frames < (len(deps) + 2) * factor


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    return parser.parse_args(list(flags))


def test_the_flag_overrides_the_preset_and_is_validated():
    config = model_config_from_args(_args(), vocab_size=10, blank_id=0, num_features=80)
    assert config["subsampling_factor"] == MODEL_PRESETS["cpu"]["subsampling_factor"]
    assert MODEL_PRESETS["icefall"]["subsampling_factor"] == 4  # icefall's Conv2dSubsampling
    for factor in FACTORS:
        args = _args("--subsampling-factor", str(factor))
        assert model_config_from_args(args, vocab_size=10, blank_id=0, num_features=80)["subsampling_factor"] == factor
    with pytest.raises(ValueError, match=r"--subsampling-factor must be one of \[4, 6\], got 8"):
        model_config_from_args(_args("--subsampling-factor", "8"), vocab_size=10, blank_id=0, num_features=80)
    with pytest.raises(CorruptionError, match="subsampling factor must be one of"):
        CorruptionConfig(subsampling_factor=5).validate()


def test_a_checkpoint_of_another_factor_is_refused(tmp_path: Path):
    model4 = tiny_transducer(subsampling_factor=4)
    model6 = tiny_transducer(subsampling_factor=6)
    exp = tmp_path / "exp"
    exp.mkdir()
    for epoch in (1, 2):
        save_checkpoint(
            exp / f"epoch-{epoch}.pt",
            model4,
            model_avg=copy.deepcopy(model4).double(),
            params={"subsampling_factor": 4, "batch_idx_train": 10 * epoch},
        )
    flags = dict(checkpoint=None, exp_dir=exp, epoch=2, iter=0, avg=1, use_averaged_model=True)
    with pytest.raises(CheckpointError, match=r"epoch-2\.pt was trained with subsampling factor 4, .* by 6: "):
        load_weights_from_flags(model6, flags, torch.device("cpu"))
    with pytest.raises(CheckpointError, match="--subsampling-factor 4"):
        load_weights_from_flags(model6, {**flags, "checkpoint": exp / "epoch-1.pt"}, torch.device("cpu"))
    with pytest.raises(CheckpointError, match="--init-from .*epoch-1.pt was trained with subsampling factor 4"):
        init_from_weights(exp / "epoch-1.pt", model6, None)
    # The same factor loads; a bare {"model": ...} (icefall's pretrained.pt) has no factor to check.
    load_weights_from_flags(tiny_transducer(subsampling_factor=4), flags, torch.device("cpu"))
    torch.save({"model": model4.state_dict()}, tmp_path / "pretrained.pt")
    load_weights_from_flags(model6, {**flags, "checkpoint": tmp_path / "pretrained.pt"}, torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(model6.state_dict().values(), model4.state_dict().values()))
