"""icefall's checkpoint format (issue 28), tested without icefall's code and without the network.

:func:`icefall_stateless3_shapes` is the state dict of icefall's ``lstm_transducer_stateless3``
model, names, shapes and order, typed by hand from icefall's source (``lstm.py``: ``RNN`` with
``encoder_embed``, a ``Conv2dSubsampling``, and ``encoder``, an ``RNNEncoder`` whose ``layers``
are ``RNNEncoderLayer`` modules of ``lstm``, ``feed_forward``, ``norm_final``, ``balancer``;
``pruned_transducer_stateless2/scaling.py``: ``ScaledLinear``/``ScaledConv*`` register
``weight_scale``/``bias_scale`` after the layer's own parameters, ``ScaledLSTM`` one
``<flat weight name>_scale`` per flat weight, ``ScaledEmbedding`` ``scale`` before ``weight``,
``BasicNorm(learn_eps=False)`` a buffer ``eps``; ``decoder.py``, ``joiner.py`` and
``lstm_transducer_stateless/model.py`` for the rest). Checkpoints built from it with random
values stand for icefall's files: ``pretrained.pt`` (``{"model": state_dict}``, as icefall's
``export.py`` writes it) and ``epoch-N.pt`` (``icefall/checkpoint.py``'s keys, here with a DDP
``module.`` prefix and ``model_avg``).
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Dict, Iterator, Tuple

import pytest
import torch
from lhotse import load_manifest

from conftest import RECIPE, check_wer_files, recipe_env
from icefall_lite.decoding.fast_beam_search import fast_beam_search_one_best
from icefall_lite.decoding.greedy_search import greedy_search_batch
from icefall_lite.decoding.modified_beam_search import modified_beam_search
from icefall_lite.decoding.streaming import streaming_search
from icefall_lite.export.onnx_export import build_exportable, export_transducer_onnx
from icefall_lite.export.onnx_runtime import OnnxRuntimeTransducer, max_abs_diff
from icefall_lite.nn.model import (
    MODEL_PRESETS,
    add_model_arguments,
    build_transducer,
    count_parameters,
    model_config_from_args,
)
from icefall_lite.train.averaging import load_averaged_weights, load_checkpoint_weights
from icefall_lite.train.checkpoint import CheckpointError, load_checkpoint, load_state_dict_checked, save_checkpoint
from icefall_lite.train.optim import Eve
from icefall_lite.train.resume import init_from_weights

SCRIPTS = RECIPE / "lstm_transducer_stateless"
BPE = "data/lang_bpe_100/bpe.model"  # the tiny corpus's BPE model (prepare.sh --size tiny)
# Small sizes with a projecting LSTM (rnn_hidden_size > encoder_dim), as icefall's.
SMALL = dict(
    vocab_size=100,
    num_features=80,
    encoder_dim=16,
    rnn_hidden_size=24,
    dim_feedforward=32,
    num_encoder_layers=2,
    decoder_dim=16,
    joiner_dim=16,
    context_size=2,
)
SMALL_FLAGS = [
    item
    for k in ("encoder_dim", "rnn_hidden_size", "dim_feedforward", "num_encoder_layers", "decoder_dim", "joiner_dim")
    for item in (f"--{k.replace('_', '-')}", str(SMALL[k]))
]
# BasicNorm(learn_eps=False) of Conv2dSubsampling: in the state dict, not a parameter.
BUFFERS = {"encoder.encoder_embed.out_norm.eps"}


def icefall_stateless3_shapes(
    *,
    vocab_size: int = 500,
    num_features: int = 80,
    encoder_dim: int = 512,
    rnn_hidden_size: int = 1024,
    dim_feedforward: int = 2048,
    num_encoder_layers: int = 12,
    decoder_dim: int = 512,
    joiner_dim: int = 512,
    context_size: int = 2,
) -> "OrderedDict[str, Tuple[int, ...]]":
    """icefall's lstm_transducer_stateless3 state dict: name -> shape, in order (defaults: its train.py's)."""
    shapes: "OrderedDict[str, Tuple[int, ...]]" = OrderedDict()

    def scaled(prefix: str, weight: Tuple[int, ...], bias: bool = True) -> None:
        # nn.Linear / nn.Conv*d's weight and bias, then ScaledLinear / ScaledConv*d's log-scales
        shapes[f"{prefix}.weight"] = weight
        if bias:
            shapes[f"{prefix}.bias"] = (weight[0],)
        shapes[f"{prefix}.weight_scale"] = ()
        if bias:
            shapes[f"{prefix}.bias_scale"] = ()

    # Transducer.encoder = RNN; RNN.encoder_embed = Conv2dSubsampling(num_features, d_model), channels 8, 32, 128
    embed = "encoder.encoder_embed"
    scaled(f"{embed}.conv.0", (8, 1, 3, 3))
    scaled(f"{embed}.conv.3", (32, 8, 3, 3))
    scaled(f"{embed}.conv.6", (128, 32, 3, 3))
    scaled(f"{embed}.out", (encoder_dim, 128 * (((num_features - 3) // 2 - 1) // 2)))
    shapes[f"{embed}.out_norm.eps"] = ()
    # RNN.encoder = RNNEncoder; its layers: ScaledLSTM(proj_size=d_model if rnn_hidden_size > d_model else 0)
    proj = encoder_dim if rnn_hidden_size > encoder_dim else 0
    gates = 4 * rnn_hidden_size
    for i in range(num_encoder_layers):
        layer = f"encoder.encoder.layers.{i}"
        flat = OrderedDict(
            weight_ih_l0=(gates, encoder_dim),
            weight_hh_l0=(gates, proj or rnn_hidden_size),
            bias_ih_l0=(gates,),
            bias_hh_l0=(gates,),
        )
        if proj:
            flat["weight_hr_l0"] = (proj, rnn_hidden_size)
        for name, shape in flat.items():
            shapes[f"{layer}.lstm.{name}"] = shape
        for name in flat:
            shapes[f"{layer}.lstm.{name}_scale"] = ()
        scaled(f"{layer}.feed_forward.0", (dim_feedforward, encoder_dim))
        scaled(f"{layer}.feed_forward.4", (encoder_dim, dim_feedforward))
        shapes[f"{layer}.norm_final.eps"] = ()
    # Decoder: ScaledEmbedding (scale, then weight; no padding_idx), depthwise ScaledConv1d without bias
    shapes["decoder.embedding.scale"] = ()
    shapes["decoder.embedding.weight"] = (vocab_size, decoder_dim)
    if context_size > 1:
        scaled("decoder.conv", (decoder_dim, 1, context_size), bias=False)
    # Joiner, then the Transducer's simple-loss projections
    scaled("joiner.encoder_proj", (joiner_dim, encoder_dim))
    scaled("joiner.decoder_proj", (joiner_dim, decoder_dim))
    scaled("joiner.output_linear", (vocab_size, joiner_dim))
    scaled("simple_am_proj", (vocab_size, encoder_dim))
    scaled("simple_lm_proj", (vocab_size, decoder_dim))
    return shapes


def random_icefall_state_dict(seed: int = 0, **sizes: int) -> Dict[str, torch.Tensor]:
    """A state dict of :func:`icefall_stateless3_shapes` with random values of sensible size.

    Weights ~ N(0, fan_in^-0.5), biases ~ N(0, 0.1), log-scales ~ U(-0.2, 0.2), BasicNorm eps
    ~ log(0.25); built from the table alone (not from a model here). Blank (id 0) gets +2 on
    its joiner bias, as in trained models, so that the searches emit and end.
    """
    gen = torch.Generator().manual_seed(seed)
    out: Dict[str, torch.Tensor] = {}
    for name, shape in icefall_stateless3_shapes(**sizes).items():
        if name.endswith(".eps"):
            value = torch.tensor(math.log(0.25)) + 0.1 * torch.rand((), generator=gen)
        elif not shape:
            value = 0.4 * torch.rand((), generator=gen) - 0.2
        elif len(shape) == 1:
            value = 0.1 * torch.randn(shape, generator=gen)
        else:
            fan_in = math.prod(shape[1:])
            value = torch.randn(shape, generator=gen) * fan_in**-0.5
        out[name] = value
    with torch.no_grad():
        out["joiner.output_linear.bias"][0] += 2.0 / float(out["joiner.output_linear.bias_scale"].exp())
    return out


def small_model() -> torch.nn.Module:
    return build_transducer(
        **SMALL,
        blank_id=0,
        grad_filter_threshold=25.0,
        dropout=0.0,
        layer_dropout=0.0,
        use_ctc=False,
    ).eval()


def write_pretrained(path: Path, seed: int = 0) -> Dict[str, torch.Tensor]:
    """icefall's export.py: ``torch.save({"model": model.state_dict()}, "pretrained.pt")``."""
    state = random_icefall_state_dict(seed, **SMALL)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": state}, path)
    return state


