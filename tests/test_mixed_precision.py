"""--use-bf16: the training step runs its matrix products in bfloat16 under autocast on the training
device, while weights, gradients and the optimizer state stay float32 and the losses are float32; the loss
at the same weights is close to the float32 one but not bit-equal (autocast is really on). Flags that
exclude each other are refused."""

import argparse

import pytest
import torch

from benchmarks.train_setup import Batch, TokenTable, Trainer, add_batch_arguments, make_batches
from conftest import TINY_MODEL
from icefall_lite.train.args import add_training_arguments, check_training_args
from icefall_lite.train.step import mixed_precision


def _batch(tokens: TokenTable) -> Batch:
    parser = argparse.ArgumentParser()
    add_batch_arguments(parser)
    args = parser.parse_args(["--max-duration", "12", "--num-batches", "1", "--vocab-size", "50"])
    return make_batches(args, tokens, seed=3)[0]


def _forward(trainer: Trainer, batch: Batch, tokens: TokenTable):
    """The model's losses on ``batch`` under the step's autocast, and the dtype of the simple-loss projection."""
    seen = []
    handle = trainer.model.simple_am_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    try:
        with mixed_precision(trainer.params, torch.device("cpu")):
            simple, pruned, _, _ = trainer.model(
                batch.data["inputs"],
                batch.data["supervisions"]["num_frames"],
                [tokens.ids[t] for t in batch.data["supervisions"]["text"]],
            )
    finally:
        handle.remove()
    return simple.detach(), pruned.detach(), seen


def test_bf16_step_keeps_float32_state_and_is_close_to_float32():
    tokens = TokenTable()
    batch = _batch(tokens)
    trainers = {
        "fp32": Trainer(TINY_MODEL, vocab_size=50, seed=1),
        "bf16": Trainer([*TINY_MODEL, "--use-bf16", "true"], vocab_size=50, seed=1),
    }
    losses = {}
    for name, trainer in trainers.items():
        simple, pruned, dtypes = _forward(trainer, batch, tokens)
        assert dtypes == [torch.bfloat16 if name == "bf16" else torch.float32]
        assert simple.dtype == pruned.dtype == torch.float32, "the loss recursions run in float32"
        losses[name] = float(simple.sum() + pruned.sum())
        trainer.step(batch, tokens)
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
        states = [s for s in trainer.optimizer.state.values() if "exp_avg_sq" in s]
        assert states and all(s["exp_avg_sq"].dtype == torch.float32 for s in states)
        assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert losses["bf16"] != losses["fp32"], "autocast was not on"
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=3e-2)


def test_fp16_and_bf16_exclude_each_other(capsys):
    parser = argparse.ArgumentParser()
    add_training_arguments(parser)
    args = parser.parse_args(["--use-fp16", "true", "--use-bf16", "true"])
    with pytest.raises(SystemExit):
        check_training_args(parser, args)
    assert "--use-fp16 and --use-bf16 exclude each other" in capsys.readouterr().err
