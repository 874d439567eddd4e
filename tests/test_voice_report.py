"""WER by voice and noise of the synthetic corpus (decoding/voice_report.py, wer_by_voice.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from icefall_lite.data.synthetic import tts
from icefall_lite.data.synthetic.corpus import MARKER, SIZES, plan_corpus
from icefall_lite.decoding.metrics import store_transcripts
from icefall_lite.decoding.voice_report import plan_utt_id, utterance_attributes, wer_by_attribute

SCRIPT = Path(__file__).resolve().parents[1] / "egs/librispeech/ASR/lstm_transducer_stateless/wer_by_voice.py"


@pytest.fixture(scope="module")
def tiny_plan():
    """The tiny corpus's plan: ({utt_id: utterance}, the test-other utterances)."""
    plan = plan_corpus(SIZES["tiny"], 42)
    return {u.utt_id: u for u in plan.utterances}, [u for u in plan.utterances if u.part == "test-other"]


def _results_deleting_first_word_of_babble(utts):
    """Hypotheses equal to the references, except that babble-noised utterances lose their first word;
    cut ids carry lhotse's suffix."""
    results = []
    for u in utts:
        ref = u.text.split()
        hyp = ref[1:] if u.noise == "babble" else ref
        results.append((f"{u.utt_id}-0", ref, hyp))
    return results


def test_cut_ids_map_to_plan_ids() -> None:
    assert plan_utt_id("103-1004-0007") == "103-1004-0007"
    assert plan_utt_id("103-1004-0007-0") == "103-1004-0007"
    assert plan_utt_id("103-1004-0007_sp0.9") == "103-1004-0007"


def test_attributes_of_unseen_voices_are_marked(tiny_plan) -> None:
    _, utts = tiny_plan
    for u in utts:
        a = utterance_attributes(u)
        assert a["noise"] == u.noise and a["noise"] != "none"
        low = int(a["snr"].split("-")[0])
        assert low <= u.snr_db < low + 5
        if u.voice.engine == "espeak":
            accent, variant = u.voice.name.split("+")
            # Every test-other espeak voice has an unseen accent or an unseen variant.
            assert a["accent"].endswith("(unseen)") == (accent in tts.OTHER_ACCENTS)
            assert a["variant"].endswith("(unseen)") == (variant in tts.OTHER_VARIANTS)
            assert "(unseen)" in a["accent"] + a["variant"]
        else:
            assert a["accent"] == a["variant"] == f"flite:{u.voice.name} (unseen)"


def test_wer_by_noise_counts_each_group_by_hand(tiny_plan) -> None:
    plan, utts = tiny_plan
    table = wer_by_attribute(_results_deleting_first_word_of_babble(utts), plan)
    rows = {value: (stats, count) for value, stats, count in table["noise"]}
    babble = [u for u in utts if u.noise == "babble"]
    assert babble, "the tiny plan's test-other has babble"
    stats, count = rows["babble"]
    words = sum(len(u.text.split()) for u in babble)
    assert (count, stats.ref_words, stats.deletions, stats.insertions, stats.substitutions) == (
        len(babble),
        words,
        len(babble),
        0,
        0,
    )
    assert stats.wer == pytest.approx(100.0 * len(babble) / words)
    assert table["noise"][0][0] == "babble"  # worst first
    for value, (stats, _) in rows.items():
        if value != "babble":
            assert stats.errors == 0
    for attribute, attribute_rows in table.items():  # every grouping covers every utterance once
        assert sum(count for _, _, count in attribute_rows) == len(utts), attribute


def test_unknown_utterance_is_named(tiny_plan) -> None:
    plan, _ = tiny_plan
    with pytest.raises(KeyError, match="999-9999-0000"):
        wer_by_attribute([("999-9999-0000", ["A"], ["A"])], plan)


def test_script_prints_the_breakdown(tiny_plan, tmp_path: Path) -> None:
    _, utts = tiny_plan
    corpus = tmp_path / "LibriSpeech"
    corpus.mkdir()
    (corpus / MARKER).write_text(json.dumps({"config": {"size": "tiny", "seed": 42}}))
    recogs = tmp_path / "recogs-test-other-x.txt"
    store_transcripts(recogs, _results_deleting_first_word_of_babble(utts))
    babble = [u for u in utts if u.noise == "babble"]
    words = sum(len(u.text.split()) for u in babble)
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(recogs), "--corpus-dir", str(corpus)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"| babble | {len(babble)} | {words} | {100.0 * len(babble) / words:.2f} | 0 | {len(babble)} | 0 |" in out
    missing = subprocess.run(
        [sys.executable, str(SCRIPT), str(recogs), "--corpus-dir", str(tmp_path)], capture_output=True, text=True
    )
    assert missing.returncode == 1 and MARKER in missing.stderr
