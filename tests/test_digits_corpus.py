"""The connected-digits corpus (icefall_lite/data/synthetic/digits.py, `prepare.sh --corpus digits`):
its plan (fast, no audio), a few rendered utterances, and the tiny build end to end."""

import dataclasses
import json
import os
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
from lhotse import load_manifest

from icefall_lite.data.bpe import load_bpe_model
from icefall_lite.data.layout import DEFAULT_PARTS, EVAL_PARTS, TRAIN_PART
from icefall_lite.data.synthetic import corpus as corpus_lib
from icefall_lite.data.synthetic import tts
from icefall_lite.data.synthetic.digits import (
    DIGIT_WORDS,
    DIGITS_SIZES,
    GAP_RANGE,
    LEAD_RANGE,
    MIN_SECONDS,
    DigitUtterance,
    digits_config,
    part_sizes,
    plan_digits,
    plan_strings,
)

RECIPE = Path(__file__).resolve().parents[1] / "egs" / "librispeech" / "ASR"
MAX_SECONDS = 15.0


@pytest.fixture(scope="module")
def default_plan() -> corpus_lib.CorpusPlan:
    return plan_digits(DIGITS_SIZES["default"], 42)


def _by_part(plan: corpus_lib.CorpusPlan) -> Dict[str, List[DigitUtterance]]:
    out = defaultdict(list)
    for u in plan.utterances:
        out[u.part].append(u)
    return out


def test_plan_sizes_words_and_string_ranges(default_plan: corpus_lib.CorpusPlan) -> None:
    size = DIGITS_SIZES["default"]
    parts = _by_part(default_plan)
    assert {p: len(u) for p, u in parts.items()} == part_sizes(size)
    assert part_sizes(size) == {
        TRAIN_PART: 2400,
        "dev-clean": 150,
        "dev-other": 150,
        "test-clean": 300,
        "test-other": 300,
    }
    assert len({u.utt_id for u in default_plan.utterances}) == len(default_plan.utterances)
    for u in default_plan.utterances:
        assert isinstance(u, DigitUtterance)
        assert 1 <= len(u.strings) <= 6 and all(3 <= len(s.split()) <= 7 for s in u.strings)
        assert len(u.text.split()) <= size.max_digits and u.text == " ".join(u.strings)
        assert set(u.text.split()) <= set(DIGIT_WORDS)
        assert len(u.gaps) == len(u.strings) + 1
        assert LEAD_RANGE[0] <= u.gaps[0] <= LEAD_RANGE[1] and LEAD_RANGE[0] <= u.gaps[-1] <= LEAD_RANGE[1]
        assert all(GAP_RANGE[0] <= g <= GAP_RANGE[1] for g in u.gaps[1:-1])
    # Lengths vary several-fold and every count of strings and digits occurs.
    assert {len(u.strings) for u in parts[TRAIN_PART]} == set(range(1, 7))
    assert {len(s.split()) for u in parts[TRAIN_PART] for s in u.strings} == set(range(3, 8))
    digits = [len(u.text.split()) for u in parts[TRAIN_PART]]
    assert min(digits) == 3 and max(digits) == size.max_digits
    # Every word in training, and no evaluation word unseen there.
    assert {w for u in parts[TRAIN_PART] for w in u.text.split()} == set(DIGIT_WORDS)
    assert all(oov == 0 for oov, _ in default_plan.oov.values())


def test_no_digit_string_in_two_parts(default_plan: corpus_lib.CorpusPlan) -> None:
    parts = _by_part(default_plan)
    strings = {p: [s for u in utts for s in u.strings] for p, utts in parts.items()}
    for i, a in enumerate(DEFAULT_PARTS):
        for b in DEFAULT_PARTS[i + 1 :]:
            assert not set(strings[a]) & set(strings[b]), (a, b)
    for part in EVAL_PARTS:  # not even twice within an evaluation part
        assert len(set(strings[part])) == len(strings[part]), part
    # Hence no evaluation utterance's text is a training text either.
    train_texts = {u.text for u in parts[TRAIN_PART]}
    assert not any(u.text in train_texts for p in EVAL_PARTS for u in parts[p])


