"""LibriSpeech download and lhotse manifests, robust to bad audio and text.

* :func:`download_librispeech` wraps lhotse's downloader (``base_url`` may be a
  ``file://`` mirror, which is how the tests run it without a network);
* :func:`prepare_librispeech_manifests` builds lhotse recording and supervision
  manifests per part with lhotse's LibriSpeech utterance parser
  (:func:`lhotse.recipes.librispeech.parse_utterance`), but unlike lhotse's
  ``prepare_librispeech`` it decodes every FLAC first: an empty, truncated or
  corrupt file is logged by name and skipped (and counted) instead of aborting
  the whole part, and every manifest is written under a temporary name and
  renamed, so an interrupted run leaves nothing a rerun would trust;
* transcripts are checked against LibriSpeech's character set
  (:func:`icefall_lite.data.text_norm.validate_transcript`): lower case is
  upper-cased, anything else is refused with an error naming file and line;
* :func:`report_manifests` logs hours, utterances and the OOV rate per part.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import soundfile as sf
from lhotse import (
    RecordingSet,
    SupervisionSet,
    fix_manifests,
    load_manifest,
    validate_recordings_and_supervisions,
)
from lhotse.recipes.librispeech import download_librispeech as lhotse_download
from lhotse.recipes.librispeech import parse_utterance

from icefall_lite.data.synthetic.corpus_text import oov_counts
from icefall_lite.data.text_norm import validate_transcript
from icefall_lite.utils import atomic_output, parallel_imap

OPENSLR_URL = "http://www.openslr.org/resources"


def download_librispeech(dl_dir: Path, parts: Sequence[str], base_url: str = OPENSLR_URL) -> Path:
    """Download and unpack LibriSpeech ``parts`` into ``dl_dir/LibriSpeech``.

    lhotse keeps a ``<part>/.completed`` marker and skips finished parts; the
    archive is resumed if a previous download was cut off.
    """
    logging.info(f"downloading LibriSpeech {list(parts)} from {base_url} into {dl_dir}")
    return lhotse_download(target_dir=dl_dir, dataset_parts=list(parts), base_url=base_url)


def manifest_paths(output_dir: Path, part: str) -> Tuple[Path, Path]:
    """lhotse's names: ``librispeech_{recordings,supervisions}_<part>.jsonl.gz``."""
    return (
        output_dir / f"librispeech_recordings_{part}.jsonl.gz",
        output_dir / f"librispeech_supervisions_{part}.jsonl.gz",
    )


def audio_error(path: Path) -> str:
    """Why ``path`` is not usable audio ("" if it is): unreadable, empty, truncated, non-finite, all zero."""
    try:
        info = sf.info(str(path))
        samples, _ = sf.read(str(path), dtype="float32", always_2d=True)
    except (RuntimeError, sf.SoundFileError, OSError) as e:
        return f"cannot decode: {e}"
    if samples.shape[0] == 0:
        return "no samples"
    if samples.shape[0] != info.frames:
        return f"truncated: header says {info.frames} samples, decoded {samples.shape[0]}"
    if not np.all(np.isfinite(samples)):
        return "non-finite samples"
    if not np.any(samples):
        return "silent: every sample is zero"
    return ""


def read_transcripts(part_dir: Path) -> List[Tuple[str, str]]:
    """All ``(line, where)`` of the part's ``*.trans.txt``, text checked and upper-cased.

    Raises:
        TranscriptError: a transcript with characters outside A-Z, apostrophe
            and space; the message names the file, line and utterance.
        ValueError: a line without an utterance id and text.
    """
    lines = []
    for trans in sorted(part_dir.rglob("*.trans.txt")):
        for lineno, raw in enumerate(trans.read_text(encoding="utf-8").splitlines(), 1):
            if not raw.strip():
                continue
            fields = raw.strip().split(maxsplit=1)
            where = f"{trans}:{lineno}"
            if len(fields) != 2:
                raise ValueError(f"{where}: expected '<utterance-id> <TEXT>', got {raw!r}")
            text = validate_transcript(fields[1], f"{where} ({fields[0]})")
            lines.append((f"{fields[0]} {text}", where))
    return lines


