"""Deterministic corruption of a fraction of the training cuts (the studies' "corrupted training set").

Methods (``CORRUPTION_METHODS``): each kind of :mod:`icefall_lite.data.corruptions` alone, or ``mix``,
which spreads the corrupted cuts evenly over the kinds real corpora hold (``MIX_KINDS``: swapped transcripts,
truncated audio, long silences, noise bursts, long concatenations), in turn.

* ``random-text``: a dense, wrong label sequence; how far it raises a sequence's gradient is measured by the
  ablation of 2026-11-23 (egs/librispeech/ASR/HISTORY.md, part 2: in its run the largest per-sequence
  gradient stayed below 25 x the batch median).
* ``scale-features``: the encoder's front end normalises the scale away (ScaledConv2d + DoubleSwish are
  homogeneous, BasicNorm divides by the RMS), so this does *not* raise the gradient; it is kept to show that.

The cuts are chosen with ``random.Random(seed)`` among those train.py would train on; their number is
:func:`num_to_corrupt` of the manifest's size. ``random-text`` and ``scale-features`` corrupt any such cut
and draw them at once (:func:`choose_cut_ids`, as since their first study); the other kinds try the cuts in
a seeded order and pass over a cut that, so corrupted, train.py would not train on (counted and logged).
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from lhotse import CutSet, load_manifest
from lhotse.cut import Cut
from lhotse.features.io import NumpyFilesWriter

from icefall_lite.data.corruptions import (
    FEATURE_KINDS,
    KINDS,
    MIX_KINDS,
    Context,
    CorruptionError,
    apply_edit,
    edit_for,
    trainable,
)
from icefall_lite.data.datamodule import rejection_reason
from icefall_lite.data.layout import TRAIN_PART, librispeech_cuts_name
from icefall_lite.utils import atomic_output, progress_bar, remove_path, write_text_atomic

MIX = "mix"
CORRUPTION_METHODS = KINDS + (MIX,)
ANY_CUT_METHODS = ("random-text", "scale-features")  # methods that can corrupt every trainable cut
TRAIN_MANIFEST = librispeech_cuts_name(TRAIN_PART)
DONE_MARKER = ".corrupted.done"
IDS_FILE = "corrupted_cut_ids.txt"
INFO_FILE = "corruption.json"


@dataclass(frozen=True)
class CorruptionConfig:
    """What to corrupt and how; stored beside the corrupted manifest."""

    method: str = "random-text"
    fraction: float = 0.02
    seed: int = 42
    density: float = 0.9
    scale: float = 10.0

    def validate(self) -> None:
        """Raise :class:`CorruptionError` for a value out of range."""
        if self.method not in CORRUPTION_METHODS:
            raise CorruptionError(f"unknown corruption method {self.method!r}; choose one of {CORRUPTION_METHODS}")
        if not 0.0 < self.fraction <= 1.0:
            raise CorruptionError(f"the fraction of corrupted cuts must be in (0, 1], got {self.fraction}")
        if not 0.0 < self.density <= 1.0:
            raise CorruptionError(f"the token density must be in (0, 1] (tokens per encoder frame), got {self.density}")
        if self.scale <= 0:
            raise CorruptionError(f"the feature scale must be positive, got {self.scale}")

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def num_to_corrupt(num_cuts: int, fraction: float) -> int:
    """``round(fraction * num_cuts)``, at least 1 (for a non-empty set)."""
    if num_cuts <= 0:
        return 0
    return max(1, int(round(fraction * num_cuts)))


def eligible_cut_ids(cuts: Sequence[Cut], sp: Any, duration_range: Tuple[float, float]) -> List[str]:
    """Ids of the cuts the training keeps (``duration_range`` in seconds, no more tokens than frames), sorted."""
    return sorted(c.id for c in cuts if not rejection_reason(c, sp, cut_duration_range=duration_range))


def choose_cut_ids(eligible: Sequence[str], count: int, seed: int) -> List[str]:
    """``count`` ids drawn without replacement by ``random.Random(seed)`` (sorted)."""
    if count > len(eligible):
        raise CorruptionError(
            f"cannot corrupt {count} cuts: only {len(eligible)} cuts are usable for training; lower the fraction"
        )
    return sorted(random.Random(seed).sample(sorted(eligible), count))


def kinds_of(method: str) -> Tuple[str, ...]:
    """The kinds ``method`` uses, in turn."""
    return MIX_KINDS if method == MIX else (method,)


def corrupt_cuts(
    cuts: CutSet,
    config: CorruptionConfig,
    sp: Any,
    duration_range: Tuple[float, float],
    feats_dir: Optional[Path] = None,
) -> Tuple[CutSet, Dict[str, Dict[str, Any]]]:
    """The cut set with ``num_to_corrupt`` of its trainable cuts corrupted (same order), and per-cut details
    (``kind`` and what it did).

    ``feats_dir`` (feature kinds) receives the new feature arrays; the manifest refers to it by the path as
    given (relative paths are read relative to the directory training runs in, as prepare.sh's).
    """
    cuts = list(cuts)
    count = num_to_corrupt(len(cuts), config.fraction)
    eligible = eligible_cut_ids(cuts, sp, duration_range)
    by_id = {c.id: c for c in cuts}
    kinds = kinds_of(config.method)
    writer = None
    if set(kinds) & set(FEATURE_KINDS):
        if feats_dir is None:
            raise CorruptionError(f"{config.method} needs a directory for the new feature arrays")
        writer = NumpyFilesWriter(str(feats_dir))
    ctx = Context(
        sp=sp,
        rng=random.Random(config.seed + 1),
        density=config.density,
        scale=config.scale,
        pool={i: by_id[i] for i in eligible},
        writer=writer,
        storage_path=str(feats_dir) if feats_dir is not None else "",
    )
    if config.method in ANY_CUT_METHODS:  # in manifest order, as their random draws were made first
        chosen = set(choose_cut_ids(eligible, count, config.seed))
        order = [c.id for c in cuts if c.id in chosen]
    else:
        order = random.Random(config.seed).sample(sorted(eligible), len(eligible))
    corrupted: Dict[str, Cut] = {}
    details: Dict[str, Dict[str, Any]] = {}
    passed = 0
    with progress_bar(total=count, desc=f"corrupting ({config.method})", unit="cut") as bar:
        for cut_id in order:
            if len(corrupted) == count:
                break
            kind = kinds[len(corrupted) % len(kinds)]
            cut = by_id[cut_id]
            edit = edit_for(kind, duration_range[1])(cut, ctx)
            if edit is None or not trainable(cut, edit, sp, duration_range):
                passed += 1
                continue
            corrupted[cut_id] = apply_edit(cut, edit, ctx)
            details[cut_id] = {"kind": kind, **edit.info}
            bar.update(1)
    if len(corrupted) < count:
        raise CorruptionError(
            f"only {len(corrupted)} of the {count} cuts could be corrupted by {config.method} and still be "
            f"trained on ({passed} passed over); lower the fraction"
        )
    if passed:
        logging.info(f"passed over {passed} cuts that, so corrupted, train.py would not train on")
    return CutSet.from_cuts([corrupted.get(c.id, c) for c in cuts]), details


def differing_cut_ids(a: CutSet, b: CutSet) -> List[str]:
    """Ids of the cuts whose manifest entries differ between ``a`` and ``b`` (same ids required)."""
    da = {c.id: c.to_dict() for c in a}
    db = {c.id: c.to_dict() for c in b}
    if set(da) != set(db):
        raise CorruptionError(f"the cut sets hold different ids ({len(set(da) ^ set(db))} not in both)")
    return sorted(i for i in da if da[i] != db[i])


def link_other_manifests(src_dir: Path, out_dir: Path) -> List[str]:
    """Relative symlinks in ``out_dir`` to every ``*.jsonl.gz`` of ``src_dir`` except the training manifest."""
    linked = []
    for path in sorted(src_dir.glob("*.jsonl.gz")):
        if path.name == TRAIN_MANIFEST:
            continue
        link = out_dir / path.name
        remove_path(link)
        link.symlink_to(os.path.relpath(path.resolve(), out_dir.resolve()))
        linked.append(path.name)
    return linked


def read_done(out_dir: Path) -> Optional[Dict[str, Any]]:
    """The settings a finished corrupted manifest dir was made with (None if unfinished)."""
    marker = out_dir / DONE_MARKER
    if not marker.is_file():
        return None
    return json.loads(marker.read_text())


def make_corrupted_dir(
    src_dir: Path, out_dir: Path, config: CorruptionConfig, sp: Any, duration_range: Tuple[float, float]
) -> Dict[str, Any]:
    """Write ``out_dir``: the corrupted training manifest, links to the other manifests,
    the corrupted cut ids and ``corruption.json``; a marker last. Returns the summary.

    The corrupted cuts are chosen among those the training keeps: ``duration_range``
    is the recipe's (train.py's ``TRAIN_DURATION_RANGE``).

    A finished ``out_dir`` made with the same settings is reused; one made with
    other settings is an error (remove it, or use another directory).
    """
    config.validate()
    wanted = {"source": str(src_dir.resolve()), **config.to_dict()}
    done = read_done(out_dir)
    if done is not None:
        if done.get("settings") != wanted:
            raise CorruptionError(
                f"{out_dir} holds a corrupted set made with other settings ({done.get('settings')}); "
                f"remove it or choose another output directory"
            )
        logging.info(f"{out_dir}: corrupted manifest already made ({done['num_corrupted']} cuts); skipping")
        return done
    src = src_dir / TRAIN_MANIFEST
    if not src.is_file():
        raise CorruptionError(f"no training manifest {src}: run prepare.sh first")
    cuts = load_manifest(src)
    out_dir.mkdir(parents=True, exist_ok=True)
    feats_dir = out_dir / "feats" if set(kinds_of(config.method)) & set(FEATURE_KINDS) else None
    if feats_dir is not None:
        remove_path(feats_dir)
    corrupted, details = corrupt_cuts(cuts, config, sp, duration_range, feats_dir)
    chosen = sorted(details)
    with atomic_output(out_dir / TRAIN_MANIFEST) as tmp:
        corrupted.to_file(tmp)
    linked = link_other_manifests(src_dir, out_dir)
    write_text_atomic(out_dir / IDS_FILE, "".join(f"{i}\n" for i in chosen))
    summary = {"settings": wanted, "num_cuts": len(cuts), "num_corrupted": len(chosen), "linked": linked}
    write_text_atomic(out_dir / INFO_FILE, json.dumps({**summary, "cuts": details}, indent=2) + "\n")
    write_text_atomic(out_dir / DONE_MARKER, json.dumps(summary, indent=2) + "\n")
    logging.info(
        f"{out_dir}: corrupted {len(chosen)} of {len(cuts)} cuts ({config.method}); linked {', '.join(linked)}"
    )
    return summary
