"""Export a trained :class:`~icefall_lite.nn.model.Transducer` in sherpa-onnx's streaming LSTM format.

As icefall's ``lstm_transducer_stateless2/export-onnx.py`` (our own code):

1. :func:`~icefall_lite.export.scaling_converter.convert_scaled_to_non_scaled`
   replaces the scaled modules by plain ones.
2. Three wrappers over the model's streaming API (``streaming_forward``,
   ``predict``, ``join``) with the signatures sherpa-onnx's
   ``OnlineLstmTransducerModel`` calls (only the batch dimension ``N`` is dynamic):

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
chunk by chunk as sherpa-onnx does, with the PyTorch model (converted here:
:class:`ExportableTransducer`) or the ONNX files
(:class:`~icefall_lite.export.onnx_runtime.OnnxRuntimeTransducer`).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from pathlib import Path
from typing import Dict, Iterator, List, Sequence, Tuple, Union

import onnx
import torch
import torch.nn as nn
from onnxruntime.quantization import QuantType, quantize_dynamic
from torch import Tensor

from icefall_lite.data.bpe import load_bpe_model, write_tokens
from icefall_lite.decoding.constants import DEFAULT_DECODE_CHUNK_LEN
from icefall_lite.decoding.streaming import TorchStreamingModel
from icefall_lite.export.scaling_converter import convert_scaled_to_non_scaled
from icefall_lite.nn.model import Transducer
from icefall_lite.utils import atomic_output

PathLike = Union[str, Path]

OPSET_VERSION = 13
# Dynamic int8 quantisation, as icefall: MatMul everywhere, the decoder's
# embedding (Gather) too, and the ONNX LSTM op of layers without projection.
INT8_OP_TYPES = {
    "encoder": ["MatMul", "LSTM"],
    "decoder": ["MatMul", "Gather"],
    "joiner": ["MatMul"],
}


# --------------------------------------------------------------------------
# Streaming wrappers
# --------------------------------------------------------------------------


class StreamingEncoder(nn.Module):
    """``(x (N, T, F), h (L, N, d_model), c (L, N, rnn_hidden))
    -> (encoder_out (N, T', joiner_dim), next_h, next_c)`` (the model's ``streaming_forward``)."""

    def __init__(self, model: Transducer) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor, h: Tensor, c: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        encoder_out, (next_h, next_c) = self.model.streaming_forward(x, (h, c))
        return encoder_out, next_h, next_c


class StreamingDecoder(nn.Module):
    """``y int64 (N, context_size) -> decoder_out (N, joiner_dim)`` (the model's ``predict``)."""

    def __init__(self, model: Transducer) -> None:
        super().__init__()
        self.model = model

    def forward(self, y: Tensor) -> Tensor:
        return self.model.predict(y)


class StreamingJoiner(nn.Module):
    """``(encoder_out (N, joiner_dim), decoder_out (N, joiner_dim)) -> logit (N, vocab_size)`` (``join``)."""

    def __init__(self, model: Transducer) -> None:
        super().__init__()
        self.model = model

    def forward(self, encoder_out: Tensor, decoder_out: Tensor) -> Tensor:
        return self.model.join(encoder_out, decoder_out)


class ExportableTransducer(TorchStreamingModel):
    """A converted (plain-module) Transducer: the streaming interface plus the three modules to export.

    ``init_states``/``run_*``/``meta`` are :class:`~icefall_lite.decoding.streaming.TorchStreamingModel`'s;
    ``encoder``/``decoder``/``joiner`` are the wrappers written to ONNX.
    """

    def __init__(self, plain_model: Transducer, decode_chunk_len: int = DEFAULT_DECODE_CHUNK_LEN) -> None:
        super().__init__(plain_model, decode_chunk_len)
        self.encoder = StreamingEncoder(plain_model)
        self.decoder = StreamingDecoder(plain_model)
        self.joiner = StreamingJoiner(plain_model)


def build_exportable(model: Transducer, decode_chunk_len: int = DEFAULT_DECODE_CHUNK_LEN) -> ExportableTransducer:
    """Convert ``model`` (left untouched) into :class:`ExportableTransducer`, on the model's device.

    Args:
      decode_chunk_len: feature frames between chunks; a positive multiple of 4.
        Each encoder call sees ``T = decode_chunk_len + 5`` frames.
    """
    return ExportableTransducer(convert_scaled_to_non_scaled(model), decode_chunk_len).eval()


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
    x = torch.zeros(1, meta.T, exportable.model.encoder.num_features, device=h.device)
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


__all__ = [
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
]
