"""train.py end to end on the tiny corpus: resume equals an uninterrupted run, DDP ranks
agree, non-finite batches are skipped, bad checkpoints and flags give clear errors."""

import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

from conftest import (
    TINY_MODEL,
    TRAIN,
    assert_flag_error,
    batch_losses,
    free_port,
    run_train,
    tiny_transducer,
    train_env,
)
from icefall_lite.nn.model import build_transducer
from icefall_lite.train.checkpoint import load_checkpoint_file
from icefall_lite.train.cli import get_params, get_parser, parse_args, validate_args
from icefall_lite.train.grad_control import GradientControl
from icefall_lite.train.loss import compute_loss, loss_scales, pruned_loss_scale
from icefall_lite.train.optim import Eden, Eve
from icefall_lite.train.presets import ICEFALL_PRESET
from icefall_lite.train.setup import training_model_config
from icefall_lite.train.step import train_step
from icefall_lite.train.training import Training


@pytest.fixture(scope="module")
def three_batches(tiny_data, tmp_path_factory) -> Path:
    """An exp dir of train.py --max-batches 3 --save-every-n 3 (checkpoint-3.pt), shared read-only: a test
    that trains on in it works on a copy (:func:`copy_of`)."""
    exp = tmp_path_factory.mktemp("three_batches") / "exp"
    first = run_train(tiny_data, exp, "--max-batches", "3", "--save-every-n", "3")
    assert first.returncode == 0, first.stderr
    assert sorted(p.name for p in exp.glob("*.pt")) == ["checkpoint-3.pt"]
    return exp


def copy_of(exp: Path, to: Path) -> Path:
    shutil.copytree(exp, to)
    return to


def test_resumed_at_the_end_of_the_budget_validates_without_training(tiny_data, three_batches, tmp_path):
    """A run killed after saving its last checkpoint but before the final validation: the rerun takes no step."""
    copy_of(three_batches, tmp_path / "exp")
    trained = load_checkpoint_file(tmp_path / "exp" / "checkpoint-3.pt")
    again = run_train(tiny_data, tmp_path / "exp", "--max-batches", "3", "--save-every-n", "3")
    assert again.returncode == 0, again.stderr
    assert "Global batch 3: the --max-batches/--max-minutes budget is spent" in again.stderr
    assert re.search(r"Stopped by --max-batches 3 .* at global batch 3 .*validation: loss=", again.stderr)
    assert sorted(p.name for p in (tmp_path / "exp").glob("checkpoint-*.pt")) == ["checkpoint-3.pt"]
    after = load_checkpoint_file(tmp_path / "exp" / "checkpoint-3.pt")
    for name, value in trained["model"].items():
        assert torch.equal(value, after["model"][name]), name


def test_init_from_starts_a_new_run_from_the_weights_of_a_checkpoint(tiny_data, three_batches, tmp_path):
    source = three_batches / "checkpoint-3.pt"
    # A learning rate of 1e-12 leaves the weights where --init-from put them, but for Eve's weight decay
    # (a shrink by 1e-3 of the larger tensors, not scaled by the learning rate, as icefall's).
    second = run_train(
        tiny_data,
        tmp_path / "second",
        "--max-batches",
        "1",
        "--save-every-n",
        "1",
        "--base-lr",
        "1e-12",
        "--init-from",
        str(source),
    )
    assert second.returncode == 0, second.stderr
    assert f"Initialised the model from the weights of {source} (trained 3 batches)" in second.stderr
    trained = load_checkpoint_file(source)
    started = load_checkpoint_file(tmp_path / "second" / "checkpoint-1.pt")
    assert started["batch_idx_train"] == 1  # counters start afresh
    for name, value in trained["model"].items():
        if value.is_floating_point():
            torch.testing.assert_close(started["model"][name], value, rtol=1.001e-3, atol=1e-9, msg=name)
            torch.testing.assert_close(started["model_avg"][name], value.double(), rtol=1.001e-3, atol=1e-9, msg=name)
    # Its own checkpoints win over --init-from on a rerun.
    again = run_train(
        tiny_data,
        tmp_path / "second",
        "--max-batches",
        "2",
        "--save-every-n",
        "1",
        "--base-lr",
        "1e-12",
        "--init-from",
        str(source),
    )
    assert again.returncode == 0, again.stderr
    assert "Loading checkpoint" in again.stderr and "Initialised" not in again.stderr


