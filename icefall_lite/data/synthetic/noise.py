"""Noise signals standing in for MUSAN: coloured noise, TTS babble, SNR mixing.

White, pink (1/f power) and brown (1/f^2 power) noise are shaped in the
frequency domain from Gaussian noise; babble is the sum of several TTS talkers
(voices and sentences used nowhere else in the corpus).  :func:`mix_at_snr`
adds noise to speech at a given signal-to-noise ratio.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from icefall_lite.data.synthetic.tts import Voice, synthesize

COLOURS = ("white", "pink", "brown")
NOISE_TYPES = COLOURS + ("babble",)
SENTENCES_PER_TALKER = 6  # distinct sentences each babble talker reads (cycled)
_EXPONENT = {"white": 0.0, "pink": 1.0, "brown": 2.0}


def coloured_noise(colour: str, num_samples: int, rng: np.random.Generator) -> np.ndarray:
    """Gaussian noise with power spectrum ~ 1/f^k (k = 0, 1, 2), unit RMS, float32."""
    if colour not in _EXPONENT:
        raise ValueError(f"unknown noise colour {colour!r}; choose from {COLOURS}")
    white = rng.standard_normal(num_samples)
    spectrum = np.fft.rfft(white)
    freqs = np.arange(spectrum.size, dtype=np.float64)
    freqs[0] = 1.0  # keep DC finite; it is removed below
    spectrum *= freqs ** (-_EXPONENT[colour] / 2.0)
    spectrum[0] = 0.0
    noise = np.fft.irfft(spectrum, n=num_samples)
    return _unit_rms(noise)


def _unit_rms(x: np.ndarray) -> np.ndarray:
    rms = float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))
    if rms == 0.0:
        raise ValueError("cannot normalise a silent signal")
    return (x / rms).astype(np.float32)


def talker_track(voice: Voice, sentences: Sequence[str], num_samples: int, rng: np.random.Generator) -> np.ndarray:
    """One babble talker: ``voice`` reading ``sentences`` (cycled) for ``num_samples``.

    Short random pauses separate the sentences; the track is circularly shifted
    by a random offset and has unit RMS.
    """
    pieces = []
    total = 0
    i = 0
    while total < num_samples:
        speech = synthesize(voice, sentences[i % len(sentences)])
        pause = np.zeros(int(rng.integers(800, 6400)), dtype=np.float32)
        pieces.extend([speech, pause])
        total += speech.size + pause.size
        i += 1
    track = np.concatenate(pieces)[:num_samples]
    return _unit_rms(np.roll(track, int(rng.integers(num_samples))))


def babble(
    voices: Sequence[Voice],
    sentences: Sequence[str],
    num_samples: int,
    rng: np.random.Generator,
    sentences_per_talker: int = SENTENCES_PER_TALKER,
) -> np.ndarray:
    """Sum of one :func:`talker_track` per voice, each reading its own sentences."""
    mix = np.zeros(num_samples, dtype=np.float64)
    for k, voice in enumerate(voices):
        start = (k * sentences_per_talker) % max(1, len(sentences))
        own = [sentences[(start + j) % len(sentences)] for j in range(sentences_per_talker)]
        mix += talker_track(voice, own, num_samples, rng)
    return _unit_rms(mix)


def mix_at_snr(speech: np.ndarray, noise: np.ndarray, snr_db: float) -> np.ndarray:
    """``speech`` plus ``noise`` (cropped or tiled to its length) at ``snr_db`` dB."""
    if noise.size < speech.size:
        noise = np.tile(noise, int(np.ceil(speech.size / noise.size)))
    noise = noise[: speech.size].astype(np.float64)
    p_speech = float(np.mean(np.square(speech, dtype=np.float64)))
    p_noise = float(np.mean(np.square(noise)))
    if p_noise == 0.0:
        raise ValueError("noise is silent")
    gain = np.sqrt(p_speech / (p_noise * 10.0 ** (snr_db / 10.0)))
    return (speech + gain * noise).astype(np.float32)


def set_peak(x: np.ndarray, peak: float) -> np.ndarray:
    """Scale ``x`` so that its largest absolute sample is ``peak``."""
    top = float(np.max(np.abs(x)))
    if top == 0.0:
        raise ValueError("cannot scale a silent signal")
    return (x * (peak / top)).astype(np.float32)
