"""Offline speech synthesis with espeak-ng and flite, resampled by sox.

A :class:`Voice` is one "speaker" of the synthetic corpus: an engine, a voice
name (for espeak-ng an accent plus a variant, ``en-us+m3``), a speaking rate
and a pitch.  :func:`synthesize` renders text with it and returns 16 kHz mono
float32 samples.  The voice pools below are disjoint by construction:

* training voices: espeak-ng accents ``TRAIN_ACCENTS`` with variants
  ``TRAIN_VARIANTS``, and flite voices ``TRAIN_FLITE``; the extra training
  speech of the larger corpora also uses the variants ``EXTRA_VARIANTS``
  (:func:`extra_voice_names`);
* unseen voices (the ``-other`` parts): any accent of ``OTHER_ACCENTS`` or any
  variant of ``OTHER_VARIANTS`` (never a training pair), and flite voices
  ``OTHER_FLITE``;
* babble voices (noise only): the accents ``BABBLE_ACCENTS``, which no speech
  part uses; the first for the noise corpus, the second for the noise of the
  ``-other`` parts.
"""

from __future__ import annotations

import itertools
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence

import numpy as np

SAMPLE_RATE = 16000

TRAIN_ACCENTS = ("en-us", "en-gb", "en-gb-x-rp", "en-gb-scotland")
OTHER_ACCENTS = ("en-029", "en-us-nyc")
BABBLE_ACCENTS = ("en-gb-x-gbclan", "en-gb-x-gbcwmd")  # (noise corpus, -other noise)
TRAIN_VARIANTS = ("m1", "m2", "m3", "m4", "m5", "f1", "f2", "f3", "klatt", "klatt3")
OTHER_VARIANTS = ("m6", "m7", "f4", "f5", "klatt2", "klatt4")
# espeak-ng 1.51's other variants (voices/!v), for the extra training speech:
# all 101 but TRAIN_VARIANTS, OTHER_VARIANTS, those built on OTHER_VARIANTS'
# Klatt modes 2 and 4 (UniRobot, announcer, robosoft3), the other robot voices
# (robosoft*, anikaRobot), the whispered ones (whisper, whisperf), the
# character voices Demonic, Mr, AnxiousAndy and RicishayMax1-3, and "fast".
EXTRA_VARIANTS = (
    "adam", "Alex", "Alicia", "Andrea", "Andy", "Annie", "antonio", "aunty", "belinda",
    "benjamin", "boris", "caleb", "croak", "david", "Denis", "Diogo", "ed", "edward",
    "edward2", "Gene", "Gene2", "grandma", "grandpa", "gustave", "Henrique", "Hugo",
    "iven", "iven2", "iven3", "iven4", "Jacky", "john", "kaukovalta", "klatt5",
    "klatt6", "Lee", "linda", "m8", "marcelo", "Marco", "Mario", "max", "Michael",
    "michel", "miguel", "Mike", "Nguyen", "norbert", "pablo", "paul", "pedro", "quincy",
    "rob", "robert", "sandro", "shelby", "steph", "steph2", "steph3", "Storm", "travis",
    "Tweaky", "victor", "zac", "anika",
)  # fmt: skip
TRAIN_FLITE = ("slt", "rms", "kal16")
OTHER_FLITE = ("awb", "kal")

ESPEAK_RATE_RANGE = (145, 195)  # words per minute (espeak-ng -s)
ESPEAK_PITCH_RANGE = (30, 70)  # espeak-ng -p, 0-99
FLITE_STRETCH_RANGE = (0.85, 1.15)  # flite duration_stretch
FLITE_F0_RANGE = (85.0, 190.0)  # flite int_f0_target_mean, Hz

REQUIRED_TOOLS = ("espeak-ng", "flite", "sox")


class SynthesisError(RuntimeError):
    """A TTS or sox command failed or produced no audio."""


@dataclass(frozen=True)
class Voice:
    """One synthetic speaker: engine, voice name, rate and pitch."""

    engine: str  # "espeak" or "flite"
    name: str  # espeak "accent+variant", or a flite voice
    rate: float  # espeak words/minute, or flite duration stretch
    pitch: float  # espeak pitch 0-99, or flite mean F0 in Hz

    def describe(self) -> str:
        """A short human-readable tag, e.g. ``espeak:en-us+m3:s160:p45``."""
        if self.engine == "espeak":
            return f"espeak:{self.name}:s{self.rate:.0f}:p{self.pitch:.0f}"
        return f"flite:{self.name}:x{self.rate:.2f}:f{self.pitch:.0f}"