def test_init_from_a_checkpoint_of_another_model_size_gives_clear_error(tiny_data, three_batches, tmp_path):
    other = ["--encoder-dim", "24"] + TINY_MODEL[2:]
    args = [
        sys.executable,
        str(TRAIN),
        "--exp-dir",
        str(tmp_path / "other"),
        "--bpe-model",
        "data/lang_bpe_100/bpe.model",
        "--max-duration",
        "30",
        "--num-workers",
        "0",
        "--num-epochs",
        "1",
        "--tensorboard",
        "false",
        *other,
        "--init-from",
        str(three_batches / "checkpoint-3.pt"),
    ]
    proc = subprocess.run(args, cwd=tiny_data, capture_output=True, text=True, env=train_env(), timeout=600)
    assert proc.returncode != 0
    assert "--init-from" in proc.stderr and "does not fit this model" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_resume_equals_uninterrupted_run(tiny_data, three_batches, six_batches, tmp_path):
    """Batches 4-6 resumed from checkpoint-3.pt equal the uninterrupted run's (which saved after every batch:
    saving does not change the training either)."""
    copy_of(three_batches, tmp_path / "resumed")  # the first 3 batches, run on their own
    assert not (tmp_path / "resumed" / "checkpoint-6.pt").exists()
    second = run_train(tiny_data, tmp_path / "resumed", "--max-batches", "6", "--save-every-n", "3")
    assert second.returncode == 0, second.stderr
    assert "Loading checkpoint" in second.stderr and "checkpoint-3.pt" in second.stderr

    losses_full = batch_losses(six_batches)
    losses_resumed = batch_losses(tmp_path / "resumed")
    assert sorted(losses_full) == [1, 2, 3, 4, 5, 6]
    for b in (4, 5, 6):
        assert losses_resumed[b] == losses_full[b], b
    a = load_checkpoint_file(six_batches / "checkpoint-6.pt")
    b = load_checkpoint_file(tmp_path / "resumed" / "checkpoint-6.pt")
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name
    for name, value in a["model_avg"].items():
        assert torch.equal(value, b["model_avg"][name]), name


def test_ddp_two_processes_keep_identical_weights(tiny_data, tmp_path):
    proc = run_train(
        tiny_data,
        tmp_path / "ddp",
        "--world-size",
        "2",
        "--max-batches",
        "2",
        "--save-every-n",
        "0",
        "--master-port",
        str(free_port()),
    )
    assert proc.returncode == 0, proc.stderr
    logs = sorted((tmp_path / "ddp" / "log").glob("log-train-*"))
    assert len(logs) == 2
    checksums = {}
    for log in logs:
        m = re.search(r"Model checksum \(rank (\d)\): ([0-9a-f]{64})", log.read_text())
        assert m, log.read_text()[-2000:]
        checksums[int(m.group(1))] = m.group(2)
    assert set(checksums) == {0, 1}
    assert checksums[0] == checksums[1]


def _params_and_model(tiny_data: Path, *extra: str):
    parser = get_parser()
    args = parser.parse_args(["--bpe-model", str(tiny_data / "data/lang_bpe_100/bpe.model"), *TINY_MODEL, *extra])
    params = get_params()
    params.update(vars(args))
    sp = spm.SentencePieceProcessor()
    sp.load(params.bpe_model)
    config = training_model_config(args, vocab_size=sp.get_piece_size(), blank_id=0)
    torch.manual_seed(0)
    model = build_transducer(**config)
    optimizer = Eve(model.parameters(), lr=params.base_lr)
    scheduler = Eden(optimizer, params.lr_batches, params.lr_epochs)
    return params, model, optimizer, scheduler, sp