def write_icefall_epoch(path: Path, model_state: Dict[str, torch.Tensor], avg_state: Dict[str, torch.Tensor], batch):
    """icefall/checkpoint.py's save_checkpoint keys, the model's names with a DDP ``module.`` prefix (older
    icefall runs), model_avg in float32 (icefall saves ``model_avg.to(torch.float32).state_dict()``)."""
    torch.save(
        {
            "model": {f"module.{k}": v for k, v in model_state.items()},
            "optimizer": None,
            "scheduler": {"base_lrs": [0.003], "epoch": 3, "batch": batch},
            "grad_scaler": None,
            "sampler": None,
            "model_avg": {k: v.float() for k, v in avg_state.items()},
            "best_train_loss": 0.5,
            "best_valid_loss": 0.6,
            "best_train_epoch": 3,
            "best_valid_epoch": 3,
            "batch_idx_train": batch,
            "log_interval": 50,
            "feature_dim": 80,
            "exp_dir": Path("lstm_transducer_stateless3/exp"),
            "env_info": {"k2-version": "1.24", "torch-version": "2.0"},
        },
        path,
    )


def random_features(n: int = 3, seed: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 100, 80, generator=gen)
    return x, torch.tensor([100, 80, 57][:n])


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------
# The names and shapes
# --------------------------------------------------------------------------


