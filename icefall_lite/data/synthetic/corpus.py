"""The synthetic LibriSpeech-layout corpus: plan, render, write.

Layout written (as LibriSpeech's own)::

    <dl_dir>/LibriSpeech/<part>/<speaker>/<chapter>/<speaker>-<chapter>-<utt>.flac
    <dl_dir>/LibriSpeech/<part>/<speaker>/<chapter>/<speaker>-<chapter>.trans.txt
    <dl_dir>/LibriSpeech/<part>/.completed          (lhotse's "part done" marker)
    <dl_dir>/LibriSpeech/SYNTHETIC.json             (configuration and statistics)

Parts: ``train-clean-100`` (the training part: LibriSpeech's name, synthetic
content), ``dev-clean``/``test-clean`` (training voices, unseen sentences),
``dev-other``/``test-other`` (voices never used in training plus white, pink,
brown or babble noise at ``OTHER_SNR_RANGE`` dB).  No sentence is in two parts.

The training part has a base (sentences of the ``vocab_words`` most frequent
words, as the evaluation parts) and, for the larger sizes, extra speech: more
voices reading sentences with rarer words (within ``extra_vocab_words``), none
of them in an evaluation part or in the babble of the ``-other`` parts.  The
extra speech is planned after everything else from its own random stream, so
every size with the same base (``small`` and ``default``) has the same
evaluation parts, utterance for utterance.

The whole plan (texts, voices, noise types, SNRs, gains, seeds) is drawn up
front from one seeded generator, so the corpus is the same for a seed whatever
the number of worker processes.  The tree is built in ``.tmp-LibriSpeech``
(:func:`icefall_lite.utils.atomic_output`) and renamed to ``LibriSpeech`` only when complete.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, FrozenSet, List, Optional, Sequence, Set, Tuple, TypeVar

import numpy as np
import soundfile as sf

from icefall_lite.data.layout import DEFAULT_PARTS, EVAL_PARTS, TRAIN_PART
from icefall_lite.data.synthetic import noise as noise_lib
from icefall_lite.data.synthetic import tts
from icefall_lite.data.synthetic.corpus_text import (
    babble_sentences,
    fortune_files,
    frequent_vocabulary,
    oov_counts,
    read_fortunes,
    sentence_pool,
    split_sentences_for_corpus,
)
from icefall_lite.utils import atomic_output, parallel_imap

PARTS = DEFAULT_PARTS
T = TypeVar("T")
OTHER_SNR_RANGE = (10.0, 20.0)
PEAK_RANGE = (0.3, 0.95)
# Duration ~ 0.52 s + 0.24 s/word (least-squares fit on the default corpus);
# used only to plan the size of the training part.
SECONDS_PER_WORD = 0.24
SECONDS_PER_UTT = 0.52
MARKER = "SYNTHETIC.json"


@dataclass(frozen=True)
class CorpusSize:
    """How big a corpus to make."""

    vocab_words: int  # speech sentences use only these most frequent words
    train_hours: float  # planned hours of training audio (estimated before synthesis)
    max_train_utts: Optional[int]  # cap on training utterances (tiny corpus)
    eval_utts: int  # utterances per dev/test part
    train_speakers: int
    eval_speakers: int  # speakers per dev/test part
    babble_segments: int  # babble noise segments for the -other parts
    babble_talkers: int
    babble_seconds: float
    utts_per_chapter: int
    extra_train_hours: float = 0.0  # planned hours of extra training speech
    extra_train_speakers: int = 0  # voices of the extra speech (tts.extra_voice_names(), TRAIN_FLITE)
    extra_vocab_words: int = 0  # extra sentences use only these most frequent words


SIZES: Dict[str, CorpusSize] = {
    "default": CorpusSize(2000, 3.0, None, 300, 48, 12, 12, 5, 20.0, 40, 7.0, 240, 10000),
    "small": CorpusSize(2000, 3.0, None, 300, 48, 12, 12, 5, 20.0, 40),
    "tiny": CorpusSize(2000, 0.0, 40, 8, 6, 3, 2, 3, 6.0, 20),
}
# The random stream of the extra training speech: np.random.default_rng([seed, EXTRA_STREAM]).
EXTRA_STREAM = 1


@dataclass(frozen=True)
class Utterance:
    """Everything needed to render one utterance, decided at planning time."""

    part: str
    utt_id: str  # <speaker>-<chapter>-<index>
    text: str
    voice: tts.Voice
    noise: Optional[str]  # None, a colour, or "babble"
    snr_db: float
    peak: float
    seed: int

    @property
    def relpath(self) -> Path:
        """``<part>/<speaker>/<chapter>/<utt_id>.flac``."""
        speaker, chapter, _ = self.utt_id.split("-")
        return Path(self.part) / speaker / chapter / f"{self.utt_id}.flac"

    def speech(self) -> np.ndarray:
        """The clean speech of this utterance (before noise and peak): ``text`` read by ``voice``.

        Subclasses that read their text in pieces override it
        (:class:`icefall_lite.data.synthetic.digits.DigitUtterance`).
        """
        return tts.synthesize(self.voice, self.text)


@dataclass
class CorpusPlan:
    """The utterances of every part and the babble material for the noise."""

    utterances: List[Utterance]
    babble_voices: List[tts.Voice]
    babble_sentences: List[str]
    babble_seeds: List[int]
    oov: Dict[str, Tuple[int, int]]


def estimated_seconds(text: str) -> float:
    """A rough duration of ``text`` read by one of the corpus's voices."""
    return SECONDS_PER_UTT + SECONDS_PER_WORD * len(text.split())