def test_voices_split_as_librispeech(default_plan: corpus_lib.CorpusPlan) -> None:
    size = DIGITS_SIZES["default"]
    parts = _by_part(default_plan)
    voices = {p: {u.voice for u in utts} for p, utts in parts.items()}
    assert len(voices[TRAIN_PART]) == size.train_speakers
    assert all(len(voices[p]) == size.eval_speakers for p in EVAL_PARTS)
    assert voices["dev-clean"] <= voices[TRAIN_PART] and voices["test-clean"] <= voices[TRAIN_PART]
    assert not voices["dev-clean"] & voices["test-clean"]
    train_names = {v.name for v in voices[TRAIN_PART]}
    for part in ("dev-other", "test-other"):
        # Unseen: not one training voice setting, not even one training accent+variant or flite voice.
        assert not voices[part] & voices[TRAIN_PART] and not {v.name for v in voices[part]} & train_names
        for v in voices[part]:
            if v.engine == "espeak":
                accent, variant = v.name.split("+")
                assert accent in tts.OTHER_ACCENTS or variant in tts.OTHER_VARIANTS
            else:
                assert v.name in tts.OTHER_FLITE
    assert not voices["dev-other"] & voices["test-other"]
    for v in voices[TRAIN_PART]:
        assert v.name in tts.train_voice_names() or v.name in tts.TRAIN_FLITE
    # Each speaker id is one voice, within and across parts (LibriSpeech's speaker folders).
    by_speaker = defaultdict(set)
    for u in default_plan.utterances:
        by_speaker[u.utt_id.split("-")[0]].add(u.voice)
    assert all(len(v) == 1 for v in by_speaker.values())


def test_both_corpora_share_one_reading_assignment() -> None:
    """corpus.read_by_voices (used by both corpora): round-robin over the voices, shifted by one voice on each
    pass through a repeated pool; each voice's items in chapters; speaker and chapter numbers continue across
    calls that share the ids (the parts of one corpus), and a voice without items still gets its speaker."""
    a, b, c, d = "abcd"  # stand-ins for tts.Voice (any hashable)
    ids = corpus_lib.SpeakerIds()
    assert corpus_lib.read_by_voices(list("pqrstu"), [a, b, c], ids, 1) == [
        (a, "100-1001-0000", "p"),
        (a, "100-1002-0000", "s"),
        (b, "101-1003-0000", "q"),
        (b, "101-1004-0000", "t"),
        (c, "102-1005-0000", "r"),
        (c, "102-1006-0000", "u"),
    ]
    assert corpus_lib.read_by_voices(list("xyzxyz"), [c, a, d], ids, 2, repeat_period=3) == [
        (c, "102-1007-0000", "x"),
        (c, "102-1007-0001", "z"),
        (a, "100-1008-0000", "y"),
        (a, "100-1008-0001", "x"),
        (d, "103-1009-0000", "z"),
        (d, "103-1009-0001", "y"),
    ]
    assert corpus_lib.read_by_voices(["only"], [b, d], corpus_lib.SpeakerIds(), 2) == [(b, "100-1001-0000", "only")]
    fresh = corpus_lib.SpeakerIds()
    corpus_lib.read_by_voices(["only"], [b, d], fresh, 2)
    assert fresh.speakers == {b: 100, d: 101}


def test_noise_only_in_the_other_parts(default_plan: corpus_lib.CorpusPlan) -> None:
    for u in default_plan.utterances:
        if u.part.endswith("-other"):
            assert u.noise in ("white", "pink", "brown", "babble") and 10.0 <= u.snr_db <= 20.0
        else:
            assert u.noise is None and u.snr_db == 0.0
    assert {u.noise for u in default_plan.utterances if u.part == "test-other"} == {"white", "pink", "brown", "babble"}
    assert default_plan.babble_sentences and len(default_plan.babble_seeds) == DIGITS_SIZES["default"].babble_segments


