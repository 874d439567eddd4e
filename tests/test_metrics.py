"""Tests of icefall_lite.decoding.metrics on a hand-worked example and by parsing files back."""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path
from typing import Dict, List

import kaldialign
import pytest

from icefall_lite.decoding.metrics import (
    atomic_write,
    compute_wer,
    load_transcripts,
    load_wer_summary,
    per_utt_line,
    save_results,
    store_transcripts,
    write_error_stats,
    write_wer_summary,
)

# Worked by hand:
#   u1  A B C D E F -> A X C E F G : B->X sub, D deleted, G inserted, 4 correct
#   u2  P Q R S     -> P Y Z S     : Q->Y, R->Z subs (one combined run), 2 correct
#   u3  B B         -> (nothing)   : 2 deletions
#   u4  A           -> A X         : X inserted, 1 correct
# Totals: 2 ins, 3 del, 3 sub, 7 correct, 13 reference words; WER 8/13 = 61.54 %.
RESULTS = [
    ("u1", "A B C D E F".split(), "A X C E F G".split()),
    ("u2", "P Q R S".split(), "P Y Z S".split()),
    ("u3", "B B".split(), []),
    ("u4", ["A"], "A X".split()),
]


def test_compute_wer_hand_worked():
    stats = compute_wer(RESULTS)
    assert (stats.insertions, stats.deletions, stats.substitutions) == (2, 3, 3)
    assert (stats.correct, stats.ref_words, stats.errors) == (7, 13, 8)
    assert stats.wer == pytest.approx(100 * 8 / 13)


def test_compute_wer_agrees_with_kaldialign_edit_distance():
    stats = compute_wer(RESULTS)
    per_utt = [kaldialign.edit_distance(ref, hyp) for _, ref, hyp in RESULTS]
    assert stats.insertions == sum(d["ins"] for d in per_utt)
    assert stats.deletions == sum(d["del"] for d in per_utt)
    assert stats.substitutions == sum(d["sub"] for d in per_utt)


def test_wer_without_reference_words_is_an_error():
    with pytest.raises(ValueError, match="no words"):
        _ = compute_wer([("u", [], ["A"])]).wer


@pytest.mark.parametrize(
    "cut_id, ref, hyp, line",
    [
        ("u1", "A B C D E F", "A X C E F G", "u1:\tA (B->X) C (D->*) E F (*->G)"),
        ("u2", "P Q R S", "P Y Z S", "u2:\tP (Q R->Y Z) S"),
        ("u3", "B B", "", "u3:\t(B B->*)"),
        ("u5", "A B", "A B", "u5:\tA B"),
    ],
)
def test_per_utt_line_combines_successive_errors(cut_id, ref, hyp, line):
    assert per_utt_line(cut_id, ref.split(), hyp.split()) == line


def parse_errs(text: str) -> Dict[str, List[str]]:
    """Split an errs file into its header and sections (lines after each title)."""
    titles = ["PER-UTT DETAILS:", "SUBSTITUTIONS:", "DELETIONS:", "INSERTIONS:", "PER-WORD STATS:"]
    sections: Dict[str, List[str]] = {"header": []}
    current = "header"
    for line in text.splitlines():
        title = next((t for t in titles if line.startswith(t)), None)
        if title is not None:
            current = title
            sections[current] = []
        elif line:
            sections[current].append(line)
    return sections


def test_write_error_stats_format_parsed_back(tmp_path):
    path = tmp_path / "errs-test-clean-epoch-1-avg-1.txt"
    wer = write_error_stats(path, "test-clean-greedy_search", RESULTS, enable_log=False)
    assert wer == 61.54
    sections = parse_errs(path.read_text())
    assert list(sections) == [
        "header",
        "PER-UTT DETAILS:",
        "SUBSTITUTIONS:",
        "DELETIONS:",
        "INSERTIONS:",
        "PER-WORD STATS:",
    ]

    header = sections["header"]
    assert header[0] == "%WER = 61.54"
    m = re.fullmatch(
        r"Errors: (\d+) insertions, (\d+) deletions, (\d+) substitutions, over (\d+) reference words \((\d+) correct\)",
        header[1],
    )
    assert m is not None and tuple(map(int, m.groups())) == (2, 3, 3, 13, 7)

    assert sections["PER-UTT DETAILS:"] == [
        "u1:\tA (B->X) C (D->*) E F (*->G)",
        "u2:\tP (Q R->Y Z) S",
        "u3:\t(B B->*)",
        "u4:\tA (*->X)",
    ]
    assert sections["SUBSTITUTIONS:"] == ["1   R -> Z", "1   Q -> Y", "1   B -> X"]
    assert sections["DELETIONS:"] == ["2   B", "1   D"]
    assert sections["INSERTIONS:"] == ["1   X", "1   G"]

    stats = {}
    for line in sections["PER-WORD STATS:"]:
        word, counts = line.split("   ")
        stats[word] = tuple(map(int, counts.split()))  # corr tot_errs count_in_ref count_in_hyp
    assert stats["B"] == (0, 3, 3, 0)
    assert stats["X"] == (0, 2, 0, 2)
    assert stats["A"] == (2, 0, 2, 2)
    assert stats["D"] == (0, 1, 1, 0)
    words_by_errors = [line.split("   ")[0] for line in sections["PER-WORD STATS:"]]
    assert words_by_errors[:2] == ["B", "X"]  # most errors first
    assert len(stats) == 14


