"""Export a trained :class:`~icefall_lite.nn.model.Transducer` in sherpa-onnx's streaming LSTM format.

As icefall's ``lstm_transducer_stateless2/export-onnx.py`` (our own code):

1. :func:`convert_scaled_to_non_scaled` folds every ``Scaled*`` log-scale into
   plain weights, turns :class:`~icefall_lite.nn.scaling.BasicNorm` into a
   non-learned :class:`NonScaledBasicNorm` and the activation balancers into
   ``nn.Identity`` (the GradientFilter lives inside ScaledLSTM and disappears
   with it). A ScaledLSTM without projection becomes a plain ``nn.LSTM``
   (exported as the ONNX ``LSTM`` op); one with projection becomes
   :class:`LSTMP`, explicit gate math, because the TorchScript ONNX exporter
   refuses ``nn.LSTM(proj_size>0)``.
2. Three wrappers with the signatures sherpa-onnx's ``OnlineLstmTransducerModel``
   calls (only the batch dimension ``N`` is dynamic):

   - encoder ``(x (N, T, 80), h (L, N, d_model), c (L, N, rnn_hidden_size))
     -> (encoder_out (N, T', joiner_dim), next_h, next_c)``, ``encoder_out``
     after ``joiner.encoder_proj``; ``T = decode_chunk_len + 5`` feature frames
     give ``T' = decode_chunk_len / 4`` output frames (default 4 and 9: one
     frame per chunk);
   - decoder ``y int64 (N, context_size) -> decoder_out (N, joiner_dim)``
     after ``joiner.decoder_proj``;
   - joiner ``(encoder_out (N, joiner_dim), decoder_out (N, joiner_dim))
     -> logit (N, vocab_size)``.
3. :func:`export_transducer_onnx` writes ``encoder/decoder/joiner-<suffix>.onnx``
   (opset 13, TorchScript exporter) with the metadata sherpa-onnx reads, and
   optionally ``*.int8.onnx`` (dynamic int8 quantisation).

Output frame ``p`` of ``Conv2dSubsampling`` depends on input frames
``[4p, 4p + 9)`` only, so feeding windows of ``T`` frames every
``decode_chunk_len`` frames while carrying the LSTM states reproduces the
full-utterance encoder output exactly. :mod:`icefall_lite.decoding.streaming` decodes
chunk by chunk as sherpa-onnx does, with either the PyTorch wrappers
(:class:`ExportableTransducer`) or the ONNX files (:class:`OnnxRuntimeTransducer`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.nn as nn
from onnxruntime.quantization import QuantType, quantize_dynamic
from torch import Tensor

from icefall_lite.data.bpe import load_bpe_model, write_tokens
from icefall_lite.nn.encoder import RNNEncoder
from icefall_lite.nn.model import Transducer
from icefall_lite.utils import atomic_output
from icefall_lite.nn.scaling import (
    ActivationBalancer,
    BasicNorm,
    ScaledConv1d,
    ScaledConv2d,
    ScaledEmbedding,
    ScaledLinear,
    ScaledLSTM,
)

PathLike = Union[str, Path]
EncoderStates = Tuple[Tensor, Tensor]

OPSET_VERSION = 13
# Conv2dSubsampling: output frame p needs input frames [4p, 4p + 9), so a
# window of decode_chunk_len + 5 frames gives decode_chunk_len / 4 outputs.
SUBSAMPLING_FACTOR = 4
SUBSAMPLING_EXTRA_FRAMES = 5
DEFAULT_DECODE_CHUNK_LEN = 4
MODEL_AUTHOR = "icefall-lite"
# Dynamic int8 quantisation, as icefall: MatMul everywhere, the decoder's
# embedding (Gather) too, and the ONNX LSTM op of layers without projection.
INT8_OP_TYPES = {
    "encoder": ["MatMul", "LSTM"],
    "decoder": ["MatMul", "Gather"],
    "joiner": ["MatMul"],
}


# --------------------------------------------------------------------------
# Non-scaled modules
# --------------------------------------------------------------------------


class LSTMP(nn.Module):
    """One-layer unidirectional LSTM with optional projection, written with plain ops.

    Same maths and flat-weight layout as ``nn.LSTM`` (gates ``i, f, g, o``)::

        gates = x W_ih^T + b_ih + h W_hh^T + b_hh
        c' = sigmoid(f) * c + sigmoid(i) * tanh(g)
        h' = (sigmoid(o) * tanh(c')) W_hr^T        # W_hr only with projection

    Args:
      weight_ih: (4 * hidden, input_size).
      weight_hh: (4 * hidden, proj_size or hidden).
      bias: (4 * hidden,) = b_ih + b_hh.
      weight_hr: (proj_size, hidden) or None.
    """

    def __init__(self, weight_ih: Tensor, weight_hh: Tensor, bias: Tensor, weight_hr: Optional[Tensor]) -> None:
        super().__init__()
        self.hidden_size = weight_ih.size(0) // 4
        self.weight_ih = nn.Parameter(weight_ih.detach().clone())
        self.weight_hh = nn.Parameter(weight_hh.detach().clone())
        self.bias = nn.Parameter(bias.detach().clone())
        self.weight_hr = None if weight_hr is None else nn.Parameter(weight_hr.detach().clone())

    def forward(self, input: Tensor, hx: Optional[EncoderStates] = None) -> Tuple[Tensor, EncoderStates]:
        """
        Args:
          input: (T, N, input_size).
          hx: (h (1, N, proj_size or hidden), c (1, N, hidden)); zeros when None.
        Returns:
          output (T, N, proj_size or hidden) and (h (1, N, .), c (1, N, hidden)).
        """
        if hx is None:
            out_size = self.hidden_size if self.weight_hr is None else self.weight_hr.size(0)
            hx = (input.new_zeros(1, input.size(1), out_size), input.new_zeros(1, input.size(1), self.hidden_size))
        h, c = hx[0][0], hx[1][0]
        x_gates = torch.matmul(input, self.weight_ih.t()) + self.bias  # (T, N, 4 * hidden)
        outputs: List[Tensor] = []
        for t in range(input.size(0)):
            gates = x_gates[t] + torch.matmul(h, self.weight_hh.t())
            i, f, g, o = gates.chunk(4, dim=-1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            if self.weight_hr is not None:
                h = torch.matmul(h, self.weight_hr.t())
            outputs.append(h)
        return torch.stack(outputs, dim=0), (h.unsqueeze(0), c.unsqueeze(0))


class NonScaledBasicNorm(nn.Module):
    """:class:`~icefall_lite.nn.scaling.BasicNorm` with its ``eps`` frozen to a constant.

    ``y = x * (mean_c(x^2) + eps) ** -0.5`` over ``channel_dim``.
    """

    def __init__(self, channel_dim: int, eps: float) -> None:
        super().__init__()
        self.channel_dim = channel_dim
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """(..., C, ...) -> same shape."""
        return x * torch.rsqrt(x.square().mean(dim=self.channel_dim, keepdim=True) + self.eps)

    def extra_repr(self) -> str:
        return f"channel_dim={self.channel_dim}, eps={self.eps}"


def _factory(weight: Tensor) -> Dict[str, object]:
    return {"device": weight.device, "dtype": weight.dtype}


@torch.no_grad()
def _plain_linear(m: ScaledLinear) -> nn.Linear:
    out = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, **_factory(m.weight))
    out.weight.copy_(m.get_weight())
    if m.bias is not None:
        out.bias.copy_(m.get_bias())
    return out


@torch.no_grad()
def _plain_conv(m: Union[ScaledConv1d, ScaledConv2d]) -> Union[nn.Conv1d, nn.Conv2d]:
    cls = nn.Conv1d if isinstance(m, ScaledConv1d) else nn.Conv2d
    out = cls(
        m.in_channels,
        m.out_channels,
        m.kernel_size,
        stride=m.stride,
        padding=m.padding,
        dilation=m.dilation,
        groups=m.groups,
        bias=m.bias is not None,
        padding_mode=m.padding_mode,
        **_factory(m.weight),
    )
    out.weight.copy_(m.get_weight())
    if m.bias is not None:
        out.bias.copy_(m.get_bias())
    return out


@torch.no_grad()
def _plain_embedding(m: ScaledEmbedding) -> nn.Embedding:
    out = nn.Embedding(m.num_embeddings, m.embedding_dim, padding_idx=m.padding_idx, **_factory(m.weight))
    out.weight.copy_(m.weight * m.scale.exp())
    return out


@torch.no_grad()
def _plain_lstm(m: ScaledLSTM) -> nn.Module:
    """ScaledLSTM -> ``nn.LSTM`` (no projection) or :class:`LSTMP` (projection), scales folded in."""
    weights = dict(zip(m._flat_weights_names, m._flat_scaled_weights()))
    if m.proj_size == 0:
        out = nn.LSTM(m.input_size, m.hidden_size, num_layers=m.num_layers, bias=m.bias, **_factory(m.weight_ih_l0))
        for name, value in weights.items():
            getattr(out, name).copy_(value)
        out.flatten_parameters()
        return out
    if m.num_layers != 1:
        raise ValueError(f"LSTMP conversion supports one layer per ScaledLSTM, got num_layers={m.num_layers}")
    if m.bias:
        bias = weights["bias_ih_l0"] + weights["bias_hh_l0"]
    else:
        bias = weights["weight_ih_l0"].new_zeros(4 * m.hidden_size)
    return LSTMP(weights["weight_ih_l0"], weights["weight_hh_l0"], bias, weights["weight_hr_l0"])


def _plain_module(m: nn.Module) -> Optional[nn.Module]:
    """The exportable replacement of one module, or None to keep it (and look inside it)."""
    if isinstance(m, ScaledLSTM):
        return _plain_lstm(m)
    if isinstance(m, ScaledLinear):
        return _plain_linear(m)
    if isinstance(m, (ScaledConv1d, ScaledConv2d)):
        return _plain_conv(m)
    if isinstance(m, ScaledEmbedding):
        return _plain_embedding(m)
    if isinstance(m, BasicNorm):
        return NonScaledBasicNorm(m.channel_dim, float(m.eps.detach().exp()))
    if isinstance(m, ActivationBalancer):
        return nn.Identity()
    return None


def _replace_children(module: nn.Module) -> None:
    for name, child in module.named_children():
        replacement = _plain_module(child)
        if replacement is None:
            _replace_children(child)
        else:
            setattr(module, name, replacement)


def convert_scaled_to_non_scaled(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` in eval mode with every scaled module replaced (see the module doc).

    The copy computes the same function as ``model.eval()``; ``model`` itself is untouched.
    """
    converted = copy.deepcopy(model)
    replacement = _plain_module(converted)
    if replacement is not None:
        converted = replacement
    else:
        _replace_children(converted)
    return converted.eval()


