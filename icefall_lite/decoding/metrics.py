"""Word error rate via kaldialign, and icefall's decoding result files.

File names and formats follow ``icefall/utils.py`` and the recipes'
``save_results``:

- ``recogs-<set>-<suffix>.txt``: per utterance two lines,
  ``<cut_id>:\\tref=['W1', 'W2']`` and ``<cut_id>:\\thyp=[...]``;
- ``errs-<set>-<suffix>.txt``: ``%WER = 12.34``, the ``Errors: ...`` line,
  then the PER-UTT DETAILS, SUBSTITUTIONS, DELETIONS, INSERTIONS and
  PER-WORD STATS sections;
- ``wer-summary-<set>-<suffix>.txt``: ``settings\\tWER`` then one
  ``<key>\\t<wer>`` row per setting, best first.

Every file is written to a temporary name in the same folder and renamed, so
a reader never sees half a file.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Mapping, Sequence, TextIO, Tuple, Union

import kaldialign

from icefall_lite.utils import atomic_write

Pathlike = Union[str, os.PathLike]
# (cut_id, reference words, hypothesis words)
Result = Tuple[str, Sequence[str], Sequence[str]]

ERR = "*"  # the gap symbol in alignments, as icefall


@dataclass
class ErrorStats:
    """Word error counts over a set of utterances."""

    insertions: int = 0
    deletions: int = 0
    substitutions: int = 0
    correct: int = 0
    ref_words: int = 0

    @property
    def errors(self) -> int:
        return self.insertions + self.deletions + self.substitutions

    @property
    def wer(self) -> float:
        """Word error rate in percent (not rounded)."""
        if self.ref_words == 0:
            raise ValueError("WER is undefined: the references have no words")
        return 100.0 * self.errors / self.ref_words


def align_words(ref: Sequence[str], hyp: Sequence[str]) -> List[Tuple[str, str]]:
    """kaldialign's minimum-edit alignment; gaps are ``ERR`` ("*")."""
    return kaldialign.align(list(ref), list(hyp), ERR)


def _classify(ref_word: str, hyp_word: str) -> str:
    """'ins', 'del', 'sub' or 'corr' for one aligned pair."""
    if ref_word == ERR:
        return "ins"
    if hyp_word == ERR:
        return "del"
    return "sub" if ref_word != hyp_word else "corr"


def compute_wer(results: Iterable[Result]) -> ErrorStats:
    """Insertion/deletion/substitution counts of (cut_id, ref, hyp) triples."""
    stats = ErrorStats()
    for _, ref, hyp in results:
        stats.ref_words += len(ref)
        for ref_word, hyp_word in align_words(ref, hyp):
            kind = _classify(ref_word, hyp_word)
            if kind == "ins":
                stats.insertions += 1
            elif kind == "del":
                stats.deletions += 1
            elif kind == "sub":
                stats.substitutions += 1
            else:
                stats.correct += 1
    return stats


@dataclass
class DeletionPositions:
    """Where in the reference the deleted words are.

    ``by_tenth[k]`` counts deletions whose reference word lies in the k-th
    tenth of its utterance (position ``i`` of ``n`` words falls in tenth
    ``floor(10 * i / n)``). ``final_deleted`` counts utterances whose last
    reference word is deleted, ``trailing_run`` the words of the deletion
    runs that reach the end of the reference (the hypothesis "stopped short").
    """

    deletions: int = 0
    by_tenth: List[int] = None  # type: ignore[assignment]
    final_deleted: int = 0
    trailing_run: int = 0
    utterances: int = 0

    def __post_init__(self) -> None:
        if self.by_tenth is None:
            self.by_tenth = [0] * 10