def test_plan_is_deterministic_for_a_seed(default_plan: corpus_lib.CorpusPlan) -> None:
    again = plan_digits(DIGITS_SIZES["default"], 42)
    assert again.utterances == default_plan.utterances
    assert again.babble_sentences == default_plan.babble_sentences and again.babble_seeds == default_plan.babble_seeds
    other = plan_digits(DIGITS_SIZES["default"], 43)
    assert [u.text for u in other.utterances] != [u.text for u in default_plan.utterances]


def _slowness(u: DigitUtterance) -> float:
    """Seconds per digit, roughly, of ``u``'s voice (slow espeak rate or long flite stretch)."""
    v = u.voice
    return 0.33 * 145 / v.rate if v.engine == "espeak" else 0.3 * v.rate / 0.85


def test_rendered_durations_and_determinism(default_plan: corpus_lib.CorpusPlan, tmp_path: Path) -> None:
    parts = _by_part(default_plan)
    utts = parts[TRAIN_PART] + parts["test-other"]
    longest = sorted(utts, key=lambda u: -len(u.text.split()) * _slowness(u))[:3]
    shortest = sorted(utts, key=lambda u: len(u.text.split()) * _slowness(u))[:2]
    noisy = [u for u in parts["test-other"] if u.noise == "babble"][:1] + [
        u for u in parts["dev-other"] if u.noise == "pink"
    ][:1]
    # The babble utterance draws its noise from the bank: one segment of it is enough here (the bank of the
    # default size, 12 segments of 5 talkers, takes half a minute to synthesize).
    one_segment = dataclasses.replace(default_plan, babble_seeds=default_plan.babble_seeds[:1])
    corpus_lib.set_babble_bank(corpus_lib.make_babble_bank(one_segment, DIGITS_SIZES["default"], 1))
    for u in longest + shortest + noisy:
        utt_id, seconds, error = corpus_lib.render_utterance((u, tmp_path / "a"))
        assert error == "", error
        assert MIN_SECONDS <= seconds <= MAX_SECONDS, (utt_id, seconds, u.voice.describe(), u.text)
        utt_id, again, error = corpus_lib.render_utterance((u, tmp_path / "b"))
        assert (tmp_path / "a" / u.relpath).read_bytes() == (tmp_path / "b" / u.relpath).read_bytes(), utt_id
    assert max(len(u.text.split()) for u in longest) == DIGITS_SIZES["default"].max_digits


