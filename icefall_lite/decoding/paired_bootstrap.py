"""The WER difference of two decodings of the same test set, with a paired bootstrap interval.

Two systems decode the same utterances; resampling utterances with
replacement (the same resample for both) and recomputing
``WER(b) - WER(a)`` gives the spread that comes from which utterances the test
set happens to hold (Bisani and Ney, 2004).  It says nothing about training
noise: two seeds of one system differ by more than this interval suggests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Sequence, Tuple

import numpy as np

from icefall_lite.decoding.metrics import Result, compute_wer


@dataclass(frozen=True)
class PairedWerDifference:
    """``wer_b - wer_a`` in WER points, its bootstrap interval and the resamples with b better."""

    wer_a: float
    wer_b: float
    difference: float
    low: float
    high: float
    b_better_fraction: float
    utterances: int


def per_utterance_counts(results: Sequence[Result]) -> Dict[str, Tuple[int, int]]:
    """``{cut_id: (errors, reference words)}`` of ``(cut_id, ref, hyp)`` triples."""
    counts: Dict[str, Tuple[int, int]] = {}
    for cut_id, ref, hyp in results:
        if cut_id in counts:
            raise ValueError(f"utterance {cut_id!r} appears twice")
        stats = compute_wer([(cut_id, ref, hyp)])
        counts[cut_id] = (stats.errors, stats.ref_words)
    return counts


def paired_bootstrap(
    results_a: Sequence[Result],
    results_b: Sequence[Result],
    num_resamples: int = 10000,
    confidence: float = 0.95,
    seed: int = 0,
) -> PairedWerDifference:
    """:class:`PairedWerDifference` of two decodings of the same utterances (percentile interval).

    Raises:
      ValueError: the two hold different utterances or references.
    """
    a, b = per_utterance_counts(results_a), per_utterance_counts(results_b)
    if a.keys() != b.keys():
        only = sorted(a.keys() ^ b.keys())
        raise ValueError(f"the decodings hold different utterances ({len(only)} in one only, e.g. {only[:3]})")
    ids = sorted(a)
    words = np.array([a[i][1] for i in ids], dtype=np.int64)
    if any(b[i][1] != a[i][1] for i in ids):
        raise ValueError("the decodings have different references for the same utterance")
    errors_a = np.array([a[i][0] for i in ids], dtype=np.int64)
    errors_b = np.array([b[i][0] for i in ids], dtype=np.int64)
    rng = np.random.default_rng(seed)
    picks = rng.integers(len(ids), size=(num_resamples, len(ids)))
    total_words = words[picks].sum(axis=1)
    diffs = 100.0 * (errors_b[picks].sum(axis=1) - errors_a[picks].sum(axis=1)) / total_words
    tail = 100.0 * (1.0 - confidence) / 2.0
    low, high = np.percentile(diffs, [tail, 100.0 - tail])
    wer_a = 100.0 * errors_a.sum() / words.sum()
    wer_b = 100.0 * errors_b.sum() / words.sum()
    return PairedWerDifference(
        wer_a=float(wer_a),
        wer_b=float(wer_b),
        difference=float(wer_b - wer_a),
        low=float(low),
        high=float(high),
        b_better_fraction=float(np.mean(diffs < 0)),
        utterances=len(ids),
    )