def _batch(nan_rows=()):
    gen = torch.Generator().manual_seed(3)
    inputs = torch.randn(3, 120, 80, generator=gen)
    for r in nan_rows:
        inputs[r, 10:20] = float("nan")
    return {
        "inputs": inputs,
        "supervisions": {"text": ["HELLO THERE", "A CAT", "THE END"], "num_frames": torch.tensor([120, 100, 90])},
    }


@pytest.mark.parametrize("nan_rows", [(1,), (0, 1, 2)])
def test_nonfinite_batch_is_skipped_and_weights_stay_finite(tiny_data, nan_rows):
    params, model, optimizer, scheduler, sp = _params_and_model(tiny_data)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params.batch_idx_train = 1
    control = GradientControl.from_params(params)
    training = Training(
        params=params, model=model, optimizer=optimizer, scheduler=scheduler, grad_control=control, sp=sp
    )
    info, grad_norm, _ = train_step(training, _batch(nan_rows))
    training.flush_log()  # the device's count of skipped steps into params
    assert params.skipped_steps == 1
    assert params.skipped_utterances == len(nan_rows)
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all(), n
        assert torch.equal(p, before[n]), n
    # A clean batch afterwards trains normally.
    params.batch_idx_train = 2
    train_step(training, _batch())
    training.flush_log()
    assert params.skipped_steps == 1
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("clip_type", ["norm", "value", "adaptive"])
def test_clip_gradients_reports_preclip_norm(tiny_data, clip_type):
    flag = {"norm": "--clip-grad-norm", "value": "--clip-grad-value", "adaptive": "--agc-clipping"}[clip_type]
    others = [f for f in ("--clip-grad-norm", "--clip-grad-value", "--agc-clipping") if f != flag]
    params, model, *_ = _params_and_model(tiny_data, flag, "0.01", *(x for f in others for x in (f, "0")))
    s, p, _, _ = model(_batch()["inputs"], torch.tensor([120, 100, 90]), [[5, 6], [7], [8, 9, 10]], warmup=3.0)
    (s.sum() + p.sum()).backward()
    grads = {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
    expected = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
    norm, scale = map(float, GradientControl.from_params(params).clip(model))
    assert norm == pytest.approx(expected, rel=1e-5)
    after = math.sqrt(sum(float(q.grad.double().square().sum()) for q in model.parameters() if q.grad is not None))
    assert scale == pytest.approx(after / expected, rel=1e-5)
    assert scale < 1.0
    if clip_type == "value":
        assert max(float(q.grad.abs().max()) for q in model.parameters() if q.grad is not None) <= 0.01
    if clip_type == "adaptive":
        # The final classifier layer is left unclipped, as the AGC paper does.
        assert torch.equal(model.joiner.output_linear.weight.grad, grads["joiner.output_linear.weight"])


def test_truncated_checkpoint_gives_clear_error(tiny_data, tmp_path):
    exp = tmp_path / "exp"
    exp.mkdir()
    (exp / "checkpoint-5.pt").write_bytes(b"PK\x03\x04 truncated")
    proc = run_train(tiny_data, exp, "--start-batch", "5")
    assert proc.returncode != 0
    assert "checkpoint-5.pt cannot be read" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_print_diagnostics_prints_and_exits(tiny_data, tmp_path):
    proc = run_train(tiny_data, tmp_path / "diag", "--print-diagnostics", "true")
    assert proc.returncode == 0, proc.stderr
    assert "module output statistics" in proc.stderr
    assert "encoder.encoder.layers.0.lstm: value rms=" in proc.stderr
    assert "Diagnostics printed; exiting" in proc.stderr
    assert not list((tmp_path / "diag").glob("epoch-*.pt"))


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--start-epoch", "5", "--num-epochs", "2"], "--start-epoch"),
        (["--clip-grad-norm", "-1"], "--clip-grad-norm"),
        (["--grad-filter-threshold", "-2"], "--grad-filter-threshold"),
        (["--clip-grad-value", "-1"], "--clip-grad-value"),
        (["--agc-clipping", "nan"], "--agc-clipping"),
        (["--error-clip", "-1"], "--error-clip"),
        (["--max-duration", "0"], "--max-duration"),
        (["--model-warm-step", "0"], "--model-warm-step"),
        (["--bpe-model", "/nonexistent/bpe.model"], "--bpe-model"),
        (["--dropout", "1.0"], "--dropout"),
        (["--layer-dropout", "-0.1"], "--layer-dropout"),
        (["--ctc-loss-scale", "-1"], "--ctc-loss-scale"),
        (["--tail-pad-frames", "-5"], "--tail-pad-frames"),
        (["--max-minutes", "-1"], "--max-minutes"),
        (["--init-from", "/nonexistent/epoch-3.pt"], "--init-from"),
        (["--encoder-dim", "512"], "--rnn-hidden-size (256) must be >= --encoder-dim (512)"),
    ],
)
def test_bad_flags_give_argparse_errors(argv, flag, capsys, tiny_data):
    base = ["--bpe-model", str(tiny_data / "data/lang_bpe_100/bpe.model")]
    assert_flag_error(get_parser(), validate_args, base + argv, flag, capsys)


