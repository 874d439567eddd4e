"""The noise corpus that stands in for MUSAN (prepare.sh stage 3).

Audio: ``<dl_dir>/noise/{white,pink,brown,babble}/<type>-<k>.flac`` (16 kHz
FLAC) and ``<dl_dir>/noise/NOISE.json`` (configuration), built in
``.tmp-noise`` (:func:`icefall_lite.utils.atomic_output`) and renamed when complete.  Babble uses the accent
``tts.BABBLE_ACCENTS[0]`` and the noise-corpus half of the out-of-vocabulary
fortune sentences, neither of which any speech part or the ``-other`` noise
uses.

Manifests, as icefall's MUSAN stage: ``data/manifests/noise_recordings.jsonl.gz``,
then the recordings cut into 10 s windows (windows of 5 s or less are
dropped), with 80-dim fbank, in ``data/fbank/noise_cuts.jsonl.gz``
(features in ``data/fbank/noise_feats/``).  The datamodule mixes these cuts
into training cuts with ``CutMix``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import soundfile as sf
from lhotse import Recording, RecordingSet

from icefall_lite.data.layout import NOISE_CUTS_NAME
from icefall_lite.data.musan import noise_window_cuts
from icefall_lite.data.synthetic import noise as noise_lib
from icefall_lite.data.synthetic import tts
from icefall_lite.data.synthetic.corpus import SIZES, load_sentences
from icefall_lite.data.synthetic.corpus_text import babble_sentences, out_of_vocabulary
from icefall_lite.utils import atomic_output, parallel_imap

MARKER = "NOISE.json"
NOISE_RECORDINGS_NAME = "noise_recordings.jsonl.gz"


@dataclass(frozen=True)
class NoiseSize:
    """How much noise to make."""

    files_per_colour: int
    colour_seconds: float
    babble_files: int
    babble_seconds: float
    babble_talkers: int


NOISE_SIZES: Dict[str, NoiseSize] = {
    "default": NoiseSize(6, 30.0, 18, 20.0, 5),
    "small": NoiseSize(6, 30.0, 18, 20.0, 5),
    "tiny": NoiseSize(1, 12.0, 2, 12.0, 3),
}

# (type, index, seconds, seed, voices, sentences)
NoiseJob = Tuple[str, int, float, int, List[tts.Voice], List[str]]


def plan_noise(size: NoiseSize, seed: int, vocab_words: int) -> List[NoiseJob]:
    """Every noise file to make, with its seed (and voices/sentences for babble)."""
    rng = np.random.default_rng(seed + 7919)
    jobs: List[NoiseJob] = []
    for colour in noise_lib.COLOURS:
        for k in range(size.files_per_colour):
            jobs.append((colour, k, size.colour_seconds, int(rng.integers(2**31)), [], []))
    if size.babble_files:
        sentences, vocab = load_sentences(vocab_words)
        text = babble_sentences(out_of_vocabulary(sentences, vocab), "noise-corpus")
        names = tts.espeak_names(tts.BABBLE_ACCENTS[:1], tts.TRAIN_VARIANTS + tts.OTHER_VARIANTS)
        voices = tts.sample_voices(rng, size.babble_talkers * 3, names, ())
        per_file = size.babble_talkers * noise_lib.SENTENCES_PER_TALKER
        for k in range(size.babble_files):
            talkers = [voices[(k + j) % len(voices)] for j in range(size.babble_talkers)]
            own = [text[(k * per_file + j) % len(text)] for j in range(per_file)]
            jobs.append(("babble", k, size.babble_seconds, int(rng.integers(2**31)), talkers, own))
    return jobs


def render_noise(job: Tuple[NoiseJob, Path]) -> str:
    """Worker: make one noise file; return its path."""
    (kind, k, seconds, seed, voices, sentences), root = job
    rng = np.random.default_rng(seed)
    n = int(seconds * tts.SAMPLE_RATE)
    if kind == "babble":
        samples = noise_lib.babble(voices, sentences, n, rng)
    else:
        samples = noise_lib.coloured_noise(kind, n, rng)
    samples = noise_lib.set_peak(samples, 0.9)
    path = root / kind / f"{kind}-{k}.flac"
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(path), samples, tts.SAMPLE_RATE, format="FLAC", subtype="PCM_16")
    return str(path)


def build_noise_audio(dl_dir: Path, size_name: str = "default", seed: int = 42, num_jobs: int = 1) -> Path:
    """Make (or find) the noise audio under ``dl_dir/noise``; return that folder."""
    noise_dir = dl_dir / "noise"
    config = {"size": size_name, "seed": seed, "params": asdict(NOISE_SIZES[size_name])}
    marker = noise_dir / MARKER
    if marker.is_file():
        built = json.loads(marker.read_text())
        if built == config:
            logging.info(f"{noise_dir} already holds the {size_name} noise corpus - skipping")
            return noise_dir
        raise FileExistsError(
            f"{noise_dir} was built with size={built['size']} seed={built['seed']}; "
            f"remove it and data/fbank/noise_* to rebuild with size={size_name} seed={seed}"
        )
    tts.check_tools()
    jobs = plan_noise(NOISE_SIZES[size_name], seed, SIZES[size_name].vocab_words)
    with atomic_output(noise_dir) as partial:
        partial.mkdir()
        for _ in parallel_imap(render_noise, [(j, partial) for j in jobs], num_jobs, desc="noise corpus"):
            pass
        (partial / MARKER).write_text(json.dumps(config))
    logging.info(f"wrote {len(jobs)} noise files to {noise_dir}")
    return noise_dir


def noise_recordings(noise_dir: Path) -> RecordingSet:
    """One lhotse Recording per noise FLAC, id ``<type>-<k>``."""
    files = sorted(noise_dir.glob("*/*.flac"))
    if not files:
        raise FileNotFoundError(f"no noise audio under {noise_dir}: run prepare.sh stage 3")
    return RecordingSet.from_recordings(Recording.from_file(f, recording_id=f.stem) for f in files)


def prepare_noise_cuts(noise_dir: Path, manifest_dir: Path, fbank_dir: Path) -> Path:
    """Recording manifest, 10 s windows with features (as MUSAN's); return the cut manifest path."""
    cuts_path = fbank_dir / NOISE_CUTS_NAME
    if cuts_path.is_file():
        logging.info(f"{cuts_path} exists - skipping")
        return cuts_path
    recordings = noise_recordings(noise_dir)
    with atomic_output(manifest_dir / NOISE_RECORDINGS_NAME) as tmp:
        recordings.to_file(tmp)
    # A few hundred 10 s windows at most: one process is quicker than starting workers.
    return noise_window_cuts(recordings, fbank_dir, NOISE_CUTS_NAME, "noise_feats", num_jobs=1)
