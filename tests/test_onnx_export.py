"""ONNX export: non-scaled conversion, streaming wrappers, ONNX files, the export script, sherpa-onnx."""

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import sentencepiece as spm
import sherpa_onnx
import torch
import torch.nn as nn

from conftest import assert_flag_error, recipe_env, reference_streaming_greedy, tiny_transducer
from icefall_lite.data.bpe import train_bpe_model
from icefall_lite.data.features import fbank_extractor
from icefall_lite.decoding.streaming import TorchStreamingModel, chunk_starts, streaming_search
from icefall_lite.export.cli import get_parser, validate_args
from icefall_lite.export.onnx_export import (
    build_exportable,
    export_transducer_onnx,
    onnx_filenames,
    read_meta_data,
    write_tokens_file,
)
from icefall_lite.export.onnx_runtime import OnnxRuntimeTransducer
from icefall_lite.export.scaling_converter import LSTMP, NonScaledBasicNorm, convert_scaled_to_non_scaled
from icefall_lite.nn.clip import GradientFilter
from icefall_lite.nn.scaling import ActivationBalancer, BasicNorm, ScaledLinear, ScaledLSTM
from icefall_lite.recipe_defaults import AVG, EXP_DIR, NUM_EPOCHS
from icefall_lite.train.averaging import average_checkpoints, average_checkpoints_with_averaged_model
from icefall_lite.train.checkpoint import save_checkpoint

