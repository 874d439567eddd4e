"""The paired bootstrap of a WER difference (decoding/paired_bootstrap.py, local/compare_decodings.py)."""

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from icefall_lite.decoding.metrics import store_transcripts
from icefall_lite.decoding.paired_bootstrap import paired_bootstrap

SCRIPT = Path(__file__).resolve().parents[1] / "egs/librispeech/ASR/local/compare_decodings.py"


def _results(hyps):
    """Utterances u0.. with references "a b c d e" and the given hypotheses."""
    return [(f"u{i}", "a b c d e".split(), hyp.split()) for i, hyp in enumerate(hyps)]


def test_identical_decodings_differ_by_nothing() -> None:
    results = _results(["a b c d e", "a x c d e", "a b"])
    d = paired_bootstrap(results, list(results), num_resamples=500)
    assert (d.difference, d.low, d.high, d.b_better_fraction) == (0.0, 0.0, 0.0, 0.0)
    assert d.wer_a == d.wer_b == pytest.approx(100.0 * 4 / 15)


def test_one_more_error_per_utterance_is_a_constant_difference() -> None:
    # Every utterance has 5 reference words and B one more substitution: every resample gives 100 * 1/5.
    a = _results(["a b c d e", "a x c d e", "a b c d", "y b c d e"])
    b = _results(["a b c d z", "a x c z e", "a b c z", "y z c d e"])
    d = paired_bootstrap(a, b, num_resamples=300)
    assert d.wer_a == pytest.approx(100.0 * 3 / 20) and d.wer_b == pytest.approx(100.0 * 7 / 20)
    assert d.difference == pytest.approx(20.0)
    assert d.low == pytest.approx(20.0) and d.high == pytest.approx(20.0)
    assert d.b_better_fraction == 0.0


def test_b_better_fraction_matches_the_exhaustive_bootstrap() -> None:
    # Three utterances of 1, 2 and 5 words: the 27 equally likely resamples, enumerated.
    a = [("u0", ["a"], ["x"]), ("u1", ["a", "b"], ["a", "b"]), ("u2", "a b c d e".split(), "a b c d e".split())]
    b = [("u0", ["a"], ["a"]), ("u1", ["a", "b"], ["a", "x"]), ("u2", "a b c d e".split(), "a b c x e".split())]
    errors_a, errors_b, words = [1, 0, 0], [0, 1, 1], [1, 2, 5]
    picks = list(itertools.product(range(3), repeat=3))
    exact = sum(sum(errors_b[i] for i in p) < sum(errors_a[i] for i in p) for p in picks) / len(picks)
    d = paired_bootstrap(a, b, num_resamples=40000, seed=1)
    assert d.b_better_fraction == pytest.approx(exact, abs=0.01)
    assert d.difference == pytest.approx(100.0 * (2 - 1) / sum(words))


def test_different_utterances_or_references_are_refused() -> None:
    a = _results(["a b c d e", "a b c d e"])
    with pytest.raises(ValueError, match="different utterances"):
        paired_bootstrap(a, a[:1])
    other_ref = [(a[0][0], ["z"], ["z"]), a[1]]
    with pytest.raises(ValueError, match="different references"):
        paired_bootstrap(a, other_ref)
    with pytest.raises(ValueError, match="appears twice"):
        paired_bootstrap(a + a[:1], a)


def test_script_prints_the_difference(tmp_path: Path) -> None:
    a, b = tmp_path / "recogs-a.txt", tmp_path / "recogs-b.txt"
    store_transcripts(a, _results(["a b c d e", "a x c d e"]))
    store_transcripts(b, _results(["a b c d e", "a b c d e"]))
    out = subprocess.run([sys.executable, str(SCRIPT), str(a), str(b)], capture_output=True, text=True, check=True)
    assert "WER A 10.00%, B 0.00%, B - A -10.00 points" in out.stdout
    missing = subprocess.run([sys.executable, str(SCRIPT), str(a), str(tmp_path / "nope.txt")], capture_output=True)
    assert missing.returncode == 1 and b"nope.txt does not exist" in missing.stderr
    zero = subprocess.run([sys.executable, str(SCRIPT), str(a), str(b), "--num-resamples", "0"], capture_output=True)
    assert zero.returncode == 2 and b"--num-resamples must be positive" in zero.stderr