def test_missing_or_empty_training_manifest_gives_clear_error(tiny_data, tmp_path):
    manifests = tmp_path / "fbank"
    manifests.mkdir()
    proc = run_train(tiny_data, tmp_path / "exp", "--manifest-dir", str(manifests))
    assert proc.returncode == 1
    assert "librispeech_cuts_train-clean-100.jsonl.gz: run egs/librispeech/ASR/prepare.sh first" in proc.stderr
    assert "Traceback" not in proc.stderr
    import gzip

    with gzip.open(manifests / "librispeech_cuts_train-clean-100.jsonl.gz", "wt"):
        pass
    for part in ("dev-clean", "dev-other"):
        (manifests / f"librispeech_cuts_{part}.jsonl.gz").symlink_to(
            tiny_data / "data/fbank" / f"librispeech_cuts_{part}.jsonl.gz"
        )
    proc = run_train(tiny_data, tmp_path / "exp", "--manifest-dir", str(manifests))
    assert proc.returncode == 1
    assert "the training cut set is empty" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_training_flags_reach_the_model(tiny_data):
    _, model, *_ = _params_and_model(tiny_data)
    assert model.ctc_output is None
    # The defaults chosen by the learning-speed study: no dropout, no layer dropout.
    assert model.encoder.encoder.layers[0].dropout.p == 0.0 and model.encoder.encoder.layers[0].layer_dropout == 0.0
    _, model, *_ = _params_and_model(tiny_data, "--dropout", "0.3", "--layer-dropout", "0", "--ctc-loss-scale", "0.2")
    for layer in model.encoder.encoder.layers:
        assert layer.dropout.p == 0.3 and layer.feed_forward[3].p == 0.3 and layer.layer_dropout == 0.0
    assert model.ctc_output is not None and model.ctc_output[0].p == 0.3


@pytest.mark.parametrize("warmup, expected", [(0.0, 0.0), (0.99, 0.0), (1.0, 1.0), (1.5, 0.1), (2.0, 1.0), (7.0, 1.0)])
def test_pruned_loss_scale_is_icefalls_step_schedule(warmup, expected):
    # icefall: 0 if warmup < 1, else 0.1 if 1 < warmup < 2, else 1 (so exactly 1.0 gives 1.0).
    assert pruned_loss_scale(warmup) == expected


def test_linear_loss_ramp_is_zipformers(tiny_data):
    params, *_ = _params_and_model(tiny_data, "--loss-ramp", "linear", "--simple-loss-scale", "0.5")
    # Hand-worked: simple 1 - w * 0.5, pruned 0.1 + 0.9 * w during the warm-up, then (0.5, 1).
    for warmup, expected in [(0.0, (1.0, 0.1)), (0.5, (0.75, 0.55)), (1.0, (0.5, 1.0)), (4.0, (0.5, 1.0))]:
        assert loss_scales(params, warmup) == pytest.approx(expected)
    params.loss_ramp = "step"
    assert loss_scales(params, 1.5) == (0.5, 0.1)


