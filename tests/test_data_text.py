"""Unit tests of the data helpers that need no audio: text, sentence splits,
noise signals, atomic writes, BPE training."""

from pathlib import Path

import numpy as np
import pytest

from icefall_lite.data.bpe import SPECIAL_IDS, VocabSizeError, load_bpe_model, train_bpe_model, write_transcript_words
from icefall_lite.data.synthetic.corpus_text import (
    babble_sentences,
    oov_counts,
    out_of_vocabulary,
    sentence_pool,
    split_sentences_for_corpus,
)
from icefall_lite.data.synthetic.noise import coloured_noise, mix_at_snr, set_peak
from icefall_lite.data.text_norm import (
    TranscriptError,
    normalize_text,
    number_to_words,
    ordinal_to_words,
    split_sentences,
    validate_transcript,
)
from icefall_lite.utils import atomic_output


@pytest.mark.parametrize(
    "n, words",
    [
        (0, "ZERO"),
        (13, "THIRTEEN"),
        (40, "FORTY"),
        (99, "NINETY NINE"),
        (100, "ONE HUNDRED"),
        (1984, "ONE THOUSAND NINE HUNDRED EIGHTY FOUR"),
        (2000000, "TWO MILLION"),
    ],
)
def test_number_to_words(n: int, words: str) -> None:
    assert number_to_words(n) == words


def test_ordinals() -> None:
    assert ordinal_to_words(1) == "FIRST"
    assert ordinal_to_words(21) == "TWENTY FIRST"
    assert ordinal_to_words(12) == "TWELFTH"
    assert ordinal_to_words(40) == "FORTIETH"
    assert ordinal_to_words(100) == "ONE HUNDREDTH"


@pytest.mark.parametrize(
    "raw, norm",
    [
        ("A day for firm decisions!!!!!  Or is it?", "A DAY FOR FIRM DECISIONS OR IS IT"),
        ("Mr. Smith's long-forgotten café", "MISTER SMITH'S LONG FORGOTTEN CAFE"),
        (
            "He was born on the 3rd of May, 1,200 years ago.",
            "HE WAS BORN ON THE THIRD OF MAY ONE THOUSAND TWO HUNDRED YEARS AGO",
        ),
        ("Pi is 3.14 & $5 is 100%", "PI IS THREE POINT ONE FOUR AND FIVE DOLLARS IS ONE HUNDRED PERCENT"),
        ('\u2018Don\u2019t\u2019 "quote" me', "DON'T QUOTE ME"),
    ],
)
def test_normalize_text(raw: str, norm: str) -> None:
    assert normalize_text(raw) == norm


def test_normalize_text_refuses_what_it_cannot_spell() -> None:
    with pytest.raises(TranscriptError, match=r"\['\\u6f22', '\\u5b57'\]|漢"):
        normalize_text("the word 漢字 stays")


def test_validate_transcript_normalises_case_and_spaces() -> None:
    assert validate_transcript("  hello   World ", "x") == "HELLO WORLD"


def test_validate_transcript_refuses_outside_characters_naming_them() -> None:
    with pytest.raises(TranscriptError) as err:
        validate_transcript("HELLO, WORLD 42", "a/b.trans.txt:3 (1-2-0003)")
    msg = str(err.value)
    assert "a/b.trans.txt:3 (1-2-0003)" in msg
    assert "','" in msg and "'4'" in msg and "'2'" in msg


def test_validate_transcript_refuses_empty() -> None:
    with pytest.raises(TranscriptError, match="empty"):
        validate_transcript("   ", "f:1")


def test_split_sentences_keeps_abbreviations() -> None:
    text = "Mr. Smith went home. He slept! Did Dr. Who? Yes."
    assert list(split_sentences(text)) == ["Mr. Smith went home.", "He slept!", "Did Dr. Who?", "Yes."]


def test_sentence_pool_filters_length_and_duplicates() -> None:
    paragraphs = [
        "Short one. This sentence has exactly five words. This sentence has exactly five words.",
        "Numbers like 7 are spelled out in this sentence. Weird ✓ symbols drop a sentence here.",
    ]
    pool = sentence_pool(paragraphs, min_words=5, max_words=20)
    assert pool == [
        "THIS SENTENCE HAS EXACTLY FIVE WORDS",
        "NUMBERS LIKE SEVEN ARE SPELLED OUT IN THIS SENTENCE",
    ]


def _toy_sentences() -> list:
    rng = np.random.default_rng(0)
    words = [f"W{i}" for i in range(30)]
    return [" ".join(rng.choice(words, size=int(rng.integers(5, 10)))) for _ in range(300)] + [
        "RARE WORDS ONLY HERE ZZZ",
        "ANOTHER RARE LINE QQQ",
    ]