def test_icefall_preset_state_dict_is_icefalls_stateless3():
    """84,689,496 parameters in 269 tensors (one a buffer), every name, shape and position as icefall's."""
    expected = icefall_stateless3_shapes()
    assert len(expected) == 269
    assert sum(math.prod(s) for n, s in expected.items() if n not in BUFFERS) == 84_689_496
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    args = parser.parse_args(["--model-preset", "icefall"])
    torch.manual_seed(0)
    model = build_transducer(**model_config_from_args(args, vocab_size=500, blank_id=0, num_features=80))
    got = [(name, tuple(v.shape)) for name, v in model.state_dict().items()]
    assert got == list(expected.items())
    assert count_parameters(model) == 84_689_496
    assert {n for n, _ in model.named_buffers()} == BUFFERS
    assert model.decoder.embedding.padding_idx is None  # the blank row is learned
    # An icefall-layout state dict of that size loads strictly and the model runs.
    load_state_dict_checked(model, random_icefall_state_dict(), "icefall's pretrained.pt")
    x, x_lens = random_features(1)
    with torch.no_grad():
        encoder_out, encoder_out_lens, _ = model.encoder(x, x_lens)
    assert encoder_out.shape == (1, 23, 512) and torch.isfinite(encoder_out).all()
    assert all(0 < t < 500 for t in greedy_search_batch(model, encoder_out, encoder_out_lens)[0])


@pytest.mark.parametrize("preset", sorted(MODEL_PRESETS))
def test_every_preset_has_icefalls_names_and_a_learned_blank_row(preset):
    sizes = dict(MODEL_PRESETS[preset])
    expected = icefall_stateless3_shapes(vocab_size=50, **sizes)
    model = build_transducer(
        **sizes,
        vocab_size=50,
        num_features=80,
        context_size=2,
        blank_id=0,
        grad_filter_threshold=25.0,
        dropout=0.1,
        layer_dropout=0.075,
        use_ctc=False,
    )
    assert [(n, tuple(v.shape)) for n, v in model.state_dict().items()] == list(expected.items())
    assert model.decoder.embedding.padding_idx is None


