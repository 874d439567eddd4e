"""pretrained.py's library: its flags, the model of one checkpoint file, and the PyTorch decoding of sound files.

A batch of whole files is decoded exactly as decode.py decodes a batch of cuts
(:func:`~icefall_lite.decoding.offline.decode_one_batch`: lhotse's fbank, padding
with log(1e-10), icefall's 35 tail frames, the encoder on the whole utterances,
the search). A file longer than ``--max-duration`` is read block by block
(:func:`~icefall_lite.data.audio.audio_blocks`), its fbank computed as it comes
(:class:`~icefall_lite.data.fbank_stream.FbankStream`), and the encoder run on
windows of :data:`CHUNK_FRAMES` + 5 frames with the LSTM states carried
(:mod:`icefall_lite.decoding.chunked`): the same encoder output frames as the
whole file gives, so the same text. Greedy (one symbol per frame) and modified
beam search step along with the windows, in memory bounded by a window; fast
beam search and greedy search with ``--max-sym-per-frame`` > 1 take the
encoder output of the whole file (``joiner_dim`` floats per 40 ms: 184 MB for an
hour with icefall's model) and search it at the end.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np
import sentencepiece as spm
import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from icefall_lite.data.audio import SAMPLE_RATE, audio_blocks
from icefall_lite.data.bpe import DEFAULT_BPE_MODEL
from icefall_lite.data.fbank_stream import FbankStream
from icefall_lite.data.features import LOG_EPS, NUM_MEL_BINS, NUM_TAIL_PADDED_FRAMES, fbank_extractor
from icefall_lite.decoding.checkpoint_fit import with_fitting_flags
from icefall_lite.decoding.chunked import chunked_search, encoder_windows
from icefall_lite.decoding.cli import add_search_arguments
from icefall_lite.decoding.constants import DECODING_METHODS
from icefall_lite.decoding.decode_run import load_decoding_model
from icefall_lite.decoding.offline import decode_one_batch, search_tokens
from icefall_lite.decoding.search_utils import model_skip_ids
from icefall_lite.decoding.streaming import TorchStreamingModel, make_frame_search
from icefall_lite.decoding.transcribe import ProgressFn
from icefall_lite.nn.model import Transducer, add_model_arguments, check_model_args
from icefall_lite.recipe_defaults import DECODE_MAX_DURATION
from icefall_lite.train.checkpoint import CheckpointError
from icefall_lite.train.checkpoint_args import validate_checkpoint_args
from icefall_lite.utils import AttributeDict, check_positive, script_parser

# Feature frames between two encoder calls on a long file (4 s); any multiple of 4 gives the same output frames,
# a larger one fewer calls.
CHUNK_FRAMES = 400


def add_sound_file_arguments(parser: argparse.ArgumentParser) -> None:
    """``--max-duration`` and the positional sound files (pretrained.py, onnx_pretrained.py)."""
    parser.add_argument(
        "--max-duration",
        type=float,
        default=DECODE_MAX_DURATION,
        help="Seconds of audio decoded side by side in one batch; a file longer than this is decoded chunk by "
        f"chunk through the encoder's states, in bounded memory. (default: {DECODE_MAX_DURATION:g})",
    )
    parser.add_argument(
        "sound_files",
        type=Path,
        nargs="+",
        help="Sound files (WAV, FLAC, OGG, MP3 where libsndfile reads it; any sample rate and channel count), "
        "folders (their sound files, recursively) or list files (.txt, .lst, .list, .scp: one path a line).",
    )


def get_parser(description: Optional[str] = None) -> argparse.ArgumentParser:
    """pretrained.py's flags: icefall's (``--checkpoint``, ``--bpe-model``, ``--method``, the search settings),
    ``--max-duration``, the model-size flags as decode.py's, and the sound files."""
    parser = script_parser(description)
    parser.add_argument(
        "--checkpoint",
        type=Path,
        required=True,
        help="The model: a file in icefall's format, e.g. exp/pretrained.pt of export.py or icefall's published one "
        "({'model': state_dict}; an epoch-N.pt works too).",
    )
    parser.add_argument(
        "--bpe-model", type=Path, default=Path(DEFAULT_BPE_MODEL), help=f"(default: {DEFAULT_BPE_MODEL})"
    )
    add_method_arguments(parser, DECODING_METHODS)
    add_search_arguments(parser)
    add_sound_file_arguments(parser)
    add_model_arguments(parser)
    return parser