SCRIPT = Path(__file__).resolve().parents[1] / "egs/librispeech/ASR/lstm_transducer_stateless/export_onnx.py"
TINY = dict(encoder_dim=16, dim_feedforward=32, num_encoder_layers=2, decoder_dim=16, joiner_dim=20)
# rnn_hidden_size == encoder_dim: no projection (nn.LSTM / ONNX LSTM op); larger: projection (LSTMP).
HIDDEN = {"no_proj": 16, "proj": 24}
TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models run one chunk at a time: a second OpenMP thread only adds synchronisation (and
    is very slow on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _perturb(model: nn.Module, seed: int) -> nn.Module:
    """Move every log-scale / eps (0-dim parameters) and the biases off their initial values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 0 or name.endswith("bias") or "bias_" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return model


def _tiny(kind: str, vocab_size: int = 30, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = tiny_transducer(vocab_size=vocab_size, rnn_hidden_size=HIDDEN[kind], **TINY)
    return _perturb(model, seed + 100).eval()


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


# --------------------------------------------------------------------------
# Conversion and wrappers (PyTorch)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("proj_size", [0, 5])
def test_lstmp_equals_nn_lstm(proj_size):
    torch.manual_seed(0)
    ref = nn.LSTM(7, 9, proj_size=proj_size)
    w = {n: getattr(ref, n) for n in ref._flat_weights_names}
    lstmp = LSTMP(w["weight_ih_l0"], w["weight_hh_l0"], w["bias_ih_l0"] + w["bias_hh_l0"], w.get("weight_hr_l0"))
    x = _randn(6, 3, 7, seed=1)
    h0 = _randn(1, 3, proj_size or 9, seed=2)
    c0 = _randn(1, 3, 9, seed=3)
    with torch.no_grad():
        want, (want_h, want_c) = ref(x, (h0, c0))
        got, (got_h, got_c) = lstmp(x, (h0, c0))
    assert got.shape == want.shape and got_h.shape == want_h.shape and got_c.shape == want_c.shape
    assert _max_diff(got, want) < TOL and _max_diff(got_h, want_h) < TOL and _max_diff(got_c, want_c) < TOL


@pytest.mark.parametrize("kind", ["no_proj", "proj"])
def test_conversion_replaces_every_scaled_module_and_leaves_model_alone(kind):
    model = _tiny(kind)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plain = convert_scaled_to_non_scaled(model)
    scaled_types = (ScaledLinear, ScaledLSTM, BasicNorm, ActivationBalancer, GradientFilter)
    left = [type(m).__name__ for m in plain.modules() if isinstance(m, scaled_types)]
    assert not left and not [m for m in plain.modules() if type(m).__name__.startswith("Scaled")]
    lstm_type = nn.LSTM if kind == "no_proj" else LSTMP
    assert all(type(layer.lstm) is lstm_type for layer in plain.encoder.encoder.layers)
    norms = [m for m in plain.modules() if isinstance(m, NonScaledBasicNorm)]
    assert len(norms) == 1 + TINY["num_encoder_layers"]
    assert norms[1].eps == pytest.approx(float(model.encoder.encoder.layers[0].norm_final.eps.exp()))
    assert not plain.training
    x = _randn(2, 30, 80, seed=11)
    with torch.no_grad():  # no states given: the LSTMs start from zeros, as the original's
        want, want_lens, _ = model.encoder(x, torch.tensor([30, 25]))
        got, got_lens, _ = plain.encoder(x, torch.tensor([30, 25]))
    assert torch.equal(got_lens, want_lens) and _max_diff(got, want) < TOL
    assert isinstance(model.encoder.encoder.layers[0].lstm, ScaledLSTM)  # the original is untouched
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("kind", ["no_proj", "proj"])
@pytest.mark.parametrize("decode_chunk_len", [4, 8])
def test_streaming_encoder_matches_original_encoder_with_states(kind, decode_chunk_len):
    model = _tiny(kind)
    ex = build_exportable(model, decode_chunk_len=decode_chunk_len)
    meta = ex.meta
    assert meta.T == decode_chunk_len + 5
    n = 3
    x = _randn(n, meta.T, 80, seed=1)
    h = _randn(meta.num_encoder_layers, n, meta.d_model, seed=2)
    c = _randn(meta.num_encoder_layers, n, meta.rnn_hidden_size, seed=3)
    with torch.no_grad():
        enc, lens, (want_h, want_c) = model.encoder(x, torch.full((n,), meta.T), (h, c))
        want = model.joiner.encoder_proj(enc)
        got, (got_h, got_c) = ex.run_encoder(x, (h, c))
    assert got.shape == (n, decode_chunk_len // 4, TINY["joiner_dim"]) and int(lens[0]) == decode_chunk_len // 4
    assert got_h.shape == h.shape and got_c.shape == c.shape
    assert _max_diff(got, want) < TOL
    assert _max_diff(got_h, want_h) < TOL and _max_diff(got_c, want_c) < TOL


@pytest.mark.parametrize("kind", ["no_proj", "proj"])
def test_chunked_streaming_reproduces_full_utterance_encoder(kind):
    """Windows of 9 frames every 4 frames, states carried: the same frames as one full-utterance pass."""
    model = _tiny(kind)
    ex = build_exportable(model)
    num_frames = 62
    feats = _randn(num_frames, 80, seed=4)
    with torch.no_grad():
        full, full_lens, _ = model.encoder(feats.unsqueeze(0), torch.tensor([num_frames]))
        full = model.joiner.encoder_proj(full)[0]
    states = ex.init_states()
    frames = []
    for start in chunk_starts(num_frames, ex.meta.T, ex.meta.decode_chunk_len):
        out, states = ex.run_encoder(feats[start : start + ex.meta.T].unsqueeze(0), states)
        frames.append(out[0])
    streamed = torch.cat(frames)
    assert streamed.shape == full.shape == (int(full_lens[0]), TINY["joiner_dim"])
    assert _max_diff(streamed, full) < TOL


@pytest.mark.parametrize("kind", ["no_proj", "proj"])
def test_decoder_and_joiner_wrappers_match_original(kind):
    model = _tiny(kind)
    ex = build_exportable(model)
    y = torch.tensor([[0, 0], [0, 5], [7, 3], [29, 1]])
    enc = _randn(4, TINY["joiner_dim"], seed=5)
    with torch.no_grad():
        want_dec = model.joiner.decoder_proj(model.decoder(y, need_pad=False)[:, 0])
        want_logit = model.joiner(enc, want_dec, project_input=False)
        got_dec = ex.run_decoder(y)
        got_logit = ex.run_joiner(enc, got_dec)
    assert got_dec.shape == (4, TINY["joiner_dim"]) and got_logit.shape == (4, 30)
    assert _max_diff(got_dec, want_dec) < TOL and _max_diff(got_logit, want_logit) < TOL


def test_build_exportable_rejects_bad_chunk_len():
    with pytest.raises(ValueError, match="multiple of 4"):
        build_exportable(_tiny("proj"), decode_chunk_len=6)


def test_chunk_starts_follow_sherpa_onnx_is_ready():
    # sherpa-onnx decodes a window only while start + T < frames ready.
    assert list(chunk_starts(9, 9, 4)) == []
    assert list(chunk_starts(10, 9, 4)) == [0]
    assert list(chunk_starts(17, 9, 4)) == [0, 4]
    assert list(chunk_starts(18, 9, 4)) == [0, 4, 8]
    assert len(chunk_starts(161, 9, 4)) == 38


# --------------------------------------------------------------------------
# ONNX files
# --------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["no_proj", "proj"])
def exported(request, tmp_path_factory):
    """(model, exportable, files) of a tiny model exported with int8 copies."""
    model = _tiny(request.param)
    ex = build_exportable(model)
    files = export_transducer_onnx(ex, tmp_path_factory.mktemp(f"onnx-{request.param}"), "epoch-9-avg-2", int8=True)
    return model, ex, files


def test_files_names_and_metadata(exported):
    _, ex, files = exported
    assert {k: v.name for k, v in files.items()} == {
        "encoder": "encoder-epoch-9-avg-2.onnx",
        "decoder": "decoder-epoch-9-avg-2.onnx",
        "joiner": "joiner-epoch-9-avg-2.onnx",
        "encoder.int8": "encoder-epoch-9-avg-2.int8.onnx",
        "decoder.int8": "decoder-epoch-9-avg-2.int8.onnx",
        "joiner.int8": "joiner-epoch-9-avg-2.int8.onnx",
    }
    want_encoder = {
        "model_type": "lstm",
        "version": "1",
        "model_author": "icefall-lite",
        "decode_chunk_len": "4",
        "T": "9",
        "num_encoder_layers": "2",
        "d_model": "16",
        "rnn_hidden_size": str(ex.meta.rnn_hidden_size),
    }
    want = {
        "encoder": want_encoder,
        "decoder": {"vocab_size": "30", "context_size": "2"},
        "joiner": {"joiner_dim": "20"},
    }
    for part, meta in want.items():
        for kind in (part, f"{part}.int8"):
            got = read_meta_data(files[kind])
            assert {k: got.get(k) for k in meta} == meta, kind
    assert not [p for p in files["encoder"].parent.iterdir() if p.name.startswith(".tmp")]


def _dims(value_info) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def test_only_batch_dimension_is_dynamic(exported):
    _, ex, files = exported
    m = ex.meta
    enc = onnx.load(str(files["encoder"])).graph
    assert [(i.name, _dims(i)) for i in enc.input] == [
        ("x", ["N", 9, 80]),
        ("h", [2, "N", 16]),
        ("c", [2, "N", m.rnn_hidden_size]),
    ]
    assert [(o.name, _dims(o)) for o in enc.output] == [
        ("encoder_out", ["N", 1, 20]),
        ("next_h", [2, "N", 16]),
        ("next_c", [2, "N", m.rnn_hidden_size]),
    ]
    dec = onnx.load(str(files["decoder"])).graph
    assert [(i.name, _dims(i)) for i in dec.input] == [("y", ["N", 2])]
    assert dec.input[0].type.tensor_type.elem_type == onnx.TensorProto.INT64
    join = onnx.load(str(files["joiner"])).graph
    assert [(i.name, _dims(i)) for i in join.input] == [("encoder_out", ["N", 20]), ("decoder_out", ["N", 20])]
    assert [(o.name, _dims(o)) for o in join.output] == [("logit", ["N", 30])]


def test_onnxruntime_fp32_agrees_with_torch(exported):
    _, ex, files = exported
    ort_model = OnnxRuntimeTransducer(files["encoder"], files["decoder"], files["joiner"])
    assert ort_model.meta == ex.meta
    n = 3  # another batch size than the export's
    x = _randn(n, 9, 80, seed=6)
    states = (_randn(2, n, 16, seed=7), _randn(2, n, ex.meta.rnn_hidden_size, seed=8))
    want, (want_h, want_c) = ex.run_encoder(x, states)
    got, (got_h, got_c) = ort_model.run_encoder(x, states)
    assert _max_diff(got, want) < TOL and _max_diff(got_h, want_h) < TOL and _max_diff(got_c, want_c) < TOL
    y = torch.tensor([[0, 0], [4, 9], [28, 3]])
    assert _max_diff(ort_model.run_decoder(y), ex.run_decoder(y)) < TOL
    dec = ex.run_decoder(y)
    assert _max_diff(ort_model.run_joiner(want[:, 0], dec), ex.run_joiner(want[:, 0], dec)) < TOL


def test_int8_files_are_quantised_and_close(exported):
    _, ex, files = exported
    ops = {n.op_type for n in onnx.load(str(files["encoder.int8"])).graph.node}
    assert "MatMulInteger" in ops
    if ex.meta.rnn_hidden_size == ex.meta.d_model:
        assert "DynamicQuantizeLSTM" in ops and "LSTM" not in ops
    dec = onnx.load(str(files["decoder.int8"])).graph
    eight_bit = (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)
    assert [30, 16] in [list(t.dims) for t in dec.initializer if t.data_type in eight_bit]  # the embedding (Gather)
    assert "MatMulInteger" in {n.op_type for n in dec.node}  # decoder_proj
    int8 = OnnxRuntimeTransducer(files["encoder.int8"], files["decoder.int8"], files["joiner.int8"])
    x = _randn(2, 9, 80, seed=9)
    want, _ = ex.run_encoder(x, ex.init_states(2))
    got, _ = int8.run_encoder(x, int8.init_states(2))
    assert got.shape == want.shape
    # int8 weights and activations: a rough copy, not an exact one.
    assert float(torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)) > 0.9


def _emitting_model(kind: str, vocab_size: int = 40) -> nn.Module:
    """A random-weight model whose greedy search emits a mix of blanks and several tokens.

    The output layer is scaled up and the blank logit raised; the seeds were
    picked so that the four test waveforms give varied token sequences.
    """
    torch.manual_seed({"no_proj": 2, "proj": 0}[kind])
    model = tiny_transducer(
        vocab_size=vocab_size,
        encoder_dim=16,
        rnn_hidden_size=HIDDEN[kind],
        dim_feedforward=32,
        num_encoder_layers=2,
        decoder_dim=16,
        joiner_dim=16,
    ).eval()
    with torch.no_grad():
        out = model.joiner.output_linear
        out.weight_scale.add_(math.log(8.0))
        out.bias[0] += 3.0 / out.bias_scale.exp()
    return model


def _waveforms() -> list:
    """Four 16 kHz chirps with amplitude modulation and a little noise; 150, 161, 163 and 176 fbank frames.

    161 frames: (161 - 9) % 4 == 0, where sherpa-onnx's ``start + T < frames`` rule drops the last window.
    """
    rng = np.random.default_rng(0)
    out = []
    for i, num_frames in enumerate([150, 161, 163, 176]):
        t = np.arange(160 * num_frames) / 16000
        f0 = 200 + 150 * np.sin(2 * np.pi * (0.7 + 0.3 * i) * t)
        wav = 0.1 * np.sin(2 * np.pi * np.cumsum(f0) / 16000) * (0.6 + 0.4 * np.sin(2 * np.pi * 2.3 * t))
        out.append((wav + 0.01 * rng.standard_normal(t.size)).astype(np.float32))
    return out


def _features(wav: np.ndarray) -> torch.Tensor:
    """lhotse Fbank (80 bins, dither 0, snip_edges False, high_freq -400): what sherpa-onnx computes."""
    return torch.from_numpy(fbank_extractor().extract(wav, 16000))


def _streaming_models(kind: str, tmp_path: Path):
    """(model, its exportable wrappers, its fp32 ONNX files in onnxruntime, fbank of 4 waveforms of other lengths)."""
    model = _emitting_model(kind)
    ex = build_exportable(model)
    files = export_transducer_onnx(ex, tmp_path, "x", int8=False)
    ort_model = OnnxRuntimeTransducer(files["encoder"], files["decoder"], files["joiner"])
    return model, ex, ort_model, [_features(wav) for wav in _waveforms()]


@pytest.mark.parametrize("kind", ["no_proj", "proj"])
def test_streaming_greedy_torch_equals_onnxruntime(kind, tmp_path):
    """Batched chunk-by-chunk greedy search: the model's streaming API (scaled and converted), onnxruntime and the
    full-utterance reference agree."""
    model, ex, ort_model, feats = _streaming_models(kind, tmp_path)  # 4 lengths: streams stop at different chunks
    want = [reference_streaming_greedy(model, f) for f in feats]
    assert streaming_search(TorchStreamingModel(model), feats) == want
    assert streaming_search(ex, feats) == want
    assert streaming_search(ort_model, feats) == want
    assert streaming_search(ex, feats[2:3]) == want[2:3]  # a batch of one
    all_tokens = sum(want, [])
    assert len(all_tokens) >= 20 and len(set(all_tokens)) >= 4
    assert len({len(f) for f in feats}) == 4 and len({tuple(w) for w in want}) == 4


@pytest.mark.parametrize("kind", ["no_proj", "proj"])
def test_streaming_modified_beam_torch_equals_onnxruntime(kind, tmp_path):
    _, ex, ort_model, feats = _streaming_models(kind, tmp_path)
    beam4 = streaming_search(ex, feats, decoding_method="modified_beam_search", beam_size=4)
    assert streaming_search(ort_model, feats, decoding_method="modified_beam_search", beam_size=4) == beam4
    assert [streaming_search(ex, [f], "modified_beam_search", 4)[0] for f in feats] == beam4  # batching
    # one hypothesis per frame is greedy search
    assert streaming_search(ex, feats, decoding_method="modified_beam_search", beam_size=1) == streaming_search(
        ex, feats
    )
    assert all(beam4)


def test_streaming_search_rejects_unknown_method():
    with pytest.raises(ValueError, match="Unsupported streaming decoding method 'fast_beam_search'"):
        streaming_search(build_exportable(_tiny("proj")), [torch.zeros(20, 80)], decoding_method="fast_beam_search")


# --------------------------------------------------------------------------
# tokens.txt and the export script
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory) -> Path:
    """A 40-piece BPE model (<blk>=0, <sos/eos>=1, <unk>=2) trained on a few made-up sentences."""
    d = tmp_path_factory.mktemp("bpe")
    words = "THE QUICK BROWN FOX JUMPS OVER LAZY DOG WHILE SEVEN WIZARDS QUIETLY HEX JUMBO FROGS".split()
    rng = np.random.default_rng(0)
    (d / "text.txt").write_text("".join(" ".join(rng.choice(words, 8)) + "\n" for _ in range(200)))
    return train_bpe_model(d / "text.txt", d / "lang", vocab_size=40)


def test_write_tokens_file(bpe_model, tmp_path):
    write_tokens_file(bpe_model, tmp_path / "tokens.txt")
    lines = (tmp_path / "tokens.txt").read_text().splitlines()
    sp = spm.SentencePieceProcessor(model_file=str(bpe_model))
    assert lines == [f"{sp.id_to_piece(i)} {i}" for i in range(40)]
    assert lines[:3] == ["<blk> 0", "<sos/eos> 1", "<unk> 2"]


def run_export(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    """export_onnx.py as a user runs it; one OpenMP thread (tiny matrices, shared 2-core machines)."""
    env = {**recipe_env(), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *argv], cwd=cwd, capture_output=True, text=True, env=env, timeout=300
    )


SIZE_FLAGS = [
    "--encoder-dim", "16", "--rnn-hidden-size", "24", "--dim-feedforward", "32",
    "--num-encoder-layers", "2", "--decoder-dim", "16", "--joiner-dim", "20",
]  # fmt: skip


def _write_epochs(exp_dir: Path, vocab_size: int) -> None:
    for epoch in (1, 2, 3):
        model = _tiny("proj", vocab_size=vocab_size, seed=10 * epoch)
        model_avg = _tiny("proj", vocab_size=vocab_size, seed=10 * epoch + 1)
        save_checkpoint(exp_dir / f"epoch-{epoch}.pt", model, model_avg, params={"batch_idx_train": 100 * epoch})


def _torch_and_onnx_outputs(state_dict: dict, out_dir: Path, suffix: str) -> tuple:
    """Encoder output of one chunk and decoder output, from ``state_dict`` in PyTorch and from the ONNX files."""
    model = tiny_transducer(vocab_size=40, rnn_hidden_size=24, **TINY)
    model.load_state_dict(state_dict)
    files = onnx_filenames(out_dir, suffix)
    runners = build_exportable(model.eval()), OnnxRuntimeTransducer(files["encoder"], files["decoder"], files["joiner"])
    x, y = _randn(2, 9, 80, seed=12), torch.tensor([[0, 0], [5, 7]])
    outputs = []
    for runner in runners:
        encoder_out, _ = runner.run_encoder(x, runner.init_states(2))
        outputs.append(torch.cat([encoder_out.flatten(), runner.run_decoder(y).flatten()]))
    return tuple(outputs)


def test_export_script_averaging_and_files(bpe_model, tmp_path):
    exp = tmp_path / "exp"
    exp.mkdir()
    _write_epochs(exp, vocab_size=40)
    base = ["--exp-dir", str(exp), "--bpe-model", str(bpe_model), *SIZE_FLAGS]

    run = run_export(tmp_path, *base, "--epoch", "3", "--avg", "2", "--use-averaged-model", "true")
    assert run.returncode == 0, run.stderr[-3000:]
    names = {p.name for p in exp.iterdir()}
    for part in ("encoder", "decoder", "joiner"):
        assert {f"{part}-epoch-3-avg-2.onnx", f"{part}-epoch-3-avg-2.int8.onnx"} <= names
    assert "tokens.txt" in names and any((exp / "log").glob("log-export-onnx-*"))
    averaged = average_checkpoints_with_averaged_model(exp / "epoch-1.pt", exp / "epoch-3.pt")
    want, got = _torch_and_onnx_outputs(averaged, exp, "epoch-3-avg-2")
    assert _max_diff(got, want) < TOL

    out = tmp_path / "out"
    flags = ["--epoch", "3", "--avg", "2", "--use-averaged-model", "false", "--int8", "false", "--output-dir", str(out)]
    run = run_export(tmp_path, *base, *flags)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [
        "decoder-epoch-3-avg-2.onnx",
        "encoder-epoch-3-avg-2.onnx",
        "joiner-epoch-3-avg-2.onnx",
        "log",
        "tokens.txt",
    ]
    assert any((out / "log").glob("log-export-onnx-*"))
    averaged = average_checkpoints([exp / "epoch-2.pt", exp / "epoch-3.pt"])
    want, got = _torch_and_onnx_outputs(averaged, out, "epoch-3-avg-2")
    assert _max_diff(got, want) < TOL
    # another average gives another model, so the comparisons above can fail
    other, _ = _torch_and_onnx_outputs(average_checkpoints([exp / "epoch-3.pt"]), out, "epoch-3-avg-2")
    assert _max_diff(other, want) > 1e-3


def test_export_script_defaults_point_at_the_trained_model():
    args = get_parser().parse_args([])
    # train.py's defaults (one home: icefall_lite/recipe_defaults.py)
    assert (args.epoch, args.iter, args.avg, args.use_averaged_model) == (NUM_EPOCHS, 0, AVG, True)
    assert args.exp_dir == EXP_DIR


def test_export_script_flag_error(bpe_model, tmp_path, capsys):
    exp = tmp_path / "exp"
    exp.mkdir()
    argv = ["--exp-dir", str(exp), "--bpe-model", str(bpe_model), *SIZE_FLAGS, "--decode-chunk-len", "6"]
    assert_flag_error(get_parser(), validate_args, argv, "--decode-chunk-len must be a positive multiple of 4", capsys)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--avg", "3", "--use-averaged-model", "true", *SIZE_FLAGS], "--avg 3 is too large for --epoch 3"),
        (["--avg", "1", "--encoder-dim", "32"], "does not fit this model"),  # the other sizes at their defaults
    ],
)
def test_export_script_checkpoint_errors_exit_before_writing(bpe_model, tmp_path, flags, message):
    exp = tmp_path / "exp"
    exp.mkdir()
    _write_epochs(exp, vocab_size=40)
    run = run_export(tmp_path, "--exp-dir", str(exp), "--bpe-model", str(bpe_model), "--epoch", "3", *flags)
    assert run.returncode == 1, run.stderr[-3000:]
    assert "export_onnx.py: error:" in run.stderr and message in run.stderr
    assert "Traceback" not in run.stderr
    assert not list(exp.glob("*.onnx"))


# --------------------------------------------------------------------------
# sherpa-onnx
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sherpa_exports(bpe_model, tmp_path_factory) -> dict:
    """kind -> (exportable, files, tokens.txt) of :func:`_emitting_model` over the 40-piece BPE."""
    exports = {}
    for kind in HIDDEN:
        d = tmp_path_factory.mktemp(f"sherpa-{kind}")
        ex = build_exportable(_emitting_model(kind))
        files = export_transducer_onnx(ex, d, "epoch-1-avg-1", int8=kind == "proj")
        write_tokens_file(bpe_model, d / "tokens.txt")
        exports[kind] = (ex, files, d / "tokens.txt")
    return exports


def _sherpa_decode(files, tokens: Path, wav: np.ndarray, method: str, paths: int = 4, int8: bool = False, **kw):
    """(number of encoder calls, token ids, text) from sherpa-onnx's OnlineRecognizer."""
    k = ".int8" if int8 else ""
    recognizer = sherpa_onnx.OnlineRecognizer.from_transducer(
        tokens=str(tokens), encoder=str(files["encoder" + k]), decoder=str(files["decoder" + k]),
        joiner=str(files["joiner" + k]), num_threads=1, decoding_method=method, max_active_paths=paths, **kw,
    )  # fmt: skip
    stream = recognizer.create_stream()
    stream.accept_waveform(16000, wav)
    stream.input_finished()
    calls = 0
    while recognizer.is_ready(stream):
        recognizer.decode_stream(stream)
        calls += 1
    result = recognizer.get_result_all(stream)
    # sherpa-onnx shows the sentencepiece word boundary "▁" as a space
    ids = {line.split()[0].replace("\u2581", " "): int(line.split()[1]) for line in tokens.read_text().splitlines()}
    return calls, [ids[t] for t in result.tokens], result.text


@pytest.mark.parametrize("kind", ["no_proj", "proj"])
def test_sherpa_onnx_greedy_equals_pytorch_streaming_greedy(sherpa_exports, kind):
    ex, files, tokens = sherpa_exports[kind]
    all_tokens = []
    for wav in _waveforms():
        feats = _features(wav)
        want = streaming_search(ex, [feats], unk_id=2)[0]  # sherpa-onnx treats <unk> as blank
        calls, got, text = _sherpa_decode(files, tokens, wav, "greedy_search")
        assert calls == len(chunk_starts(feats.size(0), 9, 4))
        assert got == want
        assert text.strip() and len(got) < calls  # some tokens, some blanks
        all_tokens += got
    assert len(set(all_tokens)) >= 4


def test_sherpa_onnx_treats_unk_as_blank(bpe_model, tmp_path):
    model = _emitting_model("proj")
    with torch.no_grad():  # make <unk> (id 2) win on some frames
        out = model.joiner.output_linear
        out.bias[2] += 4.0 / out.bias_scale.exp()
    ex = build_exportable(model)
    files = export_transducer_onnx(ex, tmp_path, "x", int8=False)
    write_tokens_file(bpe_model, tmp_path / "tokens.txt")
    unk_matters = False
    for wav in _waveforms()[:2]:
        feats = _features(wav)
        want = streaming_search(ex, [feats], unk_id=2)[0]
        unk_as_token = [t for t in streaming_search(ex, [feats])[0] if t != 2]
        unk_matters |= unk_as_token != want
        assert _sherpa_decode(files, tmp_path / "tokens.txt", wav, "greedy_search")[1] == want
    assert unk_matters


def test_sherpa_onnx_modified_beam_search_and_int8_run(sherpa_exports):
    ex, files, tokens = sherpa_exports["proj"]
    wav = _waveforms()[0]
    _, greedy, _ = _sherpa_decode(files, tokens, wav, "greedy_search")
    # with one active path, modified beam search makes greedy's choices
    _, beam1, _ = _sherpa_decode(files, tokens, wav, "modified_beam_search", paths=1)
    assert beam1 == greedy
    calls, beam4, text = _sherpa_decode(files, tokens, wav, "modified_beam_search", paths=4)
    assert calls == 36 and beam4 and text.strip()
    assert beam4 == streaming_search(ex, [_features(wav)], "modified_beam_search", beam_size=4, unk_id=2)[0]
    for method in ("greedy_search", "modified_beam_search"):
        calls, ids, text = _sherpa_decode(files, tokens, wav, method, int8=True)
        assert calls == 36 and ids and text.strip()


def test_sherpa_onnx_feature_settings_matter(sherpa_exports):
    """Guard of the front-end match above: other fbank settings in sherpa-onnx change the tokens."""
    ex, files, tokens = sherpa_exports["proj"]
    wav = _waveforms()[0]
    _, want, _ = _sherpa_decode(files, tokens, wav, "greedy_search")
    assert _sherpa_decode(files, tokens, wav, "greedy_search", snip_edges=True)[1] != want
    assert _sherpa_decode(files, tokens, wav, "greedy_search", high_freq=0.0)[1] != want