def test_small_sizes_and_context_size_one():
    expected = icefall_stateless3_shapes(**{**SMALL, "context_size": 1})
    model = build_transducer(
        **{**SMALL, "context_size": 1},
        blank_id=0,
        grad_filter_threshold=0.0,
        dropout=0.0,
        layer_dropout=0.0,
        use_ctc=False,
    )
    assert [(n, tuple(v.shape)) for n, v in model.state_dict().items()] == list(expected.items())
    assert not any(n.startswith("decoder.conv") for n in expected)


# --------------------------------------------------------------------------
# icefall's files load strictly, decode and export; ours round-trip
# --------------------------------------------------------------------------


def _assert_weights(model: torch.nn.Module, state: Dict[str, torch.Tensor]) -> None:
    own = model.state_dict()
    assert list(own) == list(state)
    for name, value in state.items():
        assert torch.equal(own[name], value.to(own[name].dtype)), name


def test_icefall_pretrained_pt_loads_strictly_and_decodes_with_all_three_searches(tmp_path):
    state = write_pretrained(tmp_path / "exp" / "pretrained.pt")
    model = small_model()
    plan = load_checkpoint_weights(model, tmp_path / "exp" / "pretrained.pt", torch.device("cpu"))
    assert plan.describe() == f"the model of {tmp_path}/exp/pretrained.pt"
    _assert_weights(model, state)
    x, x_lens = random_features()
    with torch.no_grad():
        encoder_out, encoder_out_lens, _ = model.encoder(x, x_lens)
    greedy = greedy_search_batch(model, encoder_out, encoder_out_lens)
    beam = modified_beam_search(model, encoder_out, encoder_out_lens, beam=4)
    fast = fast_beam_search_one_best(model, encoder_out, encoder_out_lens, beam=20.0, max_states=64, max_contexts=8)
    for hyps in (greedy, beam, fast):
        assert len(hyps) == 3
        assert all(0 < t < SMALL["vocab_size"] for hyp in hyps for t in hyp)
    assert sum(map(len, greedy)) > 0, "the random model should emit something"


def test_icefall_epoch_checkpoints_with_ddp_prefix_and_model_avg_load(tmp_path):
    """icefall's epoch-N.pt (DDP names, model_avg): loaded as they are, one by one and averaged as icefall's
    decode.py --use-averaged-model does."""
    states = {epoch: random_icefall_state_dict(epoch, **SMALL) for epoch in (1, 2)}
    avgs = {1: states[1], 2: {k: (states[1][k] + states[2][k]) / 2 for k in states[1]}}
    for epoch in (1, 2):
        write_icefall_epoch(tmp_path / f"epoch-{epoch}.pt", states[epoch], avgs[epoch], batch=100 * epoch)

    model, model_avg = small_model(), small_model().to(torch.float64)
    checkpoint = load_checkpoint(tmp_path / "epoch-2.pt", model, model_avg=model_avg)
    _assert_weights(model, states[2])
    _assert_weights(model_avg, {k: v.float() for k, v in avgs[2].items()})
    assert checkpoint["batch_idx_train"] == 200 and checkpoint["env_info"]["k2-version"] == "1.24"

    # --epoch 2 --avg 1 --use-averaged-model true: (avg_2 * 200 - avg_1 * 100) / 100 = model of epoch 2
    averaged = small_model()
    load_averaged_weights(averaged, tmp_path, epoch=2, avg=1, use_averaged_model=True, device=torch.device("cpu"))
    for name, value in averaged.state_dict().items():
        torch.testing.assert_close(value, states[2][name], rtol=1e-4, atol=1e-5)
    # --epoch 2 --avg 2 --use-averaged-model false: the mean of the two models (DDP names dropped after it)
    mean = small_model()
    load_averaged_weights(mean, tmp_path, epoch=2, avg=2, use_averaged_model=False, device=torch.device("cpu"))
    for name, value in mean.state_dict().items():
        torch.testing.assert_close(value, (states[1][name] + states[2][name]) / 2)