def check_tools() -> None:
    """Fail with a clear message when a synthesis program is missing."""
    missing = [t for t in REQUIRED_TOOLS if shutil.which(t) is None]
    if missing:
        raise SynthesisError(
            f"missing programs {missing}: install the Debian packages espeak-ng, flite and sox (`make setup` does it)"
        )


def espeak_names(accents: Sequence[str], variants: Sequence[str]) -> List[str]:
    """All ``accent+variant`` espeak-ng voice names of the two lists."""
    return [f"{a}+{v}" for a, v in itertools.product(accents, variants)]


def train_voice_names() -> List[str]:
    """espeak-ng voice names (accent+variant) of the training voices."""
    return espeak_names(TRAIN_ACCENTS, TRAIN_VARIANTS)


def extra_voice_names() -> List[str]:
    """espeak-ng voice names of the extra training speech: training accents with training or extra variants."""
    return espeak_names(TRAIN_ACCENTS, TRAIN_VARIANTS + EXTRA_VARIANTS)


def other_voice_names() -> List[str]:
    """espeak-ng voice names never used in training (new accent or new variant)."""
    names = espeak_names(OTHER_ACCENTS, TRAIN_VARIANTS + OTHER_VARIANTS)
    return names + espeak_names(TRAIN_ACCENTS, OTHER_VARIANTS)


def sample_voices(
    rng: np.random.Generator,
    count: int,
    espeak: Sequence[str],
    flite: Sequence[str],
    flite_fraction: float = 0.25,
) -> List[Voice]:
    """Draw ``count`` distinct voice settings from the given name pools.

    Names are used round-robin (shuffled) so that all accents and variants
    appear before any repeats; rate and pitch are drawn per voice.
    """
    n_flite = int(round(count * flite_fraction)) if flite else 0
    n_espeak = count - n_flite
    voices = []
    for i, name in enumerate(_cycle_shuffled(rng, espeak, n_espeak)):
        rate = float(rng.integers(*ESPEAK_RATE_RANGE))
        pitch = float(rng.integers(*ESPEAK_PITCH_RANGE))
        voices.append(Voice("espeak", name, rate, pitch))
    for name in _cycle_shuffled(rng, flite, n_flite):
        stretch = round(float(rng.uniform(*FLITE_STRETCH_RANGE)), 2)
        f0 = round(float(rng.uniform(*FLITE_F0_RANGE)))
        voices.append(Voice("flite", name, stretch, f0))
    order = rng.permutation(len(voices))
    return [voices[i] for i in order]


def _cycle_shuffled(rng: np.random.Generator, names: Sequence[str], n: int) -> List[str]:
    out: List[str] = []
    while len(out) < n:
        out.extend(names[i] for i in rng.permutation(len(names)))
    return out[:n]


def _tts_command(voice: Voice, text: str, wav: Path) -> List[str]:
    spoken = text.lower()
    if voice.engine == "espeak":
        return [
            "espeak-ng",
            "-v", voice.name,
            "-s", str(int(voice.rate)),
            "-p", str(int(voice.pitch)),
            "-w", str(wav),
            spoken,
        ]  # fmt: skip
    if voice.engine == "flite":
        return [
            "flite",
            "-voice", voice.name,
            "--setf", f"duration_stretch={voice.rate}",
            "--setf", f"int_f0_target_mean={voice.pitch}",
            "-t", spoken,
            "-o", str(wav),
        ]  # fmt: skip
    raise ValueError(f"unknown TTS engine {voice.engine!r}")


def _run(cmd: List[str]) -> bytes:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip()
        raise SynthesisError(f"{cmd[0]} failed ({proc.returncode}): {err}")
    return proc.stdout


def synthesize(voice: Voice, text: str) -> np.ndarray:
    """Render ``text`` with ``voice``; 16 kHz mono float32 samples in [-1, 1].

    sox runs in repeatable mode (``-R``) so the result is deterministic.
    """
    with tempfile.TemporaryDirectory(prefix="icefall-lite-tts-") as tmp:
        wav = Path(tmp) / "tts.wav"
        _run(_tts_command(voice, text, wav))
        raw = _run(["sox", "-R", str(wav), "-t", "f32", "-r", str(SAMPLE_RATE), "-c", "1", "-"])
    samples = np.frombuffer(raw, dtype=np.float32).copy()
    if samples.size == 0 or not np.any(samples):
        raise SynthesisError(f"{voice.describe()} produced no audio for {text!r}")
    return samples
