"""A connected-digits corpus in the LibriSpeech layout (``prepare.sh --corpus digits``).

A small-vocabulary task that the transducer learns in minutes on 2 cores, with
sequence lengths that vary several-fold (issue 29: a condition in which models
learn and gradient outliers can arise by themselves).

Words: ``ZERO ONE ... NINE`` and ``OH`` (:data:`DIGIT_WORDS`, drawn uniformly).
An utterance is 1-6 *strings* of 3-7 digits each (at most
``DigitsSize.max_digits`` digits in all; a draw over it is redrawn).  Each
string is one call of the TTS voice
(:func:`icefall_lite.data.synthetic.tts.synthesize`), trimmed of its leading
and trailing silence; the strings are joined by planned silences
(``GAP_RANGE``, with ``LEAD_RANGE`` before the first and after the last) and
padded to at least ``MIN_SECONDS``.  Utterances last about 1-15 s (mean about
5 s; the default training part is about 3.3 h).  The transcript is the digit
words of all strings, in order.

Parts, as the fortune corpus (:mod:`icefall_lite.data.synthetic.corpus`):

* ``train-clean-100``: ``train_utts`` utterances read round-robin by
  ``train_speakers`` training voices (espeak-ng accents x variants and flite,
  random rate and pitch: :func:`tts.sample_voices` on the training pools);
* ``dev-clean``/``test-clean``: two disjoint subsets of the training voices;
* ``dev-other``/``test-other``: voices never used in training (the unseen pools
  of :mod:`tts`, different for dev and test), plus white, pink, brown or babble
  noise at 10-20 dB SNR, as the fortune corpus's ``-other`` parts.

Strings never cross parts: every string of an evaluation part is drawn so
that it occurs nowhere else in the corpus (not in training, not in another
evaluation part, not twice in its own part); the training part draws its
strings (repeats allowed) from those left.  Since there are only 11^3 = 1331
strings of 3 digits, about 46% of them (615) are reserved for evaluation in the
default size; every digit pair still occurs in training.

Everything (strings, voices, silences, noise, SNRs, peaks, seeds) is planned up
front from one ``np.random.default_rng(seed)``; the tree is written atomically
and described by ``SYNTHETIC.json`` (config ``{"corpus": "digits", ...}``), as
:func:`icefall_lite.data.synthetic.corpus.build_corpus` does.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from icefall_lite.data.layout import TRAIN_PART
from icefall_lite.data.synthetic import corpus as corpus_lib
from icefall_lite.data.synthetic import noise as noise_lib
from icefall_lite.data.synthetic import tts
from icefall_lite.data.synthetic.corpus_text import babble_sentences, oov_counts, out_of_vocabulary
from icefall_lite.utils import atomic_output

CORPUS_NAME = "digits"
DIGIT_WORDS = ("ZERO", "ONE", "TWO", "THREE", "FOUR", "FIVE", "SIX", "SEVEN", "EIGHT", "NINE", "OH")
LEAD_RANGE = (0.1, 0.3)  # seconds of silence before the first string and after the last
GAP_RANGE = (0.15, 0.45)  # seconds of silence between strings
TRIM_LEVEL = 0.005  # each string's TTS audio is trimmed to where |x| exceeds this fraction of its peak,
TRIM_MARGIN = 0.03  # plus this many seconds either side
MIN_SECONDS = 1.1  # shorter utterances are padded with silence (train.py drops cuts under 1 s)
# The order in which the parts draw their strings: evaluation parts first, so
# that they can take strings nobody else uses; training takes what is left.
PLAN_ORDER = ("dev-clean", "test-clean", "dev-other", "test-other", TRAIN_PART)


@dataclass(frozen=True)
class DigitsSize:
    """How big a digits corpus to make."""

    train_utts: int
    dev_utts: int  # per dev part
    test_utts: int  # per test part
    train_speakers: int
    eval_speakers: int  # speakers per dev/test part
    babble_segments: int  # babble noise segments for the -other parts
    babble_talkers: int
    babble_seconds: float
    utts_per_chapter: int
    strings: Tuple[int, int] = (1, 6)  # strings per utterance (inclusive range)
    digits: Tuple[int, int] = (3, 7)  # digits per string (inclusive range)
    max_digits: int = 28  # digits per utterance at most (keeps the slowest voices under 15 s)
    test_other_utts: Optional[int] = None  # test-other's utterances when not test_utts


# "regime" (studies/regime): a 1,000-utterance test-other (about 16,000 words, so one word is under 0.01 WER
# points) and strings of 4-7 digits, since 1,000 more evaluation utterances would take nearly all 1,331 strings
# of 3 digits from training. A corpus of its own: its training part is not the default's.
DIGITS_SIZES: Dict[str, DigitsSize] = {
    "default": DigitsSize(2400, 150, 300, 72, 12, 12, 5, 20.0, 40),
    "tiny": DigitsSize(40, 8, 8, 6, 3, 2, 3, 6.0, 20),
    "regime": DigitsSize(2400, 150, 300, 72, 12, 12, 5, 20.0, 40, digits=(4, 7), test_other_utts=1000),
}


@dataclass(frozen=True)
class DigitUtterance(corpus_lib.Utterance):
    """An utterance read as separate digit strings joined by planned silences.

    ``text`` is the strings joined by spaces; ``gaps[i]`` is the silence
    before string ``i`` (``gaps[0]`` leads), ``gaps[-1]`` the trailing one.
    """

    strings: Tuple[str, ...] = ()
    gaps: Tuple[float, ...] = ()

    def speech(self) -> np.ndarray:
        """Each string synthesized by ``voice`` and trimmed (:func:`trim_silence`), joined by ``gaps``,
        padded to ``MIN_SECONDS``."""
        pieces = []
        for gap, string in zip(self.gaps, self.strings + ("",)):
            pieces.append(np.zeros(int(round(gap * tts.SAMPLE_RATE)), dtype=np.float32))
            if string:
                pieces.append(trim_silence(tts.synthesize(self.voice, string)))
        samples = np.concatenate(pieces)
        short = int(round(MIN_SECONDS * tts.SAMPLE_RATE)) - samples.size
        if short > 0:
            samples = np.concatenate([samples, np.zeros(short, dtype=np.float32)])
        return samples


def trim_silence(samples: np.ndarray) -> np.ndarray:
    """``samples`` without the TTS's leading and trailing silence (below ``TRIM_LEVEL`` of the peak),
    ``TRIM_MARGIN`` s kept."""
    loud = np.flatnonzero(np.abs(samples) > TRIM_LEVEL * np.abs(samples).max())
    margin = int(TRIM_MARGIN * tts.SAMPLE_RATE)
    return samples[max(0, loud[0] - margin) : loud[-1] + 1 + margin]


def part_sizes(size: DigitsSize) -> Dict[str, int]:
    """Utterances per part."""
    return {
        TRAIN_PART: size.train_utts,
        "dev-clean": size.dev_utts,
        "dev-other": size.dev_utts,
        "test-clean": size.test_utts,
        "test-other": size.test_utts if size.test_other_utts is None else size.test_other_utts,
    }


def _draw_string(rng: np.random.Generator, length: int) -> str:
    return " ".join(DIGIT_WORDS[i] for i in rng.integers(len(DIGIT_WORDS), size=length))


def _draw_lengths(rng: np.random.Generator, size: DigitsSize) -> List[int]:
    """String lengths of one utterance: 1-6 strings of 3-7 digits, redrawn while over ``max_digits``."""
    while True:
        n = int(rng.integers(size.strings[0], size.strings[1] + 1))
        lengths = [int(x) for x in rng.integers(size.digits[0], size.digits[1] + 1, size=n)]
        if sum(lengths) <= size.max_digits:
            return lengths


def plan_strings(size: DigitsSize, rng: np.random.Generator) -> Dict[str, List[Tuple[str, ...]]]:
    """The strings of every utterance of every part (see the module docstring for the rules)."""
    evaluation_strings: Set[str] = set()
    taken = collections.Counter()  # evaluation strings by length
    out: Dict[str, List[Tuple[str, ...]]] = {}
    counts = part_sizes(size)
    for part in PLAN_ORDER:  # evaluation parts first, training last
        utts = []
        for _ in range(counts[part]):
            strings = []
            for length in _draw_lengths(rng, size):
                string = _draw_string(rng, length)
                # Evaluation: a string no part has yet. Training: any string no evaluation part has.
                if taken[length] >= len(DIGIT_WORDS) ** length:
                    raise ValueError(
                        f"every string of {length} digits is taken by the evaluation parts ({part}): "
                        f"make the evaluation parts smaller or the strings longer (DigitsSize.digits)"
                    )
                while string in evaluation_strings:
                    string = _draw_string(rng, length)
                if part != TRAIN_PART:
                    evaluation_strings.add(string)
                    taken[length] += 1
                strings.append(string)
            utts.append(tuple(strings))
        out[part] = utts
    return out


def _part_utterances(
    part: str,
    strings: Sequence[Tuple[str, ...]],
    voices: Sequence[tts.Voice],
    ids: corpus_lib.SpeakerIds,
    size: DigitsSize,
    rng: np.random.Generator,
) -> List[DigitUtterance]:
    """Utterances read round-robin by ``voices`` (:func:`corpus_lib.read_by_voices`), with silences and noise
    drawn."""
    noisy = part.endswith("-other")
    utts = []
    for voice, utt_id, utt_strings in corpus_lib.read_by_voices(strings, voices, ids, size.utts_per_chapter):
        gaps = [round(float(rng.uniform(*LEAD_RANGE)), 3)]
        gaps += [round(float(rng.uniform(*GAP_RANGE)), 3) for _ in utt_strings[1:]]
        gaps += [round(float(rng.uniform(*LEAD_RANGE)), 3)]
        noise = str(rng.choice(noise_lib.NOISE_TYPES)) if noisy else None
        utts.append(
            DigitUtterance(
                part=part,
                utt_id=utt_id,
                text=" ".join(utt_strings),
                voice=voice,
                noise=noise,
                snr_db=round(float(rng.uniform(*corpus_lib.OTHER_SNR_RANGE)), 2) if noisy else 0.0,
                peak=round(float(rng.uniform(*corpus_lib.PEAK_RANGE)), 3),
                seed=int(rng.integers(2**31)),
                strings=tuple(utt_strings),
                gaps=tuple(gaps),
            )
        )
    return utts


def plan_digits(size: DigitsSize, seed: int) -> corpus_lib.CorpusPlan:
    """Decide every utterance of the digits corpus (no audio is made here)."""
    rng = np.random.default_rng(seed)
    strings = plan_strings(size, rng)
    voices = corpus_lib.part_voices(rng, size.train_speakers, size.eval_speakers)
    ids = corpus_lib.SpeakerIds()
    utterances: List[corpus_lib.Utterance] = []
    for part in corpus_lib.READING_ORDER:
        utterances += _part_utterances(part, strings[part], voices[part], ids, size, rng)
    # Babble of the -other parts: as the fortune corpus (accent en-gb-x-gbcwmd, out-of-vocabulary fortune sentences).
    sentences, vocab = corpus_lib.load_sentences(corpus_lib.SIZES["default"].vocab_words)
    babble_names = tts.espeak_names(tts.BABBLE_ACCENTS[1:], tts.TRAIN_VARIANTS)
    babble_voices = tts.sample_voices(rng, size.babble_talkers * 2, babble_names, ())
    babble_text = babble_sentences(out_of_vocabulary(sentences, vocab), "other")
    babble_text = [babble_text[i] for i in rng.permutation(len(babble_text))]
    num_babble = size.babble_segments * size.babble_talkers * noise_lib.SENTENCES_PER_TALKER
    train_texts = [" ".join(s) for s in strings[TRAIN_PART]]
    oov = {p: oov_counts(train_texts, [" ".join(s) for s in strings[p]]) for p in PLAN_ORDER[:-1]}
    return corpus_lib.CorpusPlan(
        utterances=utterances,
        babble_voices=babble_voices,
        babble_sentences=babble_text[:num_babble],
        babble_seeds=[int(s) for s in rng.integers(2**31, size=size.babble_segments)],
        oov=oov,
    )


def digits_config(size_name: str, seed: int) -> dict:
    """What identifies a built digits corpus (recorded in ``SYNTHETIC.json``), as it reads back from JSON
    (lists, not tuples)."""
    params = asdict(DIGITS_SIZES[size_name])
    if params["test_other_utts"] is None:  # as corpora built before the field existed recorded it
        del params["test_other_utts"]
    config = {"corpus": CORPUS_NAME, "size": size_name, "seed": seed, "params": params}
    return json.loads(json.dumps(config))


def _string_stats(plan: corpus_lib.CorpusPlan) -> Dict[str, dict]:
    stats = {}
    for part in corpus_lib.PARTS:
        utts = [u for u in plan.utterances if u.part == part]
        strings = [len(u.strings) for u in utts]
        digits = [len(u.text.split()) for u in utts]
        stats[part] = {
            "strings_per_utterance_min_max": [min(strings), max(strings)] if utts else [],
            "digits_per_utterance_min_mean_max": [min(digits), round(float(np.mean(digits)), 2), max(digits)]
            if utts
            else [],
            "distinct_strings": len({s for u in utts for s in u.strings}),
        }
    return stats


def build_digits_corpus(dl_dir: Path, size_name: str = "default", seed: int = 42, num_jobs: int = 1) -> Path:
    """Build (or find) the digits corpus under ``dl_dir/LibriSpeech``; return that path."""
    corpus_dir = dl_dir / "LibriSpeech"
    config = digits_config(size_name, seed)
    if corpus_lib.existing_config(corpus_dir, config):
        logging.info(f"{corpus_dir} already holds the {size_name} digits corpus (seed {seed}) - skipping")
        return corpus_dir
    tts.check_tools()
    size = DIGITS_SIZES[size_name]
    start = time.time()
    plan = plan_digits(size, seed)
    logging.info(f"planned {len(plan.utterances)} digit utterances (size={size_name}, seed={seed}, {num_jobs} jobs)")
    extra = {
        "words": list(DIGIT_WORDS),
        "strings": _string_stats(plan),
        "silence_seconds": {"lead": list(LEAD_RANGE), "gap": list(GAP_RANGE), "min_utterance": MIN_SECONDS},
    }
    with atomic_output(corpus_dir) as partial:
        partial.mkdir()
        stats = corpus_lib._write_corpus_tree(partial, plan, size, config, num_jobs, extra_info=extra)
    for part, s in stats.items():
        lo, mean, hi = s["seconds_min_mean_max"] or [0, 0, 0]
        logging.info(
            f"{part}: {s['utterances']} utterances, {s['hours']:.3f} h, {s['speakers']} speakers, "
            f"{lo:.1f}-{hi:.1f} s (mean {mean:.1f})"
        )
    logging.info(f"digits corpus written to {corpus_dir} in {time.time() - start:.1f} s")
    return corpus_dir
