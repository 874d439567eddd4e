"""A user's sound files as the model hears them: 16 kHz mono float32, from any format libsndfile reads, any
sample rate and any channel count.

The model was trained on 16 kHz fbank, so every file is mixed down to one
channel (the mean of its channels) and resampled with libsoxr (the ``soxr``
package: sox's own high-quality resampler). A file is read either whole
(:func:`read_audio`) or block by block (:func:`audio_blocks`, for recordings
too long to hold); soxr's stream resampler gives the same samples both ways
(tested), so a long file decodes to what it would whole.

:func:`sound_files` expands the command line of ``pretrained.py``: paths,
folders (searched recursively for sound files) and list files (one path a
line). :func:`audio_duration` reads only a file's header. Every problem with
a file is an :class:`AudioFileError` that names it and the reason.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Union

import numpy as np
import soundfile as sf
import soxr

PathLike = Union[str, Path]

SAMPLE_RATE = 16000  # the model's (lhotse Fbank at 16 kHz)
# Suffixes of list files: one sound file a line (relative paths: relative to the list file's folder).
LIST_SUFFIXES = (".txt", ".lst", ".list", ".scp")
# Suffixes searched in folders: the formats libsndfile reads, by their usual file names.
SOUND_SUFFIXES = (".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".aiff", ".aif", ".au", ".caf", ".w64", ".sph")
BLOCK_SECONDS = 30.0  # what audio_blocks reads at a time


class AudioFileError(ValueError):
    """A sound file that cannot be transcribed; the message names the file and why."""


def _open_error(path: Path, e: Exception) -> AudioFileError:
    if not path.exists():
        return AudioFileError(f"{path}: no such file")
    if path.is_dir():
        return AudioFileError(f"{path}: is a folder (give folders on the command line, not in list files)")
    if path.stat().st_size == 0:
        return AudioFileError(f"{path}: empty file (0 bytes)")
    formats = ", ".join(sorted(sf.available_formats()))
    return AudioFileError(
        f"{path}: cannot read it as audio ({e}); this libsndfile ({sf.__libsndfile_version__}) reads {formats}: "
        "convert it, e.g. `sox IN.xyz OUT.wav` or `ffmpeg -i IN.xyz OUT.wav`"
    )


def audio_info(path: PathLike) -> sf._SoundFileInfo:
    """soundfile's header information of ``path``; AudioFileError for a missing, unreadable or empty file."""
    path = Path(path)
    try:
        info = sf.info(str(path))
    except (sf.LibsndfileError, RuntimeError, OSError) as e:
        raise _open_error(path, e) from e
    if info.frames <= 0:
        raise AudioFileError(f"{path}: no audio in it (0 samples)")
    return info


def audio_duration(path: PathLike) -> float:
    """Seconds of audio in ``path``, from its header."""
    info = audio_info(path)
    return info.frames / info.samplerate


def _mono(block: np.ndarray) -> np.ndarray:
    """(num_samples, channels) -> (num_samples,) float32, the mean of the channels."""
    return block.mean(axis=1, dtype=np.float32) if block.shape[1] > 1 else block[:, 0]


def audio_blocks(path: PathLike, block_seconds: Optional[float] = None) -> Iterator[np.ndarray]:
    """The 16 kHz mono float32 samples of ``path``, about ``block_seconds`` of the file at a time (None:
    :data:`BLOCK_SECONDS`; inf: all at once).

    Memory is bounded by the block, whatever the file's length. Concatenated,
    the blocks equal :func:`read_audio` of the file.
    """
    info = audio_info(path)
    resampler = None if info.samplerate == SAMPLE_RATE else soxr.ResampleStream(info.samplerate, SAMPLE_RATE, 1)
    seconds = BLOCK_SECONDS if block_seconds is None else block_seconds
    block_frames = info.frames if math.isinf(seconds) else max(1, int(seconds * info.samplerate))
    try:
        with sf.SoundFile(str(path)) as f:
            while True:
                block = f.read(block_frames, dtype="float32", always_2d=True)
                last = block.shape[0] < block_frames or f.tell() >= info.frames
                samples = _mono(block)
                if resampler is not None:
                    samples = resampler.resample_chunk(samples, last=last)
                if samples.size:
                    yield np.ascontiguousarray(samples, dtype=np.float32)
                if last:
                    return
    except (sf.LibsndfileError, RuntimeError) as e:
        raise AudioFileError(f"{path}: reading failed after its header ({e}); the file is damaged or cut short") from e


def read_audio(path: PathLike) -> np.ndarray:
    """The whole of ``path`` as 16 kHz mono float32 samples (num_samples,)."""
    blocks = list(audio_blocks(path, block_seconds=math.inf))
    return np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.float32)


def _read_list_file(path: Path) -> List[Path]:
    """The paths in a list file: one a line, blank lines and lines starting with # skipped; relative paths are
    relative to the list file's folder."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            p = Path(line)
            out.append(p if p.is_absolute() else path.parent / p)
    return out


def sound_files(inputs: Sequence[PathLike]) -> List[Path]:
    """The sound files named by ``inputs``, in order: a path as it is (checked later, when read), a folder's
    sound files (:data:`SOUND_SUFFIXES`, recursively, sorted), a list file's lines (:data:`LIST_SUFFIXES`).

    A file named twice is kept once. Raises AudioFileError for a folder without sound files or an unreadable
    list file.
    """
    out: List[Path] = []
    for item in map(Path, inputs):
        if item.is_dir():
            found = sorted(p for p in item.rglob("*") if p.is_file() and p.suffix.lower() in SOUND_SUFFIXES)
            if not found:
                raise AudioFileError(f"{item}: a folder with no sound files ({', '.join(SOUND_SUFFIXES)}) in it")
            out.extend(found)
        elif item.suffix.lower() in LIST_SUFFIXES and item.is_file():
            try:
                out.extend(_read_list_file(item))
            except (OSError, UnicodeDecodeError) as e:
                raise AudioFileError(f"{item}: cannot read the list file ({e})") from e
        else:
            out.append(item)
    return list(dict.fromkeys(out))


__all__ = [
    "SAMPLE_RATE",
    "LIST_SUFFIXES",
    "SOUND_SUFFIXES",
    "AudioFileError",
    "audio_info",
    "audio_duration",
    "audio_blocks",
    "read_audio",
    "sound_files",
]