def add_method_arguments(parser: argparse.ArgumentParser, methods: Sequence[str]) -> None:
    """``--method`` (icefall's pretrained.py's name; decode.py's ``--decoding-method`` too) among ``methods``, and
    ``--beam-size``: pretrained.py's and onnx_pretrained.py's."""
    parser.add_argument(
        "--method",
        "--decoding-method",
        dest="decoding_method",
        default="greedy_search",
        choices=list(methods),
        help="The search (icefall's pretrained.py: --method). (default: greedy_search)",
    )
    parser.add_argument(
        "--beam-size", type=int, default=4, help="Hypotheses kept per frame by modified_beam_search. (default: 4)"
    )


def validate_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """argparse errors naming the flag: a missing or empty checkpoint or BPE model, bad sizes or settings."""
    validate_checkpoint_args(parser, args)
    if not args.bpe_model.is_file():
        parser.error(f"--bpe-model {args.bpe_model} does not exist: pass the model's BPE model (data/lang_bpe_*/)")
    check_positive(parser, args, ["beam_size", "beam", "max_contexts", "max_states", "max_sym_per_frame"])
    check_positive(parser, args, ["max_duration"])
    check_model_args(parser, args)


def load_model(
    args: argparse.Namespace, params: AttributeDict, device: torch.device
) -> Tuple[Transducer, spm.SentencePieceProcessor]:
    """The model of ``--checkpoint`` with the size flags, on ``device``, in eval mode; a checkpoint that does
    not fit raises CheckpointError naming the differing tensors and the flags it fits."""
    try:
        model, sp = load_decoding_model(args, params, device)
    except CheckpointError as e:
        vocab_size = spm.SentencePieceProcessor(model_file=str(params.bpe_model)).get_piece_size()
        raise with_fitting_flags(e, params.checkpoint, vocab_size) from e
    model.joiner.blank_penalty = params.blank_penalty
    return model.to(device).eval(), sp


class TorchFileDecoder:
    """The PyTorch model as a :class:`~icefall_lite.decoding.transcribe.FileDecoder` (see the module doc)."""

    def __init__(self, params: AttributeDict, model: Transducer, sp: spm.SentencePieceProcessor) -> None:
        self.params, self.model, self.sp = params, model, sp
        self.device = next(model.parameters()).device
        self.extractor = fbank_extractor()

    def decode_batch(self, waveforms: Sequence[np.ndarray]) -> List[str]:
        """decode.py's decoding of a batch, on fbank of 16 kHz waveforms."""
        feats = [torch.from_numpy(self.extractor.extract(w, SAMPLE_RATE)) for w in waveforms]
        batch = {
            "inputs": pad_sequence(feats, batch_first=True, padding_value=LOG_EPS),
            "supervisions": {"num_frames": torch.tensor([f.size(0) for f in feats])},
        }
        hyps = next(iter(decode_one_batch(self.params, self.model, self.sp, batch).values()))
        return [" ".join(words) for words in hyps]

    def _frame_blocks(self, path: Path, progress: ProgressFn) -> Iterator[Tensor]:
        """The file's fbank block by block, then icefall's tail frames of log(1e-10)."""
        fbank = FbankStream()
        for samples in audio_blocks(path):
            yield fbank.accept(samples)
            progress(samples.size / SAMPLE_RATE)
        yield fbank.finish()
        yield torch.full((NUM_TAIL_PADDED_FRAMES, NUM_MEL_BINS), LOG_EPS)

    @torch.inference_mode()
    def decode_long(self, path: Path, progress: ProgressFn) -> str:
        params, model = self.params, self.model
        blocks = self._frame_blocks(path, progress)
        method = params.decoding_method
        if method == "modified_beam_search" or (method == "greedy_search" and params.max_sym_per_frame == 1):
            streaming = TorchStreamingModel(model, decode_chunk_len=CHUNK_FRAMES)
            blank_id = model.decoder.blank_id
            search = make_frame_search(
                streaming, method, 1, model_skip_ids(model), blank_id, params.beam_size, self.device
            )
            tokens = chunked_search(streaming, blocks, search, sherpa=False)
        else:
            states = model.get_init_states(1)
            outputs = []
            for window in encoder_windows(blocks, CHUNK_FRAMES, sherpa=False):
                encoder_out, states = model.encoder.streaming_forward(window.unsqueeze(0).to(self.device), states)
                outputs.append(encoder_out)
            encoder_out = torch.cat(outputs, dim=1)
            lens = torch.tensor([encoder_out.size(1)], device=self.device)
            tokens = search_tokens(params, model, encoder_out, lens)[0]
        logging.info(f"{path}: decoded chunk by chunk")
        return " ".join(self.sp.decode(tokens).split())


__all__ = [
    "CHUNK_FRAMES",
    "add_sound_file_arguments",
    "get_parser",
    "validate_args",
    "load_model",
    "TorchFileDecoder",
]