def test_checkpoints_written_here_are_icefalls_layout_and_round_trip(tmp_path):
    state = random_icefall_state_dict(3, **SMALL)
    model = small_model()
    load_state_dict_checked(model, state, "test")
    model_avg = small_model().to(torch.float64)
    load_state_dict_checked(model_avg, state, "test")
    optimizer = Eve(model.parameters(), lr=0.003)
    save_checkpoint(
        tmp_path / "epoch-1.pt",
        model,
        model_avg=model_avg,
        params={"batch_idx_train": 10, "cur_epoch": 1, "best_valid_loss": 1.5, "exp_dir": tmp_path},
        optimizer=optimizer,
    )
    raw = torch.load(tmp_path / "epoch-1.pt", map_location="cpu", weights_only=False)
    # icefall/checkpoint.py's keys (its load_checkpoint reads model, model_avg, optimizer, scheduler,
    # grad_scaler, sampler; train.py the progress keys); our only addition is the RNG state.
    assert set(raw) == {
        "model",
        "model_avg",
        "optimizer",
        "scheduler",
        "grad_scaler",
        "sampler",
        "batch_idx_train",
        "cur_epoch",
        "best_valid_loss",
        "exp_dir",
    }
    expected = icefall_stateless3_shapes(**SMALL)
    for entry in ("model", "model_avg"):  # what icefall's model.load_state_dict(strict=True) needs
        assert [(n, tuple(v.shape)) for n, v in raw[entry].items()] == list(expected.items())
    again = small_model()
    load_checkpoint(tmp_path / "epoch-1.pt", again)
    _assert_weights(again, state)
    # Without an averaged model there is no model_avg key (icefall loads model_avg when the key exists).
    save_checkpoint(tmp_path / "pretrained-like.pt", model)
    assert "model_avg" not in torch.load(tmp_path / "pretrained-like.pt", weights_only=False)


def test_icefall_checkpoint_exports_to_onnx_and_onnxruntime_agrees(tmp_path):
    write_pretrained(tmp_path / "pretrained.pt", seed=4)
    model = small_model()
    load_checkpoint_weights(model, tmp_path / "pretrained.pt", torch.device("cpu"))
    exportable = build_exportable(model)
    files = export_transducer_onnx(exportable, tmp_path / "onnx", "pretrained", int8=False)
    assert sorted(p.name for p in files.values()) == [
        "decoder-pretrained.onnx",
        "encoder-pretrained.onnx",
        "joiner-pretrained.onnx",
    ]
    runner = OnnxRuntimeTransducer(files["encoder"], files["decoder"], files["joiner"])
    x, _ = random_features(2)
    states = exportable.init_states(batch_size=2)
    want, _ = exportable.run_encoder(x[:, : exportable.meta.T], states)
    got, _ = runner.run_encoder(x[:, : exportable.meta.T], states)
    assert max_abs_diff(got, want) < 1e-4
    feats = [x[0], x[1, :80]]
    assert streaming_search(runner, feats) == streaming_search(exportable, feats)


def test_init_from_an_icefall_pretrained_pt(tmp_path):
    """train.py --init-from: fine-tuning starts from icefall's weights, blank row included."""
    state = write_pretrained(tmp_path / "pretrained.pt", seed=6)
    model, model_avg = small_model(), small_model().to(torch.float64)
    init_from_weights(tmp_path / "pretrained.pt", model, model_avg)
    _assert_weights(model, state)
    _assert_weights(model_avg, state)


# --------------------------------------------------------------------------
# Foreign checkpoints
# --------------------------------------------------------------------------


def test_another_architecture_is_a_clear_error_naming_the_first_keys(tmp_path):
    conformer = {
        "encoder.encoder_embed.conv.0.weight": torch.zeros(8, 1, 3, 3),
        "encoder.encoders.0.self_attn.in_proj.weight": torch.zeros(48, 16),
        "encoder.encoders.0.self_attn.in_proj.bias": torch.zeros(48),
        "decoder.embedding.weight": torch.zeros(100, 16),
    }
    torch.save({"model": conformer}, tmp_path / "conformer.pt")
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint_weights(small_model(), tmp_path / "conformer.pt", torch.device("cpu"))
    msg = str(exc.value)
    total = len(icefall_stateless3_shapes(**SMALL))
    assert msg.startswith(f"the model of {tmp_path}/conformer.pt does not fit this model (another architecture")
    assert f"{total - 2} of the model's {total} names are missing in it and 2 of its 4 names are unknown" in msg
    assert (
        "Missing in checkpoint: encoder.encoder_embed.conv.0.bias, encoder.encoder_embed.conv.0.weight_scale, "
        "encoder.encoder_embed.conv.0.bias_scale," in msg
    )
    assert (
        "Unexpected in checkpoint: encoder.encoders.0.self_attn.in_proj.weight, "
        "encoder.encoders.0.self_attn.in_proj.bias" in msg
    )
    assert f"... ({total - 2} in all)" in msg


