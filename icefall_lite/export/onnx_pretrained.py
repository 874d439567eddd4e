"""onnx_pretrained.py's library: its flags and the decoding of sound files with export_onnx.py's files in
onnxruntime, as sherpa-onnx decodes them (no PyTorch model code).

The features are sherpa-onnx's: lhotse's fbank (kaldi-native-fbank's settings)
of the waveform with :func:`~icefall_lite.export.sherpa.tail_padding`'s 0.35 s
of zeros appended, mel energies floored at float32 epsilon as kaldi-native-fbank
floors them (lhotse: 1e-10). The encoder runs sherpa-onnx's windows (the files'
``T`` frames every ``decode_chunk_len``, :func:`~icefall_lite.decoding.streaming.chunk_starts`),
the search starts from sherpa-onnx's context and treats ``<unk>`` as blank. Files
up to ``--max-duration`` are decoded side by side
(:func:`~icefall_lite.decoding.streaming.streaming_search`); a longer one block by
block in bounded memory (:func:`~icefall_lite.decoding.chunked.chunked_search`,
the same windows, so the same text).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from icefall_lite.data.audio import SAMPLE_RATE, audio_blocks
from icefall_lite.data.fbank_stream import FbankStream
from icefall_lite.data.features import fbank_extractor
from icefall_lite.decoding.chunked import chunked_search
from icefall_lite.decoding.constants import STREAMING_METHODS
from icefall_lite.decoding.decode_run import add_num_threads_argument
from icefall_lite.decoding.pretrained import add_method_arguments, add_sound_file_arguments
from icefall_lite.decoding.streaming import make_frame_search, streaming_search
from icefall_lite.decoding.transcribe import ProgressFn
from icefall_lite.export.onnx_runtime import OnnxRuntimeTransducer
from icefall_lite.export.sherpa import WORD_BOUNDARY, tail_padding
from icefall_lite.utils import check_positive, script_parser

# kaldi-native-fbank (sherpa-onnx) floors the mel energies at FLT_EPSILON.
LOG_ENERGY_FLOOR = float(np.log(np.finfo(np.float32).eps))
MODEL_FILE_FLAGS = ("encoder_model_filename", "decoder_model_filename", "joiner_model_filename")


def get_parser(description: Optional[str] = None) -> argparse.ArgumentParser:
    """icefall's onnx_pretrained.py flags (the three model files, ``--tokens``), the search, ``--num-threads``,
    ``--max-duration`` and the sound files."""
    parser = script_parser(description)
    for part in ("encoder", "decoder", "joiner"):
        parser.add_argument(
            f"--{part}-model-filename",
            type=Path,
            required=True,
            help=f"The {part} of export_onnx.py, e.g. exp/{part}-epoch-5-avg-2.onnx (or its .int8.onnx).",
        )
    parser.add_argument("--tokens", type=Path, required=True, help="tokens.txt of export_onnx.py.")
    add_method_arguments(parser, STREAMING_METHODS)  # the searches sherpa-onnx runs
    add_num_threads_argument(parser)
    add_sound_file_arguments(parser)
    return parser


def validate_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """argparse errors naming the flag for a missing model file or tokens.txt and bad settings."""
    for name in (*MODEL_FILE_FLAGS, "tokens"):
        path = getattr(args, name)
        if not path.is_file():
            parser.error(f"--{name.replace('_', '-')} {path} does not exist: run export_onnx.py first")
    check_positive(parser, args, ["beam_size", "num_threads", "max_duration"])


def read_tokens(path: Path) -> Dict[int, str]:
    """``{id: piece}`` of tokens.txt (``<piece> <id>`` a line)."""
    tokens = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        piece, index = line.rsplit(maxsplit=1)
        tokens[int(index)] = piece
    return tokens


class OnnxFileDecoder:
    """The exported files in onnxruntime as a :class:`~icefall_lite.decoding.transcribe.FileDecoder`."""

    def __init__(
        self, files: Sequence[Path], tokens: Path, decoding_method: str, beam_size: int, num_threads: int
    ) -> None:
        self.model = OnnxRuntimeTransducer(*files, num_threads=num_threads)
        self.tokens = read_tokens(tokens)
        ids = {piece: i for i, piece in self.tokens.items()}
        self.blank_id = ids.get("<blk>", 0)
        self.unk_id = ids.get("<unk>")
        self.decoding_method, self.beam_size = decoding_method, beam_size
        self.extractor = fbank_extractor()

    def text(self, token_ids: List[int]) -> str:
        """The words of ``token_ids`` (pieces joined, split at sentencepiece's word boundary), as sherpa-onnx's."""
        return " ".join("".join(self.tokens[i] for i in token_ids).replace(WORD_BOUNDARY, " ").split())

    def features(self, samples: np.ndarray) -> Tensor:
        """sherpa-onnx's features of a whole 16 kHz waveform, tail padding included: (num_frames, 80)."""
        padded = np.concatenate([samples, tail_padding(SAMPLE_RATE)])
        return torch.from_numpy(self.extractor.extract(padded, SAMPLE_RATE)).clamp(min=LOG_ENERGY_FLOOR)

    def decode_batch(self, waveforms: Sequence[np.ndarray]) -> List[str]:
        feats = [self.features(w) for w in waveforms]
        hyps = streaming_search(
            self.model, feats, self.decoding_method, self.beam_size, blank_id=self.blank_id, unk_id=self.unk_id
        )
        return [self.text(tokens) for tokens in hyps]

    def _frame_blocks(self, path: Path, progress: ProgressFn) -> Iterator[Tensor]:
        fbank = FbankStream()
        for samples in audio_blocks(path):
            yield fbank.accept(samples).clamp(min=LOG_ENERGY_FLOOR)
            progress(samples.size / SAMPLE_RATE)
        yield fbank.accept(tail_padding(SAMPLE_RATE)).clamp(min=LOG_ENERGY_FLOOR)
        yield fbank.finish().clamp(min=LOG_ENERGY_FLOOR)

    def decode_long(self, path: Path, progress: ProgressFn) -> str:
        skip_ids = (self.blank_id,) if self.unk_id is None else (self.blank_id, self.unk_id)
        search = make_frame_search(
            self.model, self.decoding_method, 1, skip_ids, self.blank_id, self.beam_size, torch.device("cpu")
        )
        return self.text(chunked_search(self.model, self._frame_blocks(path, progress), search, sherpa=True))


__all__ = ["LOG_ENERGY_FLOOR", "get_parser", "validate_args", "read_tokens", "OnnxFileDecoder"]
