"""Decoding waveforms with sherpa-onnx's ``OnlineRecognizer`` and the files of export_onnx.py.

sherpa-onnx runs model_type ``lstm`` only as a streaming (online) model: it
computes the fbank itself (80 bins, dither 0, ``snip_edges=False``,
``high_freq=-400``: lhotse's ``Fbank`` settings, so the model sees what it
was trained on), feeds the encoder windows of ``T`` frames every
``decode_chunk_len`` frames with the previous h/c states, and searches after
every window (greedy or modified beam search, <unk> treated as blank).

:class:`SherpaOnnxRecognizer` decodes many waveforms side by side with
``decode_streams``, as sherpa-onnx's own file-decoding examples do. Every
waveform gets :func:`tail_padding` zeros appended before ``input_finished``,
the waveform counterpart of decode.py's 35 tail frames: sherpa-onnx runs a
window only once ``start + T`` frames are ready, so the last frames of speech
need padding after them to be decoded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Sequence, Tuple, Union

import numpy as np
import sherpa_onnx
from lhotse.cut import Cut

from icefall_lite.data.features import NUM_MEL_BINS, NUM_TAIL_PADDED_FRAMES
from icefall_lite.decoding.constants import STREAMING_METHODS

PathLike = Union[str, Path]
FRAME_SHIFT_SECONDS = 0.01
WORD_BOUNDARY = "\u2581"  # sentencepiece's "▁"; sherpa-onnx already returns it as a space


def tail_padding(sample_rate: int) -> np.ndarray:
    """Zeros lasting ``NUM_TAIL_PADDED_FRAMES`` fbank frames (0.35 s): float32 (num_samples,)."""
    return np.zeros(int(round(NUM_TAIL_PADDED_FRAMES * FRAME_SHIFT_SECONDS * sample_rate)), dtype=np.float32)


def cut_waveform(cut: Cut) -> Tuple[np.ndarray, int]:
    """The mono float32 samples (num_samples,) in [-1, 1] of a cut's recording, and its sampling rate.

    Raises ValueError naming the cut when it has no recording or its audio cannot be read.
    """
    if not cut.has_recording:
        raise ValueError(
            f"cut {cut.id} has no recording: sherpa-onnx decodes audio, so use cut manifests with recordings "
            "(data/fbank/librispeech_cuts_<part>.jsonl.gz made by prepare.sh keep them)"
        )
    try:
        audio = cut.load_audio()
    except Exception as e:  # lhotse raises several types for missing or unreadable files
        sources = ", ".join(s.source for s in cut.recording.sources)
        raise ValueError(
            f"cannot read the audio of cut {cut.id} ({sources}): {e}. Re-run prepare.sh stages 0-1, or fix the "
            "recording paths in the manifest"
        ) from e
    if audio.ndim != 2 or audio.shape[0] != 1:
        raise ValueError(f"cut {cut.id}: expected mono audio, got shape {audio.shape}")
    return np.ascontiguousarray(audio[0], dtype=np.float32), cut.sampling_rate


class SherpaOnnxRecognizer:
    """sherpa-onnx's ``OnlineRecognizer`` over one exported encoder/decoder/joiner.

    Args:
      files: ``{"encoder": path, "decoder": path, "joiner": path}`` (fp32 or int8 files).
      tokens: tokens.txt written by export_onnx.py.
      decoding_method: ``greedy_search`` or ``modified_beam_search``.
      beam_size: sherpa-onnx's ``max_active_paths`` (modified beam search).
      num_threads: onnxruntime threads.
    """

    def __init__(
        self,
        files: Dict[str, PathLike],
        tokens: PathLike,
        decoding_method: str = "greedy_search",
        beam_size: int = 4,
        num_threads: int = 1,
    ) -> None:
        if decoding_method not in STREAMING_METHODS:
            raise ValueError(
                f"Unsupported sherpa-onnx decoding method {decoding_method!r}; use one of {STREAMING_METHODS}"
            )
        self.recognizer = sherpa_onnx.OnlineRecognizer.from_transducer(
            tokens=str(tokens), encoder=str(files["encoder"]), decoder=str(files["decoder"]),
            joiner=str(files["joiner"]), num_threads=num_threads, sample_rate=16000, feature_dim=NUM_MEL_BINS,
            decoding_method=decoding_method, max_active_paths=beam_size,
        )  # fmt: skip

    def decode(self, waveforms: Sequence[Tuple[np.ndarray, int]]) -> List[List[str]]:
        """Decode waveforms side by side; the hypothesis words of each.

        The words are sherpa-onnx's result tokens joined and split at the
        sentencepiece word boundary (which sherpa-onnx returns as a space), i.e.
        what ``sentencepiece.decode`` makes of the token ids, as decode.py's
        hypotheses. (sherpa-onnx's own ``text`` differs in a corner: it drops an
        apostrophe piece at the start of an utterance.)

        Args:
          waveforms: (samples (num_samples,) float32 in [-1, 1], sampling rate) per utterance.
        """
        streams = []
        for samples, sample_rate in waveforms:
            stream = self.recognizer.create_stream()
            stream.accept_waveform(sample_rate, samples)
            stream.accept_waveform(sample_rate, tail_padding(sample_rate))
            stream.input_finished()
            streams.append(stream)
        while True:
            ready = [s for s in streams if self.recognizer.is_ready(s)]
            if not ready:
                break
            self.recognizer.decode_streams(ready)
        return ["".join(self.recognizer.get_result_all(s).tokens).replace(WORD_BOUNDARY, " ").split() for s in streams]


__all__ = ["tail_padding", "cut_waveform", "SherpaOnnxRecognizer"]