# --------------------------------------------------------------------------
# Streaming wrappers
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamingMeta:
    """Sizes that sherpa-onnx reads from the ONNX metadata (and the chunking they imply)."""

    num_encoder_layers: int
    d_model: int
    rnn_hidden_size: int
    decode_chunk_len: int
    T: int
    vocab_size: int
    context_size: int
    joiner_dim: int

    def encoder_metadata(self) -> Dict[str, str]:
        """Key/values of the encoder model (``model_type=lstm`` is what selects the LSTM code in sherpa-onnx)."""
        return {
            "model_type": "lstm",
            "version": "1",
            "model_author": MODEL_AUTHOR,
            "decode_chunk_len": str(self.decode_chunk_len),
            "T": str(self.T),
            "num_encoder_layers": str(self.num_encoder_layers),
            "d_model": str(self.d_model),
            "rnn_hidden_size": str(self.rnn_hidden_size),
        }

    def decoder_metadata(self) -> Dict[str, str]:
        return {"vocab_size": str(self.vocab_size), "context_size": str(self.context_size)}

    def joiner_metadata(self) -> Dict[str, str]:
        return {"joiner_dim": str(self.joiner_dim)}

    @classmethod
    def from_metadata(cls, encoder: Dict[str, str], decoder: Dict[str, str], joiner: Dict[str, str]) -> "StreamingMeta":
        """Inverse of the three ``*_metadata`` methods."""
        merged = {**encoder, **decoder, **joiner}
        return cls(**{name: int(merged[name]) for name in cls.__dataclass_fields__})