@functools.lru_cache(maxsize=4)
def load_sentences(vocab_words: int) -> Tuple[Tuple[str, ...], FrozenSet[str]]:
    """The normalised fortune sentences and their ``vocab_words`` most frequent words (cached)."""
    paragraphs = [p for f in fortune_files() for p in read_fortunes(f)]
    sentences = sentence_pool(paragraphs)
    return tuple(sentences), frozenset(frequent_vocabulary(sentences, vocab_words))


def _train_texts(pool: Sequence[str], size: CorpusSize) -> List[str]:
    """Training sentences: the pool in order, cycled until ``train_hours`` is planned."""
    if size.max_train_utts is not None:
        return list(pool[: size.max_train_utts])
    return _cycle_to_hours(pool, size.train_hours)


def _cycle_to_hours(pool: Sequence[str], hours: float) -> List[str]:
    """``pool`` in order, cycled until ``hours`` of speech are planned."""
    if hours > 0 and not pool:
        raise ValueError("no sentences to plan training speech from")
    texts: List[str] = []
    seconds = 0.0
    target = hours * 3600.0
    while seconds < target:
        text = pool[len(texts) % len(pool)]
        texts.append(text)
        seconds += estimated_seconds(text)
    return texts


class SpeakerIds:
    """Deterministic LibriSpeech-style speaker and chapter numbers, shared by all parts of one corpus."""

    def __init__(self) -> None:
        self.speakers: Dict[tts.Voice, int] = {}
        self.next_chapter = 1000

    def speaker(self, voice: tts.Voice) -> int:
        return self.speakers.setdefault(voice, 100 + len(self.speakers))

    def chapter(self) -> int:
        self.next_chapter += 1
        return self.next_chapter


# The order in which the parts are read (speaker and chapter numbers, and the random draws of each
# utterance, follow it).
READING_ORDER = (TRAIN_PART, "dev-other", "test-other", "dev-clean", "test-clean")


