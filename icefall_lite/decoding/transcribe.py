"""Sound files to transcripts, whatever decodes them: what ``pretrained.py`` (PyTorch) and ``onnx_pretrained.py``
(onnxruntime) share.

:func:`transcribe` reads each file's header, sorts the files by length and
decodes those up to ``max_duration`` seconds whole, in batches of at most
``max_duration`` seconds of audio (:meth:`FileDecoder.decode_batch`), and the
longer ones chunk by chunk in bounded memory (:meth:`FileDecoder.decode_long`).
A file that cannot be transcribed (missing, unreadable, empty, too short for
the encoder) is recorded with the reason and the others go on; a progress bar
counts seconds of audio, so its time left holds for long files too.
:func:`report` logs the transcripts as icefall's ``pretrained.py`` does (the
file name, then its text), then the files that failed, and gives the exit
status.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Protocol, Sequence, Tuple

import numpy as np

from icefall_lite.data.audio import SAMPLE_RATE, AudioFileError, audio_duration, read_audio
from icefall_lite.data.fbank_stream import FRAME_SHIFT, num_fbank_frames
from icefall_lite.decoding.chunked import MIN_WINDOW_FRAMES
from icefall_lite.utils import progress_bar

# Seconds of audio decoded so far of the file under way (for the progress bar).
ProgressFn = Callable[[float], None]


class FileDecoder(Protocol):
    """What :func:`transcribe` needs of a model."""

    def decode_batch(self, waveforms: Sequence[np.ndarray]) -> List[str]:
        """Texts of whole 16 kHz mono float32 waveforms, decoded side by side."""

    def decode_long(self, path: Path, progress: ProgressFn) -> str:
        """Text of one long file, read and decoded chunk by chunk; ``progress(seconds)`` after each block."""


@dataclass
class Transcripts:
    """Texts of the files transcribed and the reasons of those that were not, both by path."""

    texts: Dict[Path, str] = field(default_factory=dict)
    errors: Dict[Path, str] = field(default_factory=dict)


def check_length(path: Path, samples: np.ndarray) -> None:
    """AudioFileError naming ``path`` when its 16 kHz samples make fewer fbank frames than one encoder output
    frame needs."""
    frames = num_fbank_frames(samples.size)
    if frames < MIN_WINDOW_FRAMES:
        need = (MIN_WINDOW_FRAMES * FRAME_SHIFT - FRAME_SHIFT // 2) / SAMPLE_RATE
        raise AudioFileError(
            f"{path}: too short: {samples.size} samples at 16 kHz ({samples.size / SAMPLE_RATE:.3f} s) make "
            f"{frames} feature frames, and the encoder needs {MIN_WINDOW_FRAMES} ({need:.3f} s of audio)"
        )


def duration_batches(durations: Dict[Path, float], max_duration: float) -> List[List[Path]]:
    """The files of at most ``max_duration`` seconds, longest first, in batches of at most ``max_duration``
    seconds in all (lhotse's ``--max-duration`` habit: less padding than batches in the given order)."""
    batches: List[List[Path]] = []
    total = max_duration + 1.0
    for path, seconds in sorted(durations.items(), key=lambda item: -item[1]):
        if seconds > max_duration:
            continue
        if total + seconds > max_duration:
            batches.append([])
            total = 0.0
        batches[-1].append(path)
        total += seconds
    return batches


def _read_batch(paths: Sequence[Path], transcripts: Transcripts) -> Tuple[List[Path], List[np.ndarray]]:
    """The files of a batch that read and are long enough, and their samples; the others go to ``errors``."""
    good, waveforms = [], []
    for path in paths:
        try:
            samples = read_audio(path)
            check_length(path, samples)
        except AudioFileError as e:
            transcripts.errors[path] = str(e)
            continue
        good.append(path)
        waveforms.append(samples)
    return good, waveforms


def transcribe(paths: Sequence[Path], decoder: FileDecoder, max_duration: float) -> Transcripts:
    """Transcribe ``paths`` (see the module doc); files longer than ``max_duration`` seconds go chunk by chunk."""
    transcripts = Transcripts()
    durations: Dict[Path, float] = {}
    for path in paths:
        try:
            durations[path] = audio_duration(path)
        except AudioFileError as e:
            transcripts.errors[path] = str(e)
    long_files = [p for p, seconds in durations.items() if seconds > max_duration]
    batches = duration_batches(durations, max_duration)
    logging.info(
        f"{len(durations)} of {len(paths)} files readable, {sum(durations.values()):.1f} s of audio: "
        f"{sum(map(len, batches))} decoded whole in {len(batches)} batch(es) of up to {max_duration:g} s, "
        f"{len(long_files)} longer file(s) chunk by chunk"
    )
    with progress_bar(total=round(sum(durations.values()), 2), unit="s", desc="transcribing") as bar:
        for batch in batches:
            good, waveforms = _read_batch(batch, transcripts)
            if good:
                transcripts.texts.update(zip(good, decoder.decode_batch(waveforms)))
            bar.update(round(sum(durations[p] for p in batch), 2))
        for path in long_files:
            try:
                transcripts.texts[path] = decoder.decode_long(path, lambda seconds: bar.update(round(seconds, 2)))
            except AudioFileError as e:
                transcripts.errors[path] = str(e)
    return transcripts


def report(paths: Sequence[Path], transcripts: Transcripts) -> int:
    """Log (and print to stdout) icefall's ``"<file>:\\n<text>\\n\\n"`` for every transcribed file in the given
    order, then log every failed file with its reason; the exit status: 1 if any file failed, else 0."""
    s = "\n"
    for path in paths:
        if path in transcripts.texts:
            s += f"{path}:\n{transcripts.texts[path]}\n\n"
    logging.info(s)
    print(s.strip("\n"))
    if transcripts.errors:
        for path in paths:
            if path in transcripts.errors:
                logging.error(transcripts.errors[path])
        logging.error(f"{len(transcripts.errors)} of {len(paths)} file(s) were not transcribed (reasons above)")
        return 1
    logging.info("Decoding Done")
    return 0


__all__ = ["FileDecoder", "Transcripts", "check_length", "duration_batches", "transcribe", "report"]