def test_corpus_splits_are_disjoint_and_eval_words_seen_in_training() -> None:
    sentences = _toy_sentences()
    vocab = {f"W{i}" for i in range(30)}
    parts = ("dev-clean", "dev-other", "test-clean", "test-other")
    splits = split_sentences_for_corpus(sentences, vocab, parts, 20, np.random.default_rng(1))
    assert all(len(splits.eval[p]) == 20 for p in parts)
    used = splits.train + [s for p in parts for s in splits.eval[p]]
    assert len(used) == len(set(used)) == len(set(sentences) - set(splits.babble))
    assert set(splits.babble) == {"RARE WORDS ONLY HERE ZZZ", "ANOTHER RARE LINE QQQ"}
    for p in parts:
        assert oov_counts(splits.train, splits.eval[p])[0] == 0


def test_corpus_split_too_small_is_refused() -> None:
    with pytest.raises(ValueError, match="not enough sentences"):
        split_sentences_for_corpus(
            _toy_sentences()[:10], {f"W{i}" for i in range(30)}, ("a", "b"), 20, np.random.default_rng(0)
        )


def test_babble_halves_do_not_share_sentences() -> None:
    pool = out_of_vocabulary([f"S{i} X" for i in range(11)], {"X"})
    a, b = babble_sentences(pool, "other"), babble_sentences(pool, "noise-corpus")
    assert not set(a) & set(b) and len(a) + len(b) == 11
    with pytest.raises(ValueError):
        babble_sentences(pool, "train")


def test_oov_counts() -> None:
    assert oov_counts(["A B C"], ["A D", "E C"]) == (2, 4)


@pytest.mark.parametrize("colour, exponent", [("white", 0.0), ("pink", 1.0), ("brown", 2.0)])
def test_coloured_noise_spectrum_slope(colour: str, exponent: float) -> None:
    x = coloured_noise(colour, 1 << 16, np.random.default_rng(0))
    assert x.dtype == np.float32
    assert np.sqrt(np.mean(x.astype(np.float64) ** 2)) == pytest.approx(1.0, rel=1e-3)
    power = np.abs(np.fft.rfft(x)) ** 2
    f = np.arange(power.size)
    low, high = power[(f > 100) & (f < 200)].mean(), power[(f > 10000) & (f < 20000)].mean()
    slope = np.log(low / high) / np.log(100.0)  # 100x frequency ratio
    assert slope == pytest.approx(exponent, abs=0.15)


def test_mix_at_snr_hits_the_snr() -> None:
    rng = np.random.default_rng(0)
    speech = np.sin(np.arange(16000) / 5.0).astype(np.float32)
    noise = coloured_noise("pink", 8000, rng)  # shorter: gets tiled
    mixed = mix_at_snr(speech, noise, 15.0)
    added = mixed.astype(np.float64) - speech
    snr = 10 * np.log10(np.mean(speech.astype(np.float64) ** 2) / np.mean(added**2))
    assert mixed.shape == speech.shape and snr == pytest.approx(15.0, abs=0.01)
    assert np.max(np.abs(set_peak(mixed, 0.5))) == pytest.approx(0.5)


def test_atomic_output_leaves_nothing_on_error(tmp_path: Path) -> None:
    target = tmp_path / "x.jsonl.gz"
    with pytest.raises(RuntimeError):
        with atomic_output(target) as tmp:
            assert tmp.name == ".tmp-x.jsonl.gz"
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []
    with atomic_output(target) as tmp:
        tmp.write_text("whole")
    assert target.read_text() == "whole" and sorted(p.name for p in tmp_path.iterdir()) == ["x.jsonl.gz"]


def test_bpe_round_trip_and_special_ids(tmp_path: Path) -> None:
    texts = _toy_sentences() + ["HELLO WORLD IT'S A TEST"] * 3
    transcript = tmp_path / "lang" / "transcript_words.txt"
    write_transcript_words(texts, transcript)
    model = train_bpe_model(transcript, tmp_path / "lang", vocab_size=40)
    sp = load_bpe_model(model)
    for piece, idx in SPECIAL_IDS.items():
        assert sp.piece_to_id(piece) == idx
    for text in ["HELLO WORLD IT'S A TEST", "W1 W22 W3"]:
        assert sp.decode(sp.encode(text)) == text
    tokens = (tmp_path / "lang" / "tokens.txt").read_text().splitlines()
    assert tokens[:3] == ["<blk> 0", "<sos/eos> 1", "<unk> 2"] and len(tokens) == 40
    assert not [p for p in (tmp_path / "lang").iterdir() if p.name.startswith(".tmp")]


def test_bpe_vocab_too_large_names_the_limit(tmp_path: Path) -> None:
    transcript = tmp_path / "transcript_words.txt"
    write_transcript_words(["A SMALL TEXT WITH FEW WORDS"] * 5, transcript)
    with pytest.raises(VocabSizeError, match=r"at most \d+ unigram pieces.*--vocab-size 500"):
        train_bpe_model(transcript, tmp_path, vocab_size=500)
    assert not (tmp_path / "bpe.model").exists()
