"""--use-fp16's loss scale in the training loop, on the CPU with a GradScaler (the CUDA run is make
gpu-check's check 2): the filter statistics are reported in unscaled gradient units, and an overflow is the
scaler's back-off, counted as such, not a skipped step."""

import argparse

import torch

from benchmarks.train_setup import TokenTable, Trainer, add_batch_arguments, make_batches
from icefall_lite.train.loop import filter_stats
from icefall_lite.train.step import train_step

SMALL = ["--num-encoder-layers", "2", "--encoder-dim", "32", "--rnn-hidden-size", "64", "--dim-feedforward", "64"]


def _batch(tokens: TokenTable):
    parser = argparse.ArgumentParser()
    add_batch_arguments(parser)
    args = parser.parse_args(["--max-duration", "12", "--vocab-size", "50", "--num-batches", "1"])
    return make_batches(args, tokens)[0].data


def test_filter_statistics_under_a_loss_scale_are_in_unscaled_units() -> None:
    tokens = TokenTable()
    batch = _batch(tokens)
    stats = {}
    for scale in (1.0, 1024.0):
        trainer = Trainer(SMALL, vocab_size=50, seed=0)
        scaler = torch.amp.GradScaler("cpu", init_scale=scale) if scale != 1.0 else None
        t = trainer.training(tokens, scaler=scaler)
        train_step(t, batch)
        stats[scale] = filter_stats(trainer.model, t.loss_scale)
    assert len(stats[1.0]) == 2
    for plain, scaled in zip(stats[1.0], stats[1024.0]):
        # A power-of-two loss scale multiplies every gradient exactly: the unscaled median is the plain one.
        torch.testing.assert_close(scaled.median_norm, plain.median_norm, rtol=1e-6, atol=0)
        assert float(plain.median_norm) > 0
        for name in ("max_over_median", "fraction_filtered", "param_scale"):
            torch.testing.assert_close(getattr(scaled, name), getattr(plain, name), rtol=1e-6, atol=0)
    # What the filters themselves saw (the last model's): the loss-scaled gradients.
    raw = [f.stats.median_norm for _, f in trainer.model.encoder.gradient_filters()]
    for r, plain in zip(raw, stats[1.0]):
        torch.testing.assert_close(r, 1024.0 * plain.median_norm, rtol=1e-6, atol=0)


def test_an_overflow_is_a_scaler_back_off_not_a_skipped_step() -> None:
    tokens = TokenTable()
    batch = _batch(tokens)
    trainer = Trainer(SMALL, vocab_size=50, seed=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    t = trainer.training(tokens, scaler=scaler)
    train_step(t, batch)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    handle = trainer.model.joiner.output_linear.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    trainer.params.batch_idx_train += 1
    _, grad_norm, _ = train_step(t, batch)
    handle.remove()
    assert grad_norm == float("inf")
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert scaler.get_scale() == 128.0
    t.flush_log()  # the step's back-off, decided on the device, counted at the log interval
    assert trainer.params.scaler_backoffs == 1 and trainer.params.skipped_steps == 0
    trainer.params.batch_idx_train += 1
    train_step(t, batch)
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_the_back_off_count_is_training_progress_kept_through_a_resume(tmp_path) -> None:
    from icefall_lite.train.checkpoint import save_checkpoint
    from icefall_lite.train.resume import Resumption
    from icefall_lite.utils import AttributeDict

    trainer = Trainer(SMALL, vocab_size=50, seed=0)
    trainer.params.update(scaler_backoffs=3, cur_epoch=1, batch_idx_in_epoch=7, batch_idx_train=7)
    save_checkpoint(tmp_path / "checkpoint-7.pt", trainer.model, params=trainer.params)
    params = AttributeDict(exp_dir=tmp_path, start_batch=0, start_epoch=1, scaler_backoffs=0, batch_idx_train=0)
    assert Resumption.load(params, Trainer(SMALL, vocab_size=50, seed=1).model, None, rank=0) is not None
    assert params.scaler_backoffs == 3 and params.batch_idx_train == 7