def _parse_checked(job: Tuple[Path, str]) -> Tuple[Optional[tuple], str, str]:
    """Worker: ``(parsed recording+segment or None, utterance id, problem)``."""
    part_dir, line = job
    utt_id = line.split(maxsplit=1)[0]
    audio = part_dir / Path(utt_id.replace("-", "/")).parent / f"{utt_id}.flac"
    if not audio.is_file():
        return None, utt_id, f"{audio}: no such file"
    problem = audio_error(audio)
    if problem:
        return None, utt_id, f"{audio}: {problem}"
    return parse_utterance(part_dir, line, {}), utt_id, ""


def prepare_part(corpus_dir: Path, part: str, num_jobs: int) -> Tuple[RecordingSet, SupervisionSet, List[str]]:
    """Recordings and supervisions of one part, and the problems of skipped utterances."""
    part_dir = corpus_dir / part
    if not part_dir.is_dir():
        raise FileNotFoundError(f"no LibriSpeech part {part} at {part_dir}")
    lines = read_transcripts(part_dir)
    if not lines:
        raise ValueError(f"{part_dir} has no transcripts (*.trans.txt)")
    jobs = [(part_dir, line) for line, _ in lines]
    recordings, segments, skipped = [], [], []
    for parsed, utt_id, problem in parallel_imap(_parse_checked, jobs, num_jobs, desc=f"audio {part}"):
        if problem:
            logging.warning(f"skipping {utt_id}: {problem}")
            skipped.append(problem)
            continue
        recordings.append(parsed[0])
        segments.append(parsed[1])
    if skipped:
        logging.warning(f"{part}: skipped {len(skipped)} of {len(jobs)} utterances with bad or missing audio")
    if not recordings:
        raise ValueError(f"{part}: no usable audio in {part_dir}")
    recording_set, supervision_set = fix_manifests(
        RecordingSet.from_recordings(recordings), SupervisionSet.from_segments(segments)
    )
    validate_recordings_and_supervisions(recording_set, supervision_set)
    return recording_set, supervision_set, skipped


def prepare_librispeech_manifests(
    corpus_dir: Path, parts: Sequence[str], output_dir: Path, num_jobs: int = 1
) -> Dict[str, int]:
    """Write the manifests of ``parts``; return the skipped-utterance count per part.

    A part whose two manifests already exist is skipped with a log line.
    """
    skipped_counts = {}
    for part in parts:
        rec_path, sup_path = manifest_paths(output_dir, part)
        if rec_path.is_file() and sup_path.is_file():
            logging.info(f"{part}: manifests exist ({rec_path.name}) - skipping")
            continue
        recordings, supervisions, skipped = prepare_part(corpus_dir, part, num_jobs)
        with atomic_output(sup_path) as tmp:
            supervisions.to_file(tmp)
        with atomic_output(rec_path) as tmp:
            recordings.to_file(tmp)
        skipped_counts[part] = len(skipped)
        logging.info(f"{part}: wrote {len(recordings)} recordings to {rec_path}")
    return skipped_counts


def report_manifests(output_dir: Path, parts: Sequence[str]) -> Dict[str, dict]:
    """Log (and return) utterances, hours and OOV rate (vs. the training parts) per part."""
    texts = {}
    stats: Dict[str, dict] = {}
    for part in parts:
        sups = load_manifest(manifest_paths(output_dir, part)[1])
        texts[part] = [s.text for s in sups]
        stats[part] = {"utterances": len(sups), "hours": sum(s.duration for s in sups) / 3600}
    train = [t for p in parts if p.startswith("train") for t in texts[p]]
    for part in parts:
        line = f"{part}: {stats[part]['utterances']} utterances, {stats[part]['hours']:.3f} h"
        if train and not part.startswith("train"):
            oov, total = oov_counts(train, texts[part])
            stats[part]["oov_rate"] = oov / max(1, total)
            line += f", OOV rate vs. training words {100 * oov / max(1, total):.2f}% ({oov}/{total})"
        logging.info(line)
    return stats