def run_prepare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(RECIPE / "prepare.sh"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


@pytest.fixture(scope="module")
def tiny_digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Work dir of `prepare.sh --corpus digits --size tiny` (every stage)."""
    work = tmp_path_factory.mktemp("tiny_digits") / "work"
    proc = run_prepare("--corpus", "digits", "--size", "tiny", "--work-dir", str(work), "--nj", "2")
    assert proc.returncode == 0, proc.stdout[-5000:]
    return work


def _transcripts(part_dir: Path) -> Dict[str, str]:
    out = {}
    for trans in part_dir.rglob("*.trans.txt"):
        for line in trans.read_text().splitlines():
            utt, text = line.split(maxsplit=1)
            out[utt] = text
    return out


def test_tiny_build_end_to_end(tiny_digits: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corpus = tiny_digits / "download" / "LibriSpeech"
    info = json.loads((corpus / "SYNTHETIC.json").read_text())
    assert (
        info["config"]["corpus"] == "digits" and info["config"]["size"] == "tiny" and info["words"] == list(DIGIT_WORDS)
    )
    plan = {u.utt_id: u for u in plan_digits(DIGITS_SIZES["tiny"], 42).utterances}
    size = DIGITS_SIZES["tiny"]
    for part in DEFAULT_PARTS:
        texts = _transcripts(corpus / part)
        assert {u: t for u, t in texts.items()} == {i: u.text for i, u in plan.items() if u.part == part}
        assert len(texts) == part_sizes(size)[part] == info["parts"][part]["utterances"]
        lo, _, hi = info["parts"][part]["seconds_min_mean_max"]
        assert MIN_SECONDS <= lo and hi <= MAX_SECONDS
    monkeypatch.chdir(tiny_digits)
    fbank = tiny_digits / "data" / "fbank"
    for part in DEFAULT_PARTS:
        cuts = load_manifest(fbank / f"librispeech_cuts_{part}.jsonl.gz")
        assert len(cuts) == part_sizes(size)[part]
        assert cuts[0].load_features().shape == (cuts[0].num_frames, 80)
    assert (fbank / "noise_cuts.jsonl.gz").is_file()
    lang = tiny_digits / "data" / "lang_bpe_30"  # the default vocabulary size of --corpus digits
    sp = load_bpe_model(lang / "bpe.model")
    assert sp.get_piece_size() == 30 and len((lang / "tokens.txt").read_text().splitlines()) == 30
    for word in DIGIT_WORDS:
        assert sp.decode(sp.encode(word)) == word
    leftovers = [p for p in tiny_digits.rglob("*") if p.name.startswith(".tmp") or p.name.endswith(".partial")]
    assert leftovers == []


def test_rerun_skips_and_another_corpus_is_refused(tiny_digits: Path) -> None:
    proc = run_prepare("--corpus", "digits", "--size", "tiny", "--work-dir", str(tiny_digits), "--stop-stage", "0")
    assert proc.returncode == 0 and "already holds the tiny digits corpus" in proc.stdout, proc.stdout[-3000:]
    proc = run_prepare("--size", "tiny", "--work-dir", str(tiny_digits), "--stop-stage", "0")
    assert proc.returncode != 0
    assert "was built with corpus=digits size=tiny seed=42, not size=tiny seed=42" in proc.stdout
    proc = run_prepare("--corpus", "digits", "--size", "small", "--work-dir", str(tiny_digits))
    assert proc.returncode == 2 and "--size must be default, tiny or regime with --corpus digits" in proc.stdout


def test_regime_size_has_a_large_test_other_and_strings_of_4_to_7_digits() -> None:
    plan = plan_digits(DIGITS_SIZES["regime"], 42)
    parts = _by_part(plan)
    assert {p: len(u) for p, u in parts.items()} == {
        TRAIN_PART: 2400,
        "dev-clean": 150,
        "dev-other": 150,
        "test-clean": 300,
        "test-other": 1000,
    }
    # At least 10,000 words, so that one word is under 0.01 WER points.
    assert sum(len(u.text.split()) for u in parts["test-other"]) >= 10_000
    assert {len(s.split()) for u in plan.utterances for s in u.strings} == set(range(4, 8))
    strings = [s for p in EVAL_PARTS for u in parts[p] for s in u.strings]
    assert len(set(strings)) == len(strings), "no evaluation string twice"
    assert not set(strings) & {s for u in parts[TRAIN_PART] for s in u.strings}


def test_built_default_and_tiny_corpora_keep_their_recorded_settings() -> None:
    # The settings a default or tiny corpus recorded in SYNTHETIC.json before the regime size (and its
    # test_other_utts field) existed: such a corpus must still be recognised, not rebuilt.
    recorded = {
        "train_utts": 2400,
        "dev_utts": 150,
        "test_utts": 300,
        "train_speakers": 72,
        "eval_speakers": 12,
        "babble_segments": 12,
        "babble_talkers": 5,
        "babble_seconds": 20.0,
        "utts_per_chapter": 40,
        "strings": [1, 6],
        "digits": [3, 7],
        "max_digits": 28,
    }
    assert digits_config("default", 42) == {"corpus": "digits", "size": "default", "seed": 42, "params": recorded}
    assert "test_other_utts" not in digits_config("tiny", 42)["params"]
    assert digits_config("regime", 42)["params"]["test_other_utts"] == 1000


def test_evaluation_parts_that_would_take_every_string_are_refused() -> None:
    # 11 strings of one digit: 12 evaluation utterances of one string each cannot all be new.
    size = dataclasses.replace(DIGITS_SIZES["tiny"], strings=(1, 1), digits=(1, 1), max_digits=1)
    with pytest.raises(ValueError, match=r"every string of 1 digits is taken by the evaluation parts"):
        plan_strings(size, np.random.default_rng(0))