def test_checkpoint_with_the_old_names_says_so():
    """icefall-lite's names before this format (encoder.layers.N, lstm._scales.I): a clear error."""
    old = {}
    for name, value in random_icefall_state_dict(**SMALL).items():
        name = name.replace("encoder.encoder.layers.", "encoder.layers.")
        for i, flat in enumerate(["weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0", "weight_hr_l0"]):
            name = name.replace(f".lstm.{flat}_scale", f".lstm._scales.{i}")
        old[name] = value
    with pytest.raises(CheckpointError) as exc:
        load_state_dict_checked(small_model(), old, "exp/epoch-3.pt")
    msg = str(exc.value)
    assert "icefall-lite's from before it took icefall's checkpoint format" in msg
    assert "cannot be loaded" in msg
    assert "Missing in checkpoint: encoder.encoder.layers.0.lstm.weight_ih_l0," in msg
    assert "Unexpected in checkpoint: encoder.layers.0.lstm.weight_ih_l0," in msg


def test_more_layers_is_not_taken_for_the_old_names():
    deeper = random_icefall_state_dict(**{**SMALL, "num_encoder_layers": 3})
    with pytest.raises(CheckpointError) as exc:
        load_state_dict_checked(small_model(), deeper, "exp/epoch-3.pt")
    msg = str(exc.value)
    assert "0 of the model's" in msg and "Unexpected in checkpoint: encoder.encoder.layers.2.lstm.weight_ih_l0," in msg
    assert "before it took icefall's checkpoint format" not in msg


# --------------------------------------------------------------------------
# The learned blank row
# --------------------------------------------------------------------------


def test_blank_row_receives_gradient_and_is_trained():
    torch.manual_seed(0)
    model = build_transducer(
        **SMALL, blank_id=0, grad_filter_threshold=25.0, dropout=0.1, layer_dropout=0.075, use_ctc=False
    ).train()
    embedding = model.decoder.embedding
    assert embedding.padding_idx is None
    assert embedding.weight[0].abs().sum() > 0  # initialised like every row, not zeroed
    before = embedding.weight[0].detach().clone()
    optimizer = Eve(model.parameters(), lr=0.003)
    x, x_lens = random_features()
    y = [[5, 7, 9], [11, 12], [3]]
    simple, pruned, _, _ = model(x, x_lens, y)
    (0.5 * simple.sum() + pruned.sum()).backward()
    grad = embedding.weight.grad
    assert grad[0].abs().sum() > 0  # every prediction starts from the blank (sos) context
    assert grad[99].abs().sum() == 0  # a token no transcript has: no gradient
    optimizer.step()
    assert not torch.equal(embedding.weight[0], before)


# --------------------------------------------------------------------------
# The user's path (README "Using icefall's published model"), small sizes, on the tiny corpus
# --------------------------------------------------------------------------