class StreamingEncoder(nn.Module):
    """``(x (N, T, F), h (L, N, d_model), c (L, N, rnn_hidden)) -> (encoder_out (N, T', joiner_dim), next_h, next_c)``.

    ``encoder`` and ``encoder_proj`` should already be converted
    (:func:`convert_scaled_to_non_scaled`) for export; the wrapper itself
    works with the originals too.
    """

    def __init__(self, encoder: RNNEncoder, encoder_proj: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        self.encoder_proj = encoder_proj

    @property
    def num_features(self) -> int:
        return self.encoder.num_features

    def forward(self, x: Tensor, h: Tensor, c: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        x_lens = torch.full((x.size(0),), x.size(1), dtype=torch.int64, device=x.device)
        encoder_out, _, (next_h, next_c) = self.encoder(x, x_lens, (h, c))
        return self.encoder_proj(encoder_out), next_h, next_c


class StreamingDecoder(nn.Module):
    """``y int64 (N, context_size) -> decoder_out (N, joiner_dim)`` (decoder then ``decoder_proj``)."""

    def __init__(self, decoder: nn.Module, decoder_proj: nn.Module) -> None:
        super().__init__()
        self.decoder = decoder
        self.decoder_proj = decoder_proj

    def forward(self, y: Tensor) -> Tensor:
        return self.decoder_proj(self.decoder(y, need_pad=False).squeeze(1))


class StreamingJoiner(nn.Module):
    """``(encoder_out (N, joiner_dim), decoder_out (N, joiner_dim)) -> logit (N, vocab_size)``."""

    def __init__(self, output_linear: nn.Module) -> None:
        super().__init__()
        self.output_linear = output_linear

    def forward(self, encoder_out: Tensor, decoder_out: Tensor) -> Tensor:
        return self.output_linear(torch.tanh(encoder_out + decoder_out))


class ExportableTransducer(nn.Module):
    """The three exportable wrappers of one Transducer plus their :class:`StreamingMeta`.

    ``run_encoder``/``run_decoder``/``run_joiner``/``init_states`` are the
    interface :func:`icefall_lite.decoding.streaming.streaming_search` uses; :class:`OnnxRuntimeTransducer`
    has the same one.
    """

    def __init__(
        self, encoder: StreamingEncoder, decoder: StreamingDecoder, joiner: StreamingJoiner, meta: StreamingMeta
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.joiner = joiner
        self.meta = meta

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def init_states(self, batch_size: int = 1) -> EncoderStates:
        """Zeros: h (L, N, d_model), c (L, N, rnn_hidden_size), on the model's device."""
        m, device = self.meta, self.device
        return (
            torch.zeros(m.num_encoder_layers, batch_size, m.d_model, device=device),
            torch.zeros(m.num_encoder_layers, batch_size, m.rnn_hidden_size, device=device),
        )

    @torch.no_grad()
    def run_encoder(self, x: Tensor, states: EncoderStates) -> Tuple[Tensor, EncoderStates]:
        """x (N, T, F) -> encoder_out (N, T', joiner_dim), next states."""
        out, h, c = self.encoder(x.to(self.device), *states)
        return out, (h, c)

    @torch.no_grad()
    def run_decoder(self, y: Tensor) -> Tensor:
        """y (N, context_size) -> (N, joiner_dim)."""
        return self.decoder(y.to(self.device, torch.int64))

    @torch.no_grad()
    def run_joiner(self, encoder_out: Tensor, decoder_out: Tensor) -> Tensor:
        """(N, joiner_dim), (N, joiner_dim) -> logit (N, vocab_size)."""
        return self.joiner(encoder_out, decoder_out)


def build_exportable(model: Transducer, decode_chunk_len: int = DEFAULT_DECODE_CHUNK_LEN) -> ExportableTransducer:
    """Convert ``model`` (left untouched) into :class:`ExportableTransducer`, on the model's device.

    Args:
      decode_chunk_len: feature frames between chunks; a positive multiple of 4.
        Each encoder call sees ``T = decode_chunk_len + 5`` frames.
    """
    if decode_chunk_len <= 0 or decode_chunk_len % SUBSAMPLING_FACTOR != 0:
        raise ValueError(
            f"decode_chunk_len must be a positive multiple of {SUBSAMPLING_FACTOR}, got {decode_chunk_len}"
        )
    plain = convert_scaled_to_non_scaled(model)
    encoder: RNNEncoder = plain.encoder
    meta = StreamingMeta(
        num_encoder_layers=encoder.num_layers,
        d_model=encoder.d_model,
        rnn_hidden_size=encoder.rnn_hidden_size,
        decode_chunk_len=decode_chunk_len,
        T=decode_chunk_len + SUBSAMPLING_EXTRA_FRAMES,
        vocab_size=plain.decoder.vocab_size,
        context_size=plain.decoder.context_size,
        joiner_dim=plain.joiner.output_linear.in_features,
    )
    return ExportableTransducer(
        StreamingEncoder(encoder, plain.joiner.encoder_proj),
        StreamingDecoder(plain.decoder, plain.joiner.decoder_proj),
        StreamingJoiner(plain.joiner.output_linear),
        meta,
    ).eval()


# --------------------------------------------------------------------------
# ONNX files
# --------------------------------------------------------------------------


def _set_meta_data(model: onnx.ModelProto, meta_data: Dict[str, str]) -> None:
    existing = {p.key: p for p in model.metadata_props}
    for key, value in meta_data.items():
        prop = existing.get(key) or model.metadata_props.add()
        prop.key, prop.value = key, str(value)


def _declare_output_shapes(model: onnx.ModelProto, shapes: Dict[str, List[Union[int, str]]]) -> None:
    """Write the output shapes into the graph (the exporter leaves some static sizes symbolic)."""
    for output in model.graph.output:
        for dim, size in zip(output.type.tensor_type.shape.dim, shapes[output.name]):
            if isinstance(size, str):
                dim.dim_param = size
            else:
                dim.dim_value = size


def read_meta_data(filename: PathLike) -> Dict[str, str]:
    """The ``metadata_props`` of an ONNX file as a dict."""
    return {p.key: p.value for p in onnx.load(str(filename), load_external_data=False).metadata_props}


def _export(
    module: nn.Module,
    args: Tuple[Tensor, ...],
    filename: Path,
    input_names: List[str],
    output_names: List[str],
    dynamic_axes: Dict[str, Dict[int, str]],
    meta_data: Dict[str, str],
) -> None:
    """``torch.onnx.export`` (TorchScript exporter) to a temporary name, declare the output shapes
    (static but for ``dynamic_axes``), add metadata, rename."""
    with atomic_output(filename) as tmp, torch.no_grad(), warnings.catch_warnings():
        # The decoder's context-size check is a Python bool of a fixed shape: constant in the trace, as intended.
        warnings.simplefilter("ignore", category=torch.jit.TracerWarning)
        # nn.LSTM's batch-size warning: its remedy (h0/c0 as model inputs) is what the encoder does.
        warnings.filterwarnings("ignore", message="Exporting a model to ONNX with a batch_size other than 1")
        torch.onnx.export(
            module,
            args,
            str(tmp),
            dynamo=False,
            opset_version=OPSET_VERSION,
            input_names=input_names,
            output_names=output_names,
            dynamic_axes=dynamic_axes,
        )
        outputs = module(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        shapes = {
            name: [dynamic_axes.get(name, {}).get(axis, size) for axis, size in enumerate(out.shape)]
            for name, out in zip(output_names, outputs)
        }
        model = onnx.load(str(tmp))
        _declare_output_shapes(model, shapes)
        _set_meta_data(model, meta_data)
        onnx.checker.check_model(model)
        onnx.save(model, str(tmp))
    logging.info(f"Exported {filename}")


def export_encoder_onnx(exportable: ExportableTransducer, filename: PathLike) -> None:
    """Encoder ``x (N, T, F), h, c -> encoder_out, next_h, next_c`` with the LSTM metadata."""
    meta = exportable.meta
    h, c = exportable.init_states(batch_size=1)
    x = torch.zeros(1, meta.T, exportable.encoder.num_features, device=h.device)
    _export(
        exportable.encoder,
        (x, h, c),
        Path(filename),
        input_names=["x", "h", "c"],
        output_names=["encoder_out", "next_h", "next_c"],
        dynamic_axes={
            "x": {0: "N"},
            "h": {1: "N"},
            "c": {1: "N"},
            "encoder_out": {0: "N"},
            "next_h": {1: "N"},
            "next_c": {1: "N"},
        },
        meta_data=meta.encoder_metadata(),
    )


def export_decoder_onnx(exportable: ExportableTransducer, filename: PathLike) -> None:
    """Decoder ``y int64 (N, context_size) -> decoder_out (N, joiner_dim)``."""
    meta = exportable.meta
    y = torch.zeros(1, meta.context_size, dtype=torch.int64, device=exportable.device)
    _export(
        exportable.decoder,
        (y,),
        Path(filename),
        input_names=["y"],
        output_names=["decoder_out"],
        dynamic_axes={"y": {0: "N"}, "decoder_out": {0: "N"}},
        meta_data=meta.decoder_metadata(),
    )


def export_joiner_onnx(exportable: ExportableTransducer, filename: PathLike) -> None:
    """Joiner ``encoder_out (N, joiner_dim), decoder_out (N, joiner_dim) -> logit (N, vocab_size)``."""
    meta = exportable.meta
    e = torch.zeros(1, meta.joiner_dim, device=exportable.device)
    _export(
        exportable.joiner,
        (e, e.clone()),
        Path(filename),
        input_names=["encoder_out", "decoder_out"],
        output_names=["logit"],
        dynamic_axes={"encoder_out": {0: "N"}, "decoder_out": {0: "N"}, "logit": {0: "N"}},
        meta_data=meta.joiner_metadata(),
    )


class _DropMessages(logging.Filter):
    def __init__(self, prefixes: Tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


@contextlib.contextmanager
def _without_log_messages(prefixes: Tuple[str, ...]) -> Iterator[None]:
    """Drop records logged on the root logger whose message starts with one of ``prefixes``, for the duration."""
    dropper = _DropMessages(prefixes)
    root = logging.getLogger()
    root.addFilter(dropper)
    try:
        yield
    finally:
        root.removeFilter(dropper)


# onnxruntime's quantizer logs these on the root logger for every model (not
# run through its optional pre-processing, which icefall does not run either)
# and for every tensor it quantises dynamically.
_QUANTIZER_CHATTER = (
    "Please consider to run pre-processing before quantization",
    "Quantization parameters for tensor",
)


def quantize_int8(src: PathLike, dst: PathLike, op_types: Sequence[str]) -> None:
    """onnxruntime dynamic quantisation (int8 weights) of ``op_types``; metadata is kept."""
    with atomic_output(dst) as tmp, _without_log_messages(_QUANTIZER_CHATTER):
        quantize_dynamic(
            model_input=str(src),
            model_output=str(tmp),
            op_types_to_quantize=list(op_types),
            weight_type=QuantType.QInt8,
        )
    logging.info(f"Quantised {src} -> {dst}")


def onnx_filenames(out_dir: PathLike, suffix: str, int8: bool = False) -> Dict[str, Path]:
    """``{"encoder": out_dir/encoder-<suffix>[.int8].onnx, "decoder": ..., "joiner": ...}``."""
    ext = ".int8.onnx" if int8 else ".onnx"
    return {part: Path(out_dir) / f"{part}-{suffix}{ext}" for part in ("encoder", "decoder", "joiner")}


def export_transducer_onnx(
    exportable: ExportableTransducer, out_dir: PathLike, suffix: str, int8: bool = True
) -> Dict[str, Path]:
    """Write the fp32 encoder/decoder/joiner files (and, with ``int8``, the ``*.int8.onnx`` ones).

    Returns:
      ``{"encoder": path, ..., "encoder.int8": path, ...}`` of the files written.
    """
    fp32 = onnx_filenames(out_dir, suffix)
    export_encoder_onnx(exportable, fp32["encoder"])
    export_decoder_onnx(exportable, fp32["decoder"])
    export_joiner_onnx(exportable, fp32["joiner"])
    written: Dict[str, Path] = dict(fp32)
    if int8:
        for part, dst in onnx_filenames(out_dir, suffix, int8=True).items():
            quantize_int8(fp32[part], dst, INT8_OP_TYPES[part])
            written[f"{part}.int8"] = dst
    return written


def write_tokens_file(bpe_model: PathLike, filename: PathLike) -> None:
    """``tokens.txt`` (``<piece> <id>`` per line, as icefall) from a sentencepiece model."""
    write_tokens(load_bpe_model(Path(bpe_model)), Path(filename))


# --------------------------------------------------------------------------
# Running the ONNX files
# --------------------------------------------------------------------------


class OnnxRuntimeTransducer:
    """The exported encoder/decoder/joiner run with onnxruntime, with :class:`ExportableTransducer`'s interface.

    Takes torch tensors on any device and returns CPU tensors; sizes come from
    the files' metadata. ``providers``: onnxruntime execution providers (default:
    all that the installed onnxruntime has, best first).
    """

    def __init__(
        self,
        encoder: PathLike,
        decoder: PathLike,
        joiner: PathLike,
        num_threads: int = 1,
        providers: Optional[Sequence[str]] = None,
    ) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = num_threads
        options.inter_op_num_threads = num_threads
        providers = list(providers or ort.get_available_providers())
        self.encoder, self.decoder, self.joiner = (
            ort.InferenceSession(str(f), sess_options=options, providers=providers) for f in (encoder, decoder, joiner)
        )
        self.meta = StreamingMeta.from_metadata(
            *(s.get_modelmeta().custom_metadata_map for s in (self.encoder, self.decoder, self.joiner))
        )

    def init_states(self, batch_size: int = 1) -> EncoderStates:
        """Zeros: h (L, N, d_model), c (L, N, rnn_hidden_size)."""
        m = self.meta
        return (
            torch.zeros(m.num_encoder_layers, batch_size, m.d_model),
            torch.zeros(m.num_encoder_layers, batch_size, m.rnn_hidden_size),
        )

    @staticmethod
    def _run(session: ort.InferenceSession, *inputs: Tensor) -> List[Tensor]:
        feeds = {i.name: t.detach().cpu().numpy() for i, t in zip(session.get_inputs(), inputs)}
        return [torch.from_numpy(np.asarray(o)) for o in session.run(None, feeds)]

    def run_encoder(self, x: Tensor, states: EncoderStates) -> Tuple[Tensor, EncoderStates]:
        """x (N, T, F) -> encoder_out (N, T', joiner_dim), next states."""
        out, h, c = self._run(self.encoder, x.float(), states[0], states[1])
        return out, (h, c)

    def run_decoder(self, y: Tensor) -> Tensor:
        """y (N, context_size) -> (N, joiner_dim)."""
        return self._run(self.decoder, y.to(torch.int64))[0]

    def run_joiner(self, encoder_out: Tensor, decoder_out: Tensor) -> Tensor:
        """(N, joiner_dim), (N, joiner_dim) -> logit (N, vocab_size)."""
        return self._run(self.joiner, encoder_out, decoder_out)[0]


def max_abs_diff(a: Tensor, b: Tensor) -> float:
    """``max |a - b|`` as a float (0 for empty tensors)."""
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


__all__ = [
    "LSTMP",
    "NonScaledBasicNorm",
    "convert_scaled_to_non_scaled",
    "StreamingMeta",
    "StreamingEncoder",
    "StreamingDecoder",
    "StreamingJoiner",
    "ExportableTransducer",
    "build_exportable",
    "read_meta_data",
    "export_encoder_onnx",
    "export_decoder_onnx",
    "export_joiner_onnx",
    "quantize_int8",
    "onnx_filenames",
    "export_transducer_onnx",
    "write_tokens_file",
    "OnnxRuntimeTransducer",
    "max_abs_diff",
]
