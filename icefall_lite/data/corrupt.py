"""Deterministic corruption of a fraction of the training cuts (the ablation's
"corrupted training set").

Methods (``CORRUPTION_METHODS``):

* ``random-text``: the transcript of a chosen cut is replaced by random BPE
  pieces, ``density`` x as many as the cut has encoder frames (so the
  transducer loss and train.py's token/frame filter still accept it). The
  features are untouched: the cut keeps its duration, so the sampler puts it
  in exactly the batch the clean cut would be in. A dense, wrong label
  sequence raises that sequence's loss and gradient; how far is measured by
  the ablation of 2026-11-23 (egs/librispeech/ASR/HISTORY.md, part 2: in its run the largest
  per-sequence gradient stayed below 25 x the batch median).
* ``scale-features``: the log-mel features of a chosen cut are multiplied by
  ``scale`` and stored as new arrays. The encoder's front end normalises the
  scale away (ScaledConv2d + DoubleSwish are homogeneous, BasicNorm divides by
  the RMS), so this does *not* raise the gradient; it is kept to show that.

The cuts are chosen with ``random.Random(seed)`` among those train.py would
train on; their number is :func:`num_to_corrupt` of the manifest's size.
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
from lhotse import CutSet, load_manifest
from lhotse.cut import Cut
from lhotse.features.io import NumpyFilesWriter
from lhotse.utils import fastcopy

from icefall_lite.data.datamodule import encoder_frames, rejection_reason
from icefall_lite.data.layout import TRAIN_PART, librispeech_cuts_name
from icefall_lite.utils import atomic_output, progress_bar, remove_path, write_text_atomic

CORRUPTION_METHODS = ("random-text", "scale-features")
TRAIN_MANIFEST = librispeech_cuts_name(TRAIN_PART)
# lhotse's noise mixing sums exp(log-mel) over a cut in float32 (max ~3.4e38).
MAX_MIXABLE_ENERGY = 1e37
DONE_MARKER = ".corrupted.done"
IDS_FILE = "corrupted_cut_ids.txt"
INFO_FILE = "corruption.json"


class CorruptionError(ValueError):
    """Bad corruption settings or inputs (the message names the fix)."""


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


def _text_pieces(sp: Any) -> List[int]:
    """Ids of the ordinary pieces (no control/unknown pieces, not the bare word boundary)."""
    return [
        i
        for i in range(sp.get_piece_size())
        if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i)) and sp.id_to_piece(i).strip("\u2581")
    ]


def random_text(sp: Any, num_tokens: int, rng: random.Random, pieces: Optional[Sequence[int]] = None) -> str:
    """Text of random BPE pieces that encodes to at most ``num_tokens`` (>= 1) tokens."""
    if num_tokens < 1:
        raise CorruptionError(f"need at least one token, got {num_tokens}")
    pieces = _text_pieces(sp) if pieces is None else pieces
    ids = [rng.choice(pieces) for _ in range(num_tokens)]
    text = sp.decode(ids).strip()
    while len(ids) > 1 and (not text or len(sp.encode(text)) > num_tokens):
        ids.pop()
        text = sp.decode(ids).strip()
    return text


def corrupt_text(
    cut: Cut, sp: Any, density: float, rng: random.Random, pieces: Sequence[int]
) -> Tuple[Cut, Dict[str, Any]]:
    """``cut`` with its transcript replaced by :func:`random_text` of ``density`` x its encoder frames."""
    frames = encoder_frames(cut.num_frames)
    target = max(1, int(density * frames))
    original = cut.supervisions[0].text
    text = random_text(sp, target, rng, pieces)
    while text == original:
        text = random_text(sp, target, rng, pieces)
    sups = [fastcopy(cut.supervisions[0], text=text)] + list(cut.supervisions[1:])
    info = {"encoder_frames": frames, "tokens_before": len(sp.encode(original)), "tokens_after": len(sp.encode(text))}
    return fastcopy(cut, supervisions=sups), info


def corrupt_features(cut: Cut, scale: float, writer: NumpyFilesWriter, storage_path: str) -> Tuple[Cut, Dict[str, Any]]:
    """``cut`` whose features are ``scale`` x the original, written with ``writer``."""
    feats = cut.load_features().astype(np.float32) * np.float32(scale)
    energy = float(np.exp(np.float64(feats.max()))) * feats.size
    if not np.isfinite(energy) or energy > MAX_MIXABLE_ENERGY:
        raise CorruptionError(
            f"cut {cut.id}: features x {scale} reach {feats.max():.1f}; lhotse's noise mixing would overflow "
            f"(exp(feature) summed in float32). Use a smaller scale (e.g. 10)."
        )
    key = writer.write(cut.id, feats)
    features = fastcopy(cut.features, storage_type=writer.name, storage_path=storage_path, storage_key=key)
    return fastcopy(cut, features=features), {"max_before": float(feats.max() / scale), "max_after": float(feats.max())}


def corrupt_cuts(
    cuts: CutSet, chosen: Sequence[str], config: CorruptionConfig, sp: Any, feats_dir: Optional[Path] = None
) -> Tuple[CutSet, Dict[str, Dict[str, Any]]]:
    """The cut set with the ``chosen`` cuts corrupted (same order), and per-cut details.

    ``feats_dir`` (``scale-features`` only) receives the new feature arrays;
    the manifest refers to it by the path as given (relative paths are read
    relative to the directory training runs in, as prepare.sh's).
    """
    chosen_set = set(chosen)
    rng = random.Random(config.seed + 1)
    pieces = _text_pieces(sp)
    out: List[Cut] = []
    details: Dict[str, Dict[str, Any]] = {}
    writer = None
    if config.method == "scale-features":
        if feats_dir is None:
            raise CorruptionError("scale-features needs a directory for the new feature arrays")
        writer = NumpyFilesWriter(str(feats_dir))
    for cut in progress_bar(cuts, desc=f"corrupting ({config.method})", unit="cut"):
        if cut.id in chosen_set:
            if config.method == "random-text":
                cut, details[cut.id] = corrupt_text(cut, sp, config.density, rng, pieces)
            else:
                cut, details[cut.id] = corrupt_features(cut, config.scale, writer, str(feats_dir))
        out.append(cut)
    missing = chosen_set - set(details)
    if missing:
        raise CorruptionError(f"chosen cuts not in the manifest: {sorted(missing)[:5]}")
    return CutSet.from_cuts(out), details


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
    count = num_to_corrupt(len(cuts), config.fraction)
    chosen = choose_cut_ids(eligible_cut_ids(cuts, sp, duration_range), count, config.seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    feats_dir = out_dir / "feats" if config.method == "scale-features" else None
    if feats_dir is not None:
        remove_path(feats_dir)
    corrupted, details = corrupt_cuts(cuts, chosen, config, sp, feats_dir)
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
