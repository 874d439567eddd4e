"""The synthetic corpus's voice variety: the in-process engines (Pico, hibari, Piper) and the per-utterance
perturbation of the training speech (rate, pitch, frequency warp)."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from icefall_lite.data.layout import TRAIN_PART
from icefall_lite.data.synthetic import corpus, engines, tts
from icefall_lite.data.synthetic.digits import trim_silence

TEXT = "the old man sat by the window and watched the rain fall on the quiet street"
ESPEAK = tts.Voice("espeak", "en-us+m3", 160, 50)


def _spectrum(samples: np.ndarray, n_fft: int = 1024) -> np.ndarray:
    """Mean magnitude spectrum over Hann-windowed frames, ``(n_fft // 2 + 1,)``."""
    hop = n_fft // 2
    frames = np.stack([samples[i : i + n_fft] for i in range(0, samples.size - n_fft, hop)])
    return np.abs(np.fft.rfft(frames * np.hanning(n_fft), axis=1)).mean(axis=0)


def _best_scale(reference: np.ndarray, warped: np.ndarray, n_fft: int = 1024) -> float:
    """The factor a that best maps ``reference``'s log spectrum onto ``warped``'s (S_w(f) ~ S_r(f / a)),
    searched over 200-6000 Hz by correlation, by brute force in steps of 0.0025."""
    freqs = np.fft.rfftfreq(n_fft, 1.0 / tts.SAMPLE_RATE)
    band = (freqs >= 200) & (freqs <= 6000)
    log_ref, log_warped = np.log(_spectrum(reference) + 1e-6), np.log(_spectrum(warped) + 1e-6)
    scores = {}
    for a in np.arange(0.8, 1.25, 0.0025):
        mapped = np.interp(freqs[band] / a, freqs, log_ref)
        scores[float(a)] = float(np.corrcoef(mapped, log_warped[band])[0, 1])
    return max(scores, key=scores.get)


def _f0(samples: np.ndarray) -> float:
    """Median autocorrelation pitch (Hz, 60-400) of the loudest third of 40-ms frames."""
    n, hop = 640, 320
    frames = np.stack([samples[i : i + n] for i in range(0, samples.size - n, hop)])
    loud = frames[np.argsort((frames**2).sum(axis=1))[-len(frames) // 3 :]]
    lags = np.arange(tts.SAMPLE_RATE // 400, tts.SAMPLE_RATE // 60)
    pitches = []
    for frame in loud:
        frame = frame - frame.mean()
        ac = np.correlate(frame, frame, mode="full")[n - 1 :]
        pitches.append(tts.SAMPLE_RATE / lags[np.argmax(ac[lags])])
    return float(np.median(pitches))


@pytest.mark.parametrize("warp", [0.9, 1.1])
def test_warp_scales_every_frequency_and_keeps_the_duration(warp: float) -> None:
    plain = tts.synthesize(ESPEAK, TEXT)
    warped = tts.synthesize(ESPEAK, TEXT, tts.Perturbation(warp=warp))
    assert abs(warped.size / plain.size - 1.0) < 0.01
    assert _best_scale(plain, warped) == pytest.approx(warp, abs=0.02)


ENGINE_VOICES = [
    ESPEAK,
    tts.Voice("flite", "slt", 1.0, 120.0),
    tts.Voice("pico", "en-GB", 1.0, 1.0),
    tts.Voice("hibari", "heart", 1.0, 1.0),
    tts.Voice("piper", "joe", 1.0, 1.0),
]


@pytest.mark.parametrize("voice", ENGINE_VOICES, ids=lambda v: v.engine)
def test_rate_reaches_every_engine_and_rendering_repeats(voice: tts.Voice) -> None:
    slow = tts.synthesize(voice, TEXT, tts.Perturbation(rate=0.85))
    fast = tts.synthesize(voice, TEXT, tts.Perturbation(rate=1.15))
    # Speech time (leading and trailing silence trimmed) scales as 1 / rate, 1.35 here, for espeak-ng,
    # flite and pico; hibari and Piper scale only part of it (their pauses do not): 1.17 and 1.11 measured.
    assert 1.08 < trim_silence(slow).size / trim_silence(fast).size < 1.5
    words = len(TEXT.split())
    assert 0.15 < fast.size / tts.SAMPLE_RATE / words < 0.6
    assert np.array_equal(fast, tts.synthesize(voice, TEXT, tts.Perturbation(rate=1.15)))


@pytest.mark.parametrize("voice", ENGINE_VOICES[:3], ids=lambda v: v.engine)
def test_pitch_reaches_the_engines_with_a_pitch_setting(voice: tts.Voice) -> None:
    low = _f0(tts.synthesize(voice, TEXT, tts.Perturbation(pitch=0.85)))
    high = _f0(tts.synthesize(voice, TEXT, tts.Perturbation(pitch=1.15)))
    # 1.15 / 0.85 = 1.35 in the engine's pitch setting; espeak-ng's 0-99 scale is not proportional to
    # F0 (1.14 measured).
    assert high / low > 1.08, (low, high)


def test_unknown_engine_voice_is_refused() -> None:
    with pytest.raises(ValueError, match="pico has no voice 'en-AU'"):
        engines.render("pico", "en-AU", "hello", 1.0, 1.0)


# The evaluation parts of corpus version 1 (every figure before the voice variety), hashed as
# "<utt_id>|<part>|<text>|<voice>|<noise>|<snr>|<peak>|<seed>" lines: they must not change.
EVAL_PARTS_V1_SHA256 = {
    "default": "0ab8cc1b561cb13c6c6ad8c25a744ca0551774c15a55b5229f8fa7de1484ba46",
    "tiny": "eb89f7ae69f8352802ae090a7aaaf02726940042a4f49a708363a2c8bcceac81",
}


@pytest.mark.parametrize("size", ["default", "tiny"])
def test_training_speech_is_perturbed_and_the_evaluation_parts_are_version_1s(size: str) -> None:
    plan = corpus.plan_corpus(corpus.SIZES[size], 42)
    train = [u for u in plan.utterances if u.part == TRAIN_PART]
    held_out = [u for u in plan.utterances if u.part != TRAIN_PART]
    lines = [
        f"{u.utt_id}|{u.part}|{u.text}|{u.voice.describe()}|{u.noise}|{u.snr_db}|{u.peak}|{u.seed}" for u in held_out
    ]
    assert hashlib.sha256("\n".join(lines).encode()).hexdigest() == EVAL_PARTS_V1_SHA256[size]
    assert all(u.change == tts.NO_PERTURBATION for u in held_out)
    for u in train:
        assert tts.PERTURB_RATE_RANGE[0] <= u.change.rate <= tts.PERTURB_RATE_RANGE[1]
        assert tts.PERTURB_PITCH_RANGE[0] <= u.change.pitch <= tts.PERTURB_PITCH_RANGE[1]
        assert tts.PERTURB_WARP_RANGE[0] <= u.change.warp <= tts.PERTURB_WARP_RANGE[1]
    # Drawn per utterance, not per voice: a voice's utterances differ.
    assert len({u.change for u in train}) > 0.95 * len(train)


def test_the_default_extra_speech_has_the_engines_voices() -> None:
    size = corpus.SIZES["default"]
    small = corpus.plan_corpus(corpus.SIZES["small"], 42)
    extra = corpus.plan_corpus(size, 42).utterances[len(small.utterances) :]
    voices = {u.voice for u in extra}
    engines_count = Counter(v.engine for v in voices)
    assert engines_count["pico"] == size.extra_pico_speakers > 0
    assert engines_count["hibari"] == size.extra_hibari_speakers > 0
    assert engines_count["piper"] == size.extra_piper_speakers > 0
    assert len(voices) == size.extra_train_speakers
    for v in voices:
        if v.engine in engines.ENGINE_VOICES:
            assert v.name in engines.ENGINE_VOICES[v.engine]
            assert tts.ENGINE_RATE_RANGE[0] <= v.rate <= tts.ENGINE_RATE_RANGE[1]


def test_a_version_1_corpus_is_refused_with_the_fix(tmp_path: Path) -> None:
    corpus_dir = tmp_path / "LibriSpeech"
    corpus_dir.mkdir()
    old = {k: v for k, v in corpus.corpus_config("tiny", 42).items() if k != "version"}
    (corpus_dir / corpus.MARKER).write_text(json.dumps({"config": old}))
    with pytest.raises(FileExistsError, match="Remove .*LibriSpeech"):
        corpus.existing_corpus(corpus_dir, "tiny", 42)
    (corpus_dir / corpus.MARKER).write_text(json.dumps({"config": corpus.corpus_config("tiny", 42)}))
    assert corpus.existing_corpus(corpus_dir, "tiny", 42)