def test_write_error_stats_into_open_stream_and_logs(caplog):
    buf = io.StringIO()
    with caplog.at_level(logging.INFO):
        wer = write_error_stats(buf, "dev-greedy_search", RESULTS[:1])
    assert wer == 50.0  # 3 errors over 6 words
    assert buf.getvalue().startswith(
        "%WER = 50.00\nErrors: 1 insertions, 1 deletions, 1 substitutions, over 6 reference words (4 correct)\n"
    )
    assert "[dev-greedy_search] %WER 50.00% [3 / 6, 1 ins, 1 del, 1 sub ]" in caplog.text


def test_store_transcripts_format_and_round_trip(tmp_path):
    path = tmp_path / "recogs-test-other-x.txt"
    texts = RESULTS + [("u6", ["DON'T", 'SAY "NO"'], ["DON'T"])]
    store_transcripts(path, texts)
    lines = path.read_text().splitlines()
    assert lines[:2] == ["u1:\tref=['A', 'B', 'C', 'D', 'E', 'F']", "u1:\thyp=['A', 'X', 'C', 'E', 'F', 'G']"]
    assert lines[5] == "u3:\thyp=[]"
    assert load_transcripts(path) == [(c, list(r), list(h)) for c, r, h in texts]


def test_load_transcripts_rejects_malformed_lines(tmp_path):
    path = tmp_path / "recogs-bad.txt"
    path.write_text("u1:\tref=['A']\nu1 hyp A\n")
    with pytest.raises(ValueError, match=r"recogs-bad.txt:2"):
        load_transcripts(path)


def test_wer_summary_sorted_and_parsed_back(tmp_path):
    path = tmp_path / "wer-summary-test-clean-x.txt"
    write_wer_summary(path, {"greedy_search": 7.5, "beam_size_4": 7.12, "beam_20.0_max_contexts_8_max_states_64": 7.3})
    text = path.read_text()
    assert text.splitlines()[0] == "settings\tWER"
    assert text.splitlines()[1] == "beam_size_4\t7.12"
    assert load_wer_summary(path) == [
        ("beam_size_4", 7.12),
        ("beam_20.0_max_contexts_8_max_states_64", 7.3),
        ("greedy_search", 7.5),
    ]


def test_save_results_writes_icefall_names(tmp_path):
    res_dir = tmp_path / "exp" / "greedy_search"
    suffix = "epoch-30-avg-15-context-2-max-sym-per-frame-1-use-averaged-model"
    wers = save_results(res_dir, "test-clean", suffix, {"greedy_search": list(reversed(RESULTS))})
    assert wers == {"greedy_search": 61.54}
    assert sorted(p.name for p in res_dir.iterdir()) == sorted(
        f"{kind}-test-clean-{suffix}.txt" for kind in ("recogs", "errs", "wer-summary")
    )
    assert [r[0] for r in load_transcripts(res_dir / f"recogs-test-clean-{suffix}.txt")] == ["u1", "u2", "u3", "u4"]
    assert load_wer_summary(res_dir / f"wer-summary-test-clean-{suffix}.txt") == [("greedy_search", 61.54)]


def test_save_results_with_several_keys_keeps_each_file(tmp_path):
    wers = save_results(tmp_path, "dev", "s", {"beam_size_4": RESULTS[:1], "greedy_search": RESULTS})
    assert wers == {"beam_size_4": 50.0, "greedy_search": 61.54}
    names = {p.name for p in tmp_path.iterdir()}
    assert {"errs-dev-beam_size_4-s.txt", "errs-dev-greedy_search-s.txt", "wer-summary-dev-s.txt"} <= names
    assert load_wer_summary(tmp_path / "wer-summary-dev-s.txt")[0] == ("beam_size_4", 50.0)


def test_atomic_write_leaves_old_file_and_no_temp_on_error(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old\n")
    with pytest.raises(RuntimeError):
        with atomic_write(path) as f:
            f.write("half")
            raise RuntimeError("killed")
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]
    with atomic_write(path) as f:
        f.write("new\n")
    assert path.read_text() == "new\n"
    assert [p.name for p in Path(tmp_path).iterdir()] == ["out.txt"]


def test_deletion_positions_by_hand():
    from icefall_lite.decoding.metrics import deletion_positions

    results = [
        ("a", "A B C D".split(), "A B".split()),  # C, D deleted at the end: positions 2, 3 of 4
        ("b", "A B C D E".split(), "A C D E".split()),  # B deleted: position 1 of 5 -> tenth 2
        ("c", "A B".split(), "A B X".split()),  # an insertion only
        ("d", "A B C".split(), "X B".split()),  # A->X substituted, C (last) deleted: position 2 of 3
    ]
    stats = deletion_positions(results)
    assert stats.utterances == 4 and stats.deletions == 4
    expected = [0] * 10
    expected[5] += 1  # 10*2//4
    expected[7] += 1  # 10*3//4
    expected[2] += 1  # 10*1//5
    expected[6] += 1  # 10*2//3
    assert stats.by_tenth == expected
    assert stats.final_deleted == 2  # a and d
    assert stats.trailing_run == 3  # C D of a, C of d