def test_compute_loss_with_tail_padding_and_ctc(tiny_data):
    params, model, _, _, sp = _params_and_model(tiny_data, "--tail-pad-frames", "35", "--ctc-loss-scale", "0.2")
    model.eval()
    batch = _batch()
    lens = batch["supervisions"]["num_frames"]
    for i, n in enumerate(lens.tolist()):
        batch["inputs"][i, n:] = math.log(1e-10)  # lhotse's padding value
    loss, info = compute_loss(params, model, sp, batch, is_training=False, warmup=3.0)
    # Per-frame normalisation counts the utterances' own frames, not the padding.
    assert info["frames"] == float(sum(((n - 3) // 2 - 1) // 2 for n in lens.tolist()))
    # The same as the model on features padded by hand with 35 frames of log(1e-10) after each utterance
    # (beyond its own frames the batch already holds lhotse's padding, log(1e-10)).
    padded = torch.full((3, 120 + 35, 80), math.log(1e-10))
    for i, n in enumerate(lens.tolist()):
        padded[i, :n] = batch["inputs"][i, :n]
    token_ids = sp.encode(batch["supervisions"]["text"], out_type=int)
    with torch.no_grad():
        simple, pruned, ctc, _ = model(
            padded,
            lens + 35,
            token_ids,
            prune_range=params.prune_range,
            am_scale=params.am_scale,
            lm_scale=params.lm_scale,
            warmup=3.0,
        )
    assert info["loss"] == pytest.approx(float(0.5 * simple.sum() + pruned.sum()), rel=1e-5)
    assert info["ctc_loss"] == pytest.approx(float(ctc.sum()), rel=1e-5)
    assert float(loss) == pytest.approx(info["loss"] + 0.2 * info["ctc_loss"], rel=1e-5)
    # Without the padding the loss is another one.
    params.tail_pad_frames = 0
    _, unpadded = compute_loss(params, model, sp, batch, is_training=False, warmup=3.0)
    assert abs(unpadded["loss"] - info["loss"]) > 1e-3 * info["loss"]
    assert unpadded["frames"] == info["frames"]


def test_delay_penalty_applies_after_the_warm_up_as_icefall(tiny_data):
    """--delay-penalty reaches both losses once warmup >= 2 (icefall's stateless3 rule), never before or in
    validation (warmup 1.0)."""
    params, model, _, _, sp = _params_and_model(tiny_data, "--delay-penalty", "0.5")
    model.eval()
    batch = _batch()
    lens = batch["supervisions"]["num_frames"]
    token_ids = sp.encode(batch["supervisions"]["text"], out_type=int)

    def direct(delay_penalty, warmup, pruned_scale):
        with torch.no_grad():
            simple, pruned, _, _ = model(
                batch["inputs"], lens, token_ids, prune_range=params.prune_range, am_scale=params.am_scale,
                lm_scale=params.lm_scale, warmup=warmup, delay_penalty=delay_penalty,
            )  # fmt: skip
        return float(0.5 * simple.sum() + pruned_scale * pruned.sum())

    _, trained = compute_loss(params, model, sp, batch, is_training=False, warmup=3.0)
    assert trained["loss"] == pytest.approx(direct(0.5, 3.0, 1.0), rel=1e-6)
    assert abs(trained["loss"] - direct(0.0, 3.0, 1.0)) > 1e-3 * abs(trained["loss"])
    _, second_warmup = compute_loss(params, model, sp, batch, is_training=False, warmup=1.5)
    assert second_warmup["loss"] == pytest.approx(direct(0.0, 1.5, 0.1), rel=1e-6)
    _, validation = compute_loss(params, model, sp, batch, is_training=False)
    assert validation["loss"] == pytest.approx(direct(0.0, 1.0, 1.0), rel=1e-6)


def test_max_minutes_stops_validates_and_records_progress(tiny_data, tmp_path):
    proc = run_train(tiny_data, tmp_path / "exp", "--max-minutes", "0.0001", "--num-epochs", "3")
    assert proc.returncode == 0, proc.stderr
    assert "Stopped by --max-batches 0 / --max-minutes 0.0001 at global batch 1 " in proc.stderr
    assert [p.name for p in (tmp_path / "exp").glob("*.pt")] == ["checkpoint-1.pt"]
    ckpt = load_checkpoint_file(tmp_path / "exp" / "checkpoint-1.pt")
    assert ckpt["batch_idx_train"] == 1 and ckpt["train_seconds"] > 0
    assert math.isfinite(ckpt["valid_loss"]) and math.isfinite(ckpt["train_loss"])


def test_prepare_sh_default_vocabulary_is_train_py_default_bpe_model(tiny_data):
    # prepare.sh (bash) and icefall_lite.data.bpe (Python) both state the synthetic corpus's vocabulary:
    # the tiny corpus, prepared without --vocab-size, has the BPE model train.py and decode.py default to.
    from icefall_lite.data.bpe import DEFAULT_BPE_MODEL

    assert (tiny_data / DEFAULT_BPE_MODEL).is_file()
    assert get_parser().parse_args([]).bpe_model == DEFAULT_BPE_MODEL


def test_train_py_trains_what_the_decoding_scripts_decode_by_default():
    # decode.py/export_onnx.py default to --epoch NUM_EPOCHS in EXP_DIR (their tests check that side).
    from icefall_lite.recipe_defaults import EXP_DIR, NUM_EPOCHS

    args = get_parser().parse_args([])
    assert (args.num_epochs, args.exp_dir) == (NUM_EPOCHS, EXP_DIR)


# icefall's lstm_transducer_stateless3 settings, written from its train.py / asr_datamodule.py
# independently of icefall_lite.train.presets.ICEFALL_PRESET.
ICEFALL_VALUES = {
    "model_preset": "icefall",
    "num_epochs": 40,
    "bpe_model": "data/lang_bpe_500/bpe.model",
    "optimizer_name": "eve",
    "base_lr": 0.003,
    "lr_batches": 5000,
    "lr_epochs": 10,
    "model_warm_step": 3000,
    "prune_range": 5,
    "lm_scale": 0.25,
    "am_scale": 0.0,
    "simple_loss_scale": 0.5,
    "dropout": 0.1,
    "layer_dropout": 0.075,
    "grad_filter_threshold": 25.0,
    "clip_grad_norm": 0.0,
    "average_period": 100,
    "save_every_n": 4000,
    "keep_last_k": 20,
    "log_interval": 50,
    "seed": 42,
    "max_duration": 200.0,
    "num_buckets": 30,
    "drop_last": True,
    "num_workers": 2,
    "enable_spec_aug": True,
    "spec_aug_time_warp_factor": 80,
    "enable_musan": True,
    "ctc_loss_scale": 0.0,
    "tail_pad_frames": 0,
    "delay_penalty": 0.0,
}


def test_icefall_preset_sets_icefall_values_and_explicit_flags_win():
    parser = get_parser()
    dests = {action.dest for action in parser._actions}
    assert set(ICEFALL_PRESET) <= dests  # no setting lands on a name train.py does not read
    args = parse_args(get_parser(), ["--preset", "icefall"])
    assert {k: getattr(args, k) for k in ICEFALL_VALUES} == ICEFALL_VALUES
    assert args.valid_interval == 800  # train-clean-100 only
    assert parse_args(get_parser(), ["--preset", "icefall", "--full-libri", "true"]).valid_interval == 3000
    # The ablation's gradient-control arms on top of the preset: explicit flags win.
    args = parse_args(
        get_parser(),
        ["--clip-grad-norm", "5", "--preset", "icefall", "--grad-norm-threshold", "0", "--agc-clipping", "0.1"],
    )
    assert (args.clip_grad_norm, args.grad_filter_threshold, args.agc_clipping, args.num_buckets) == (5.0, 0.0, 0.1, 30)
    # Without the preset, today's defaults.
    args = parse_args(get_parser(), [])
    assert (args.preset, args.clip_grad_norm, args.valid_interval, args.num_buckets) == ("none", 5.0, 0, 10)


def test_valid_interval_validates_every_n_batches_of_an_epoch_as_icefall(tiny_data, tmp_path):
    """--valid-interval 2: validation after icefall's batch_idx 2 and 4 (global batches 3 and 5), none at
    the epoch's end; the epoch checkpoint keeps the best of them."""
    proc = run_train(tiny_data, tmp_path / "exp", "--max-batches", "5", "--valid-interval", "2", "--save-every-n", "0")
    assert proc.returncode == 0, proc.stderr
    log = next((tmp_path / "exp" / "log").glob("log-train-*")).read_text()
    batches = [int(b) for b in re.findall(r"Epoch 1, global batch (\d+), validation: loss=", log)]
    assert batches == [3, 5]
    losses = [float(v) for v in re.findall(r"Epoch 1, global batch \d+, validation: loss=([0-9.]+)", log)]
    ckpt = load_checkpoint_file(tmp_path / "exp" / "checkpoint-5.pt")
    assert ckpt["best_valid_loss"] == pytest.approx(min(losses), rel=1e-3)  # the log rounds


def test_error_clip_clamps_the_gradient_arriving_at_every_encoder_layer():
    """--error-clip V: the gradient into each encoder layer is the arriving one clamped to [-V, V].
    Reference: the same model without clips, with the clamped gradient fed in by hand at the top layer
    and the lower layers' inputs detached and re-fed the clamped gradients layer by layer."""
    torch.manual_seed(0)
    model = tiny_transducer(
        vocab_size=20,
        encoder_dim=16,
        rnn_hidden_size=24,
        dim_feedforward=32,
        num_encoder_layers=3,
        decoder_dim=16,
        joiner_dim=16,
        dropout=0.0,
        layer_dropout=0.0,
    )
    model.eval()  # the balancers act at random in training mode; the gradients flow all the same
    layers = model.encoder.encoder.layers
    x = torch.randn(2, 7, 16)
    weights = torch.randn(2, 7, 16) * 50  # d loss / d top output, mostly beyond the clip
    value = 3.0

    # Reference: run the layers one by one on detached inputs and clamp each arriving gradient by hand.
    inputs, outputs = [], []
    h = x
    for layer in layers:
        h = h.detach().requires_grad_()
        inputs.append(h)
        h = layer(h)[0]
        outputs.append(h)
    arriving = {len(layers) - 1: weights}
    expected = {}
    for i in reversed(range(len(layers))):
        params = list(layers[i].parameters())
        grads = torch.autograd.grad(outputs[i], [inputs[i], *params], arriving[i].clamp(-value, value))
        expected[i] = grads[1:]
        arriving[i - 1] = grads[0]
    expected_input_grad = grads[0]

    control = GradientControl(
        clip_grad_norm=0, clip_grad_value=0, agc_clipping=0, error_clip=value, clip_grad_norm_relative=0
    )
    control.install(model)
    x_in = x.clone().requires_grad_()
    h = x_in
    for layer in layers:
        h = layer(h)[0]
    (h * weights).sum().backward()
    torch.testing.assert_close(x_in.grad, expected_input_grad, rtol=1e-5, atol=1e-6)
    for i, layer in enumerate(layers):
        for got, want in zip([p.grad for p in layer.parameters()], expected[i]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert weights.abs().max() > value  # the clip acted
    # Each layer counts the elements of its arriving gradient that the clip changed.
    fractions = [float((arriving[i].abs() > value).float().mean()) for i in range(len(layers))]
    assert [c.as_dict()["fraction_clipped"] for c in control.error_clip_counts] == pytest.approx(fractions, abs=1e-7)
    assert 0 < min(fractions) and max(fractions) < 1
    with torch.no_grad():
        layers[0](x)  # a forward without grad (validation) leaves them
    assert control.error_clip_counts[0].as_dict() == {"fraction_clipped": pytest.approx(fractions[0], abs=1e-7)}
    layers[0](x)  # a training forward starts them afresh
    assert control.error_clip_counts[0].as_dict() == {}
