"""Word error rates of a decoding broken down by what the synthetic corpus put in each utterance.

The corpus plan (:func:`icefall_lite.data.synthetic.corpus.plan_corpus`) is a
function of size and seed, so it tells, for every utterance id, the voice
(engine, espeak-ng accent and variant or flite voice) and the noise (type and
SNR) it was rendered with. Grouping a decoding's results by these answers
questions such as "are test-other's errors in the unseen accents, the unseen
variants or the noise?".
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterable, List, Mapping, Sequence, Tuple

from icefall_lite.data.synthetic import tts
from icefall_lite.data.synthetic.corpus import Utterance
from icefall_lite.decoding.metrics import ErrorStats, Result, compute_wer

# The groupings reported, in order.
ATTRIBUTES = ("engine", "accent", "variant", "noise", "snr")


def plan_utt_id(cut_id: str) -> str:
    """The corpus's ``<speaker>-<chapter>-<index>`` of a cut id (lhotse may append ``-<n>`` or ``_sp<f>``)."""
    return "-".join(cut_id.split("_")[0].split("-")[:3])


def utterance_attributes(utt: Utterance) -> Dict[str, str]:
    """The value of every attribute of :data:`ATTRIBUTES` for one planned utterance.

    ``accent`` and ``variant`` of a flite voice are ``flite:<voice>``. The
    accents of ``tts.OTHER_ACCENTS``, variants of ``tts.OTHER_VARIANTS`` and
    flite voices of ``tts.OTHER_FLITE`` (never in training) are marked
    ``(unseen)``. ``snr`` is the 5-dB band of the noise, or ``none``.
    """
    if utt.voice.engine == "espeak":
        accent, variant = utt.voice.name.split("+")
        accent += " (unseen)" if accent in tts.OTHER_ACCENTS else ""
        variant += " (unseen)" if variant in tts.OTHER_VARIANTS else ""
    else:
        accent = variant = f"flite:{utt.voice.name}" + (" (unseen)" if utt.voice.name in tts.OTHER_FLITE else "")
    if utt.noise is None:
        snr = "none"
    else:
        low = 5 * int(utt.snr_db // 5)
        snr = f"{low}-{low + 5} dB"
    return {
        "engine": utt.voice.engine,
        "accent": accent,
        "variant": variant,
        "noise": utt.noise or "none",
        "snr": snr,
    }


def wer_by_attribute(
    results: Iterable[Result], plan: Mapping[str, Utterance]
) -> Dict[str, List[Tuple[str, ErrorStats, int]]]:
    """Per attribute, ``(value, error counts, utterances)`` rows, worst WER first.

    Args:
      results: ``(cut_id, ref words, hyp words)`` as decode.py's recogs files hold them.
      plan: the corpus plan's utterances by utterance id.
    Raises:
      KeyError: a cut id that is not in the plan (another corpus, size or seed).
    """
    groups: Dict[str, Dict[str, List[Result]]] = {a: defaultdict(list) for a in ATTRIBUTES}
    for result in results:
        utt_id = plan_utt_id(result[0])
        if utt_id not in plan:
            raise KeyError(
                f"utterance {result[0]!r} is not in the corpus plan: the recogs come from another corpus "
                f"(size or seed) than the one given"
            )
        for attribute, value in utterance_attributes(plan[utt_id]).items():
            groups[attribute][value].append(result)
    table: Dict[str, List[Tuple[str, ErrorStats, int]]] = {}
    for attribute in ATTRIBUTES:
        rows = [(value, compute_wer(rs), len(rs)) for value, rs in groups[attribute].items()]
        table[attribute] = sorted(rows, key=lambda row: -row[1].wer)
    return table


def format_breakdown(table: Mapping[str, Sequence[Tuple[str, ErrorStats, int]]]) -> str:
    """Markdown tables, one per attribute: value, utterances, words, WER, ins/del/sub."""
    lines: List[str] = []
    for attribute, rows in table.items():
        lines += [
            f"| {attribute} | utterances | words | WER | ins | del | sub |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for value, stats, count in rows:
            lines.append(
                f"| {value} | {count} | {stats.ref_words} | {stats.wer:.2f} | "
                f"{stats.insertions} | {stats.deletions} | {stats.substitutions} |"
            )
        lines.append("")
    return "\n".join(lines)