def run_script(name: str, work: Path, *args: str) -> subprocess.CompletedProcess:
    env = recipe_env()
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, str(SCRIPTS / name), *args]
    return subprocess.run(cmd, cwd=work, capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def icefall_dir(tiny_data, tmp_path_factory) -> Path:
    """A download-like folder: <dir>/exp/pretrained.pt in icefall's layout; the BPE model is the tiny corpus's."""
    root = tmp_path_factory.mktemp("icefall_model")
    write_pretrained(root / "exp" / "pretrained.pt", seed=5)
    return root


@pytest.mark.parametrize(
    "method, suffix, key",
    [
        ("greedy_search", "pretrained-context-2-max-sym-per-frame-1", "greedy_search"),
        ("modified_beam_search", "pretrained-modified_beam_search-beam-size-4", "beam_size_4"),
        (
            "fast_beam_search",
            "pretrained-beam-20.0-max-contexts-8-max-states-64",
            "beam_20.0_max_contexts_8_max_states_64",
        ),
    ],
)
def test_decode_py_with_checkpoint(tiny_data, icefall_dir, method, suffix, key):
    exp = icefall_dir / "exp"
    run = run_script(
        "decode.py",
        tiny_data,
        "--checkpoint",
        str(exp / "pretrained.pt"),
        "--exp-dir",
        str(exp),
        "--bpe-model",
        BPE,
        "--num-workers",
        "0",
        "--decoding-method",
        method,
        "--test-sets",
        "test-clean",
        *SMALL_FLAGS,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"Loading the model of {exp}/pretrained.pt" in run.stderr
    manifest = tiny_data / "data/fbank/librispeech_cuts_test-clean.jsonl.gz"
    hyps = check_wer_files(exp / method, "test-clean", suffix, key, manifest)
    assert any(hyps.values()), "the random model should emit something"


def test_streaming_decode_export_and_sherpa_onnx_with_checkpoint(tiny_data, icefall_dir, tmp_path):
    exp = icefall_dir / "exp"
    checkpoint = ["--checkpoint", str(exp / "pretrained.pt")]
    common = [*checkpoint, "--exp-dir", str(exp), "--bpe-model", BPE, *SMALL_FLAGS]
    run = run_script("streaming_decode.py", tiny_data, *common, "--num-workers", "0", "--test-sets", "test-clean")
    assert run.returncode == 0, run.stderr[-3000:]
    suffix = "pretrained-context-2-max-sym-per-frame-1-decode-chunk-len-4"
    manifest = tiny_data / "data/fbank/librispeech_cuts_test-clean.jsonl.gz"
    hyps = check_wer_files(exp / "streaming" / "greedy_search", "test-clean", suffix, "greedy_search", manifest)
    assert any(hyps.values()), "the random model should emit something"

    run = run_script("export_onnx.py", tiny_data, *common, "--int8", "false")
    assert run.returncode == 0, run.stderr[-3000:]
    for part in ("encoder", "decoder", "joiner"):
        assert (exp / f"{part}-pretrained.onnx").is_file()
    assert (exp / "tokens.txt").is_file()

    few = load_manifest(manifest).subset(first=2)
    few_path = tmp_path / "librispeech_cuts_few.jsonl.gz"
    few.to_file(few_path)
    run = run_script(
        "sherpa_onnx_decode.py", tiny_data, *checkpoint, "--exp-dir", str(exp), "--test-sets", str(few_path)
    )
    assert run.returncode == 0, run.stderr[-3000:]
    sherpa_suffix = "pretrained-context-2-max-sym-per-frame-1-decode-chunk-len-4"
    hyps = check_wer_files(exp / "sherpa-onnx" / "greedy_search", "few", sherpa_suffix, "greedy_search", few_path)
    assert any(hyps.values()), "the random model should emit something"


def test_checkpoint_flag_errors(tiny_data, icefall_dir, tmp_path):
    base = ["--exp-dir", str(tmp_path), "--bpe-model", BPE, "--num-workers", "0", "--test-sets", "test-clean"]
    run = run_script("decode.py", tiny_data, "--checkpoint", str(tmp_path / "nope.pt"), *base, *SMALL_FLAGS)
    assert run.returncode == 2 and f"--checkpoint {tmp_path}/nope.pt does not exist" in run.stderr
    data = (icefall_dir / "exp" / "pretrained.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    run = run_script(
        "export_onnx.py",
        tiny_data,
        "--checkpoint",
        str(tmp_path / "cut.pt"),
        "--bpe-model",
        BPE,
        "--output-dir",
        str(tmp_path / "onnx"),
        *SMALL_FLAGS,
    )
    assert run.returncode == 1, run.stderr[-3000:]
    assert f"export_onnx.py: error: Checkpoint {tmp_path}/cut.pt cannot be read" in run.stderr
    assert "download it again" in run.stderr and "Traceback" not in run.stderr
    # The right file without the size flags (the cpu preset's sizes): the first mismatched shapes.
    run = run_script(
        "streaming_decode.py", tiny_data, "--checkpoint", str(icefall_dir / "exp" / "pretrained.pt"), *base
    )
    assert run.returncode == 1, run.stderr[-3000:]
    assert "streaming_decode.py: error: the model of" in run.stderr and "Mismatched shapes:" in run.stderr
    assert "Traceback" not in run.stderr