def part_voices(rng: np.random.Generator, train_speakers: int, eval_speakers: int) -> Dict[str, List[tts.Voice]]:
    """The voices of every part (both corpora): ``train_speakers`` voices from the training pools read the
    training part; ``dev-clean`` and ``test-clean`` get two disjoint random subsets of ``eval_speakers`` of
    them (``test-clean`` the same as ``dev-clean`` when there are too few); ``dev-other`` and ``test-other``
    ``eval_speakers`` voices each from the unseen pools."""
    n = eval_speakers
    train_voices = tts.sample_voices(rng, train_speakers, tts.train_voice_names(), tts.TRAIN_FLITE)
    other_voices = tts.sample_voices(rng, 2 * n, tts.other_voice_names(), tts.OTHER_FLITE)
    clean_idx = rng.permutation(len(train_voices))
    return {
        TRAIN_PART: train_voices,
        "dev-clean": [train_voices[i] for i in clean_idx[:n]],
        "test-clean": [train_voices[i] for i in clean_idx[n : 2 * n]] or [train_voices[i] for i in clean_idx[:n]],
        "dev-other": other_voices[:n],
        "test-other": other_voices[n:],
    }


def read_by_voices(
    items: Sequence[T],
    voices: Sequence[tts.Voice],
    ids: SpeakerIds,
    utts_per_chapter: int,
    repeat_period: Optional[int] = None,
) -> List[Tuple[tts.Voice, str, T]]:
    """Who reads what, and the utterance ids (both corpora): ``items`` read round-robin by ``voices``,
    each voice's items grouped in order into chapters of ``utts_per_chapter``. Item ``i`` is read by
    ``voices[(i % p + i // p) % len(voices)]`` with ``p = repeat_period`` (default ``len(items)``: plain
    round-robin); with ``p`` the size of a pool that ``items`` cycles through, each pass starts one voice
    later, so a repeated item is read by another voice.

    Returns ``(voice, utt_id, item)`` voice by voice, chapter by chapter; ``utt_id`` is
    ``<speaker>-<chapter>-<index in chapter>``."""
    period = len(items) if repeat_period is None else repeat_period
    by_voice: Dict[tts.Voice, List[T]] = defaultdict(list)
    for i, item in enumerate(items):
        by_voice[voices[(i % period + i // period) % len(voices)]].append(item)
    out = []
    for voice in voices:
        speaker = ids.speaker(voice)
        lines = by_voice[voice]
        for start in range(0, len(lines), utts_per_chapter):
            chapter = ids.chapter()
            for k, item in enumerate(lines[start : start + utts_per_chapter]):
                out.append((voice, f"{speaker}-{chapter}-{k:04d}", item))
    return out


def _part_utterances(
    part: str,
    texts: Sequence[str],
    voices: Sequence[tts.Voice],
    ids: SpeakerIds,
    size: CorpusSize,
    rng: np.random.Generator,
) -> List[Utterance]:
    """``texts`` read by ``voices`` (:func:`read_by_voices`; a sentence repeated in the training part, a
    second pass through the pool, is read by the next voice), with noise drawn."""
    noisy = part.endswith("-other")
    utts = []
    for voice, utt_id, text in read_by_voices(texts, voices, ids, size.utts_per_chapter, len(set(texts))):
        noise = str(rng.choice(noise_lib.NOISE_TYPES)) if noisy else None
        utts.append(
            Utterance(
                part=part,
                utt_id=utt_id,
                text=text,
                voice=voice,
                noise=noise,
                snr_db=round(float(rng.uniform(*OTHER_SNR_RANGE)), 2) if noisy else 0.0,
                peak=round(float(rng.uniform(*PEAK_RANGE)), 3),
                seed=int(rng.integers(2**31)),
            )
        )
    return utts


def plan_corpus(size: CorpusSize, seed: int) -> CorpusPlan:
    """Decide every utterance of the corpus (no audio is made here)."""
    rng = np.random.default_rng(seed)
    sentences, vocab = load_sentences(size.vocab_words)
    splits = split_sentences_for_corpus(sentences, vocab, EVAL_PARTS, size.eval_utts, rng)
    voices = part_voices(rng, size.train_speakers, size.eval_speakers)
    texts = {TRAIN_PART: _train_texts(splits.train, size), **splits.eval}
    ids = SpeakerIds()
    utterances: List[Utterance] = []
    for part in READING_ORDER:
        utterances += _part_utterances(part, texts[part], voices[part], ids, size, rng)
    babble_names = tts.espeak_names(tts.BABBLE_ACCENTS[1:], tts.TRAIN_VARIANTS)
    babble_voices = tts.sample_voices(rng, size.babble_talkers * 2, babble_names, ())
    oov = {p: oov_counts(texts[TRAIN_PART], texts[p]) for p in EVAL_PARTS}
    babble_text = babble_sentences(splits.babble, "other")
    babble_text = [babble_text[i] for i in rng.permutation(len(babble_text))]
    num_babble = size.babble_segments * size.babble_talkers * noise_lib.SENTENCES_PER_TALKER
    if size.extra_train_hours > 0:
        utterances += _extra_train_utterances(sentences, vocab, set(babble_text[:num_babble]), ids, size, seed)
    return CorpusPlan(
        utterances=utterances,
        babble_voices=babble_voices,
        babble_sentences=babble_text[:num_babble],
        babble_seeds=[int(s) for s in rng.integers(2**31, size=size.babble_segments)],
        oov=oov,
    )


def extra_train_pool(
    sentences: Sequence[str], base_vocab: FrozenSet[str], extra_vocab_words: int, excluded: Set[str]
) -> List[str]:
    """Sentences for the extra training speech, in corpus order.

    Those with every word among the ``extra_vocab_words`` most frequent but at
    least one outside ``base_vocab`` (so none can be in an evaluation part),
    minus ``excluded`` (the babble sentences of the ``-other`` parts).
    """
    wider = frequent_vocabulary(sentences, extra_vocab_words)
    return [
        s
        for s in sentences
        if s not in excluded and all(w in wider for w in s.split()) and not all(w in base_vocab for w in s.split())
    ]


def _extra_train_utterances(
    sentences: Sequence[str],
    base_vocab: FrozenSet[str],
    excluded: Set[str],
    ids: SpeakerIds,
    size: CorpusSize,
    seed: int,
) -> List[Utterance]:
    """The extra training speech, from its own random stream (see the module docstring)."""
    rng = np.random.default_rng([seed, EXTRA_STREAM])
    pool = extra_train_pool(sentences, base_vocab, size.extra_vocab_words, excluded)
    pool = [pool[i] for i in rng.permutation(len(pool))]
    voices = tts.sample_voices(rng, size.extra_train_speakers, tts.extra_voice_names(), tts.TRAIN_FLITE)
    texts = _cycle_to_hours(pool, size.extra_train_hours)
    return _part_utterances(TRAIN_PART, texts, voices, ids, size, rng)


# --- rendering (runs in worker processes) ------------------------------------

_BABBLE_BANK: List[np.ndarray] = []


def set_babble_bank(bank: List[np.ndarray]) -> None:
    """Give this process the babble segments (a worker initializer)."""
    global _BABBLE_BANK
    _BABBLE_BANK = bank


def _babble_segment(args: Tuple[List[tts.Voice], List[str], int, int]) -> np.ndarray:
    voices, sentences, num_samples, seed = args
    return noise_lib.babble(voices, sentences, num_samples, np.random.default_rng(seed))


def make_babble_bank(plan: CorpusPlan, size: CorpusSize, num_jobs: int) -> List[np.ndarray]:
    """Render the babble segments that noise the ``-other`` parts."""
    num_samples = int(size.babble_seconds * tts.SAMPLE_RATE)
    per_seg = size.babble_talkers * noise_lib.SENTENCES_PER_TALKER
    jobs = []
    for k, seed in enumerate(plan.babble_seeds):
        voices = [plan.babble_voices[(k + j) % len(plan.babble_voices)] for j in range(size.babble_talkers)]
        sentences = plan.babble_sentences[k * per_seg : (k + 1) * per_seg] or plan.babble_sentences
        jobs.append((voices, sentences, num_samples, seed))
    return list(parallel_imap(_babble_segment, jobs, num_jobs, desc="babble for -other"))


def _noise_for(utt: Utterance, num_samples: int, rng: np.random.Generator) -> np.ndarray:
    if utt.noise == "babble":
        seg = _BABBLE_BANK[int(rng.integers(len(_BABBLE_BANK)))]
        if seg.size > num_samples:
            start = int(rng.integers(seg.size - num_samples))
            seg = seg[start : start + num_samples]
        return seg
    return noise_lib.coloured_noise(str(utt.noise), num_samples, rng)


def render_utterance(job: Tuple[Utterance, Path]) -> Tuple[str, float, str]:
    """Synthesize, noise and write one utterance.

    Returns ``(utt_id, seconds, error)``; ``error`` is empty on success, else
    the reason (the utterance is then left out and counted by the caller).
    """
    utt, root = job
    try:
        samples = utt.speech()
        rng = np.random.default_rng(utt.seed)
        if utt.noise is not None:
            noise = _noise_for(utt, samples.size, rng)
            samples = noise_lib.mix_at_snr(samples, noise, utt.snr_db)
        samples = noise_lib.set_peak(samples, utt.peak)
        path = root / utt.relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        sf.write(str(path), samples, tts.SAMPLE_RATE, format="FLAC", subtype="PCM_16")
        return utt.utt_id, samples.size / tts.SAMPLE_RATE, ""
    except (tts.SynthesisError, ValueError, OSError, RuntimeError) as e:
        return utt.utt_id, 0.0, f"{type(e).__name__}: {e}"


def write_transcripts(root: Path, utterances: Sequence[Utterance]) -> None:
    """Write one ``<speaker>-<chapter>.trans.txt`` per chapter folder, sorted."""
    by_chapter: Dict[Path, List[Utterance]] = defaultdict(list)
    for utt in utterances:
        by_chapter[(root / utt.relpath).parent].append(utt)
    for folder, utts in by_chapter.items():
        speaker, chapter = folder.parent.name, folder.name
        lines = "".join(f"{u.utt_id} {u.text}\n" for u in sorted(utts, key=lambda u: u.utt_id))
        (folder / f"{speaker}-{chapter}.trans.txt").write_text(lines)


# --- the whole corpus ---------------------------------------------------------


def corpus_config(size_name: str, seed: int) -> dict:
    """What identifies a built corpus: size name, its parameters, seed."""
    return {"size": size_name, "seed": seed, "params": asdict(SIZES[size_name])}


def built_config(corpus_dir: Path) -> dict:
    """The :func:`corpus_config` a built corpus records in its marker file."""
    return json.loads((corpus_dir / MARKER).read_text())["config"]


def describe_config(config: dict) -> str:
    """``size=<size> seed=<seed>``, preceded by ``corpus=<name>`` for a corpus other than the fortune one."""
    corpus = f"corpus={config['corpus']} " if "corpus" in config else ""
    return f"{corpus}size={config['size']} seed={config['seed']}"


def existing_corpus(corpus_dir: Path, size_name: str, seed: int) -> bool:
    """True when ``corpus_dir`` already holds this synthetic corpus.

    Raises:
        FileExistsError: ``corpus_dir`` holds something else (another size or
            seed, or a real LibriSpeech); the message says what to remove.
    """
    return existing_config(corpus_dir, corpus_config(size_name, seed))


def existing_config(corpus_dir: Path, wanted: dict) -> bool:
    """True when ``corpus_dir`` already holds the synthetic corpus whose marker records ``wanted``.

    Raises:
        FileExistsError: ``corpus_dir`` holds something else (another corpus,
            size or seed, or a real LibriSpeech); the message says what to remove.
    """
    if not corpus_dir.exists():
        return False
    marker = corpus_dir / MARKER
    if not marker.is_file():
        raise FileExistsError(
            f"{corpus_dir} exists but is not a synthetic corpus (no {MARKER}); "
            f"refusing to write into it. Use another --dl-dir or remove it."
        )
    built = built_config(corpus_dir)
    if built != wanted:
        raise FileExistsError(
            f"{corpus_dir} was built with {describe_config(built)}, "
            f"not {describe_config(wanted)}. Remove {corpus_dir} and the data/ "
            f"outputs made from it (data/manifests, data/fbank, data/lang_bpe_*) to rebuild."
        )
    return True


def _part_stats(utts: Sequence[Utterance], seconds: Dict[str, float]) -> Dict[str, dict]:
    stats: Dict[str, dict] = {}
    for part in PARTS:
        done = [u for u in utts if u.part == part and u.utt_id in seconds]
        durations = [seconds[u.utt_id] for u in done]
        stats[part] = {
            "utterances": len(done),
            "hours": round(sum(durations) / 3600.0, 4),
            "speakers": len({u.voice for u in done}),
            "seconds_min_mean_max": [round(f(durations), 2) for f in (min, np.mean, max)] if durations else [],
        }
    return stats


def _write_corpus_tree(
    root: Path, plan: CorpusPlan, size, config: dict, num_jobs: int, extra_info: Optional[dict] = None
) -> Dict[str, dict]:
    """Synthesize ``plan`` into ``root`` (audio, transcripts, ``.completed`` and the marker); per-part stats.

    ``size`` gives the babble material (``babble_seconds``, ``babble_talkers``);
    the marker records ``config`` (what :func:`existing_config` compares) and ``extra_info``.
    """
    bank = make_babble_bank(plan, size, num_jobs)
    jobs = [(u, root) for u in plan.utterances]
    seconds: Dict[str, float] = {}
    failures = []
    for utt_id, secs, error in parallel_imap(
        render_utterance, jobs, num_jobs, desc="synthesizing", initializer=set_babble_bank, initargs=(bank,)
    ):
        if error:
            logging.warning(f"skipping utterance {utt_id}: {error}")
            failures.append(utt_id)
        else:
            seconds[utt_id] = secs
    if failures:
        logging.warning(f"skipped {len(failures)} of {len(jobs)} utterances that failed to synthesize")
    write_transcripts(root, [u for u in plan.utterances if u.utt_id in seconds])
    stats = _part_stats(plan.utterances, seconds)
    for part in PARTS:
        (root / part).mkdir(exist_ok=True)
        (root / part / ".completed").touch()
    info = {
        "config": config,
        "parts": stats,
        "other_snr_db": list(OTHER_SNR_RANGE),
        "oov": {p: {"oov_words": a, "words": b} for p, (a, b) in plan.oov.items()},
        "failed_utterances": failures,
        **(extra_info or {}),
    }
    (root / MARKER).write_text(json.dumps(info, indent=2))
    return stats


def build_corpus(dl_dir: Path, size_name: str = "default", seed: int = 42, num_jobs: int = 1) -> Path:
    """Build (or find) the synthetic corpus under ``dl_dir/LibriSpeech``; return that path."""
    corpus_dir = dl_dir / "LibriSpeech"
    if existing_corpus(corpus_dir, size_name, seed):
        logging.info(f"{corpus_dir} already holds the {size_name} corpus (seed {seed}) - skipping")
        return corpus_dir
    tts.check_tools()
    size = SIZES[size_name]
    start = time.time()
    plan = plan_corpus(size, seed)
    logging.info(f"planned {len(plan.utterances)} utterances (size={size_name}, seed={seed}, {num_jobs} jobs)")
    with atomic_output(corpus_dir) as partial:
        partial.mkdir()
        stats = _write_corpus_tree(partial, plan, size, corpus_config(size_name, seed), num_jobs)
    for part, s in stats.items():
        logging.info(f"{part}: {s['utterances']} utterances, {s['hours']:.3f} h, {s['speakers']} speakers")
    logging.info(f"corpus written to {corpus_dir} in {time.time() - start:.1f} s")
    return corpus_dir