def deletion_positions(results: Iterable[Result]) -> DeletionPositions:
    """:class:`DeletionPositions` of (cut_id, ref, hyp) triples (kaldialign's alignment)."""
    stats = DeletionPositions()
    for _, ref, hyp in results:
        stats.utterances += 1
        ref_index = 0
        deleted = []
        for ref_word, hyp_word in align_words(ref, hyp):
            if ref_word == ERR:
                continue
            if hyp_word == ERR:
                deleted.append(ref_index)
                stats.deletions += 1
                stats.by_tenth[min(9, 10 * ref_index // len(ref))] += 1
            ref_index += 1
        if deleted and deleted[-1] == len(ref) - 1:
            stats.final_deleted += 1
            run = 1
            while run < len(deleted) and deleted[-1 - run] == len(ref) - 1 - run:
                run += 1
            stats.trailing_run += run
    return stats


@contextlib.contextmanager
def _text_sink(f: Union[Pathlike, TextIO]) -> Iterator[TextIO]:
    """An open stream as is, or a path opened with :func:`atomic_write`."""
    if hasattr(f, "write"):
        yield f  # type: ignore[misc]
    else:
        with atomic_write(f) as out:  # type: ignore[arg-type]
            yield out


# --------------------------------------------------------------------------
# recogs-*.txt
# --------------------------------------------------------------------------


def _as_field(words: Union[str, Sequence[str]]) -> str:
    """icefall prints the word list with Python's repr: ``['A', 'B']``."""
    return words if isinstance(words, str) else repr(list(words))


def store_transcripts(filename: Pathlike, texts: Iterable[Result]) -> None:
    """Write ``<cut_id>:\\tref=[...]`` / ``<cut_id>:\\thyp=[...]`` line pairs."""
    with atomic_write(filename) as f:
        for cut_id, ref, hyp in texts:
            print(f"{cut_id}:\tref={_as_field(ref)}", file=f)
            print(f"{cut_id}:\thyp={_as_field(hyp)}", file=f)


def load_transcripts(filename: Pathlike) -> List[Tuple[str, List[str], List[str]]]:
    """Read a file written by :func:`store_transcripts` back into triples."""
    refs: Dict[str, List[str]] = {}
    out: List[Tuple[str, List[str], List[str]]] = []
    with open(filename, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            cut_id, sep, field = line.rstrip("\n").partition(":\t")
            name, eq, value = field.partition("=")
            if not sep or not eq or name not in ("ref", "hyp"):
                raise ValueError(f"{filename}:{line_no}: not a '<id>:\\tref=[...]' or 'hyp=[...]' line: {line!r}")
            words = ast.literal_eval(value) if value.startswith("[") else value.split()
            if name == "ref":
                refs[cut_id] = list(words)
            elif cut_id in refs:
                out.append((cut_id, refs.pop(cut_id), list(words)))
            else:
                raise ValueError(f"{filename}:{line_no}: hyp line for {cut_id!r} without a ref line before it")
    return out


# --------------------------------------------------------------------------
# errs-*.txt
# --------------------------------------------------------------------------


def _combined_alignment(ref: Sequence[str], hyp: Sequence[str]) -> List[Tuple[str, str]]:
    """Alignment with each run of consecutive errors merged into one pair.

    Within a run, the non-gap words of each side are joined by spaces; a side
    with none becomes ``ERR``. This is icefall's ``combine_successive_errors``.
    """
    out: List[Tuple[str, str]] = []
    run_ref: List[str] = []
    run_hyp: List[str] = []
    in_run = False

    def flush() -> None:
        out.append((" ".join(run_ref) or ERR, " ".join(run_hyp) or ERR))
        run_ref.clear()
        run_hyp.clear()

    for ref_word, hyp_word in align_words(ref, hyp):
        if ref_word == hyp_word:
            if in_run:
                flush()
                in_run = False
            out.append((ref_word, hyp_word))
            continue
        in_run = True
        run_ref.extend([ref_word] if ref_word != ERR else [])
        run_hyp.extend([hyp_word] if hyp_word != ERR else [])
    if in_run:
        flush()
    return out


def per_utt_line(cut_id: str, ref: Sequence[str], hyp: Sequence[str]) -> str:
    """``<cut_id>:\\tA (B->X) C (D->*)`` as in the PER-UTT DETAILS section."""
    pieces = [r if r == h else f"({r}->{h})" for r, h in _combined_alignment(ref, hyp)]
    return f"{cut_id}:\t" + " ".join(pieces)


def _word_counts(results: Sequence[Result]):
    """Substitution/deletion/insertion tallies and per-word [corr, ref_sub, hyp_sub, ins, del]."""
    subs: Dict[Tuple[str, str], int] = defaultdict(int)
    dels: Dict[str, int] = defaultdict(int)
    ins: Dict[str, int] = defaultdict(int)
    words: Dict[str, List[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    for _, ref, hyp in results:
        for ref_word, hyp_word in align_words(ref, hyp):
            kind = _classify(ref_word, hyp_word)
            if kind == "ins":
                ins[hyp_word] += 1
                words[hyp_word][3] += 1
            elif kind == "del":
                dels[ref_word] += 1
                words[ref_word][4] += 1
            elif kind == "sub":
                subs[(ref_word, hyp_word)] += 1
                words[ref_word][1] += 1
                words[hyp_word][2] += 1
            else:
                words[ref_word][0] += 1
    return subs, dels, ins, words


def _write_sections(f: TextIO, results: Sequence[Result]) -> None:
    """The PER-UTT DETAILS ... PER-WORD STATS part of an errs file."""
    subs, dels, ins, words = _word_counts(results)
    print("", file=f)
    print("PER-UTT DETAILS: corr or (ref->hyp)  ", file=f)
    for cut_id, ref, hyp in results:
        print(per_utt_line(cut_id, ref, hyp), file=f)

    print("", file=f)
    print("SUBSTITUTIONS: count ref -> hyp", file=f)
    for count, (ref_word, hyp_word) in sorted(((v, k) for k, v in subs.items()), reverse=True):
        print(f"{count}   {ref_word} -> {hyp_word}", file=f)

    print("", file=f)
    print("DELETIONS: count ref", file=f)
    for count, word in sorted(((v, k) for k, v in dels.items()), reverse=True):
        print(f"{count}   {word}", file=f)

    print("", file=f)
    print("INSERTIONS: count hyp", file=f)
    for count, word in sorted(((v, k) for k, v in ins.items()), reverse=True):
        print(f"{count}   {word}", file=f)

    print("", file=f)
    print("PER-WORD STATS: word  corr tot_errs count_in_ref count_in_hyp", file=f)
    for _, word, (corr, ref_sub, hyp_sub, n_ins, n_del) in sorted(
        ((sum(v[1:]), k, v) for k, v in words.items()), reverse=True
    ):
        tot_errs = ref_sub + hyp_sub + n_ins + n_del
        print(f"{word}   {corr} {tot_errs} {corr + ref_sub + n_del} {corr + hyp_sub + n_ins}", file=f)


def write_error_stats(
    f: Union[Pathlike, TextIO], test_set_name: str, results: Sequence[Result], enable_log: bool = True
) -> float:
    """Write icefall's detailed error statistics; return the WER rounded to 0.01.

    Args:
      f: an open text stream, or a path (then written atomically).
      test_set_name: used in the log line only.
      results: (cut_id, ref words, hyp words) triples.
      enable_log: also log ``[<set>] %WER ...`` at INFO level.
    Returns:
      the WER in percent, as printed (``float("%.2f" % wer)``).
    """
    results = list(results)
    stats = compute_wer(results)
    wer_str = "%.2f" % stats.wer
    if enable_log:
        logging.info(
            f"[{test_set_name}] %WER {stats.errors / stats.ref_words:.2%} "
            f"[{stats.errors} / {stats.ref_words}, {stats.insertions} ins, "
            f"{stats.deletions} del, {stats.substitutions} sub ]"
        )
    with _text_sink(f) as out:
        print(f"%WER = {wer_str}", file=out)
        print(
            f"Errors: {stats.insertions} insertions, {stats.deletions} deletions, "
            f"{stats.substitutions} substitutions, over {stats.ref_words} reference "
            f"words ({stats.correct} correct)",
            file=out,
        )
        print(
            "Search below for sections starting with PER-UTT DETAILS:, "
            "SUBSTITUTIONS:, DELETIONS:, INSERTIONS:, PER-WORD STATS:",
            file=out,
        )
        _write_sections(out, results)
    return float(wer_str)


# --------------------------------------------------------------------------
# wer-summary-*.txt and the decode.py glue
# --------------------------------------------------------------------------


def write_wer_summary(filename: Pathlike, test_set_wers: Mapping[str, float]) -> None:
    """``settings\\tWER`` header, then ``<key>\\t<wer>`` rows, lowest WER first."""
    with atomic_write(filename) as f:
        print("settings\tWER", file=f)
        for key, wer in sorted(test_set_wers.items(), key=lambda kv: kv[1]):
            print(f"{key}\t{wer}", file=f)


def load_wer_summary(filename: Pathlike) -> List[Tuple[str, float]]:
    """Rows of a file written by :func:`write_wer_summary`, in file order."""
    with open(filename, encoding="utf-8") as f:
        header, *rows = f.read().splitlines()
    if header != "settings\tWER":
        raise ValueError(f"{filename}: expected header 'settings\\tWER', got {header!r}")
    out = []
    for row in rows:
        key, _, wer = row.rpartition("\t")
        out.append((key, float(wer)))
    return out


def save_results(
    res_dir: Pathlike, test_set_name: str, suffix: str, results_dict: Mapping[str, Sequence[Result]]
) -> Dict[str, float]:
    """Write recogs/errs/wer-summary files for one test set, as icefall's decode.py.

    ``results_dict`` maps a setting key (icefall's: ``greedy_search``,
    ``beam_size_4``, ``beam_20.0_max_contexts_8_max_states_64``) to its
    results. With one key the files are ``recogs-<set>-<suffix>.txt`` and
    ``errs-<set>-<suffix>.txt``; with several, ``-<key>`` is added after the
    set name so they do not overwrite each other. The summary is
    ``wer-summary-<set>-<suffix>.txt``.

    Returns:
      {key: WER in percent, rounded to 0.01}.
    """
    res_dir = Path(res_dir)
    wers: Dict[str, float] = {}
    for key, results in results_dict.items():
        stem = f"{test_set_name}-{suffix}" if len(results_dict) == 1 else f"{test_set_name}-{key}-{suffix}"
        results = sorted(results, key=lambda r: (r[0], list(r[1]), list(r[2])))
        store_transcripts(res_dir / f"recogs-{stem}.txt", results)
        wers[key] = write_error_stats(res_dir / f"errs-{stem}.txt", f"{test_set_name}-{key}", results)
        logging.info(f"Wrote recogs-{stem}.txt and errs-{stem}.txt in {res_dir}")
    write_wer_summary(res_dir / f"wer-summary-{test_set_name}-{suffix}.txt", wers)
    logging.info(format_wer_table(test_set_name, wers))
    return wers


def format_wer_table(test_set_name: str, test_set_wers: Mapping[str, float]) -> str:
    """icefall's log table: one ``key\\twer`` line per setting, best marked."""
    lines = [f"\nFor {test_set_name}, WER of different settings are:"]
    note = f"\tbest for {test_set_name}"
    for key, wer in sorted(test_set_wers.items(), key=lambda kv: kv[1]):
        lines.append(f"{key}\t{wer}{note}")
        note = ""
    return "\n".join(lines) + "\n"
