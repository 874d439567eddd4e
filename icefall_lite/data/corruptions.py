"""What a corrupted training cut is: one function per kind (:data:`KINDS`), each an :class:`Edit` of one cut.

Text kinds (the features untouched):

* ``random-text``: random BPE pieces, ``density`` x the cut's encoder frames (a dense, wrong label sequence);
* ``swap-text``: the transcript of another training cut, drawn at random (audio and text mis-paired).

Feature kinds (new arrays, written beside the manifest):

* ``scale-features``: the log-mel features x ``scale`` (the encoder's front end normalises it away);
* ``truncate``: the first third of the frames, the whole transcript kept (audio cut short);
* ``silence``: the cut's quietest frame (its per-bin minimum) repeated for :data:`SILENCE_FACTOR` x its
  length, inserted at a random frame (a long untranscribed pause, as unsegmented recordings have);
* ``noise-burst``: :data:`BURST_SECONDS` of frames :data:`BURST_DB` dB above the cut's loudest frame (its
  per-bin maximum, jittered by unit Gaussian noise in the log domain), inserted at a random frame;
* ``concat``: other training cuts appended, in a random draw, with their transcripts, while the whole stays
  within the training's longest duration (a very long utterance, correctly labelled).

A kind returns None when the cut cannot be corrupted that way and still be trained on (e.g. a third of a
2 s cut is under train.py's 1 s minimum): :func:`apply_edit` checks the edited cut with train.py's own
filter, so a corrupted cut always reaches training.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from lhotse.cut import Cut
from lhotse.features.io import NumpyFilesWriter
from lhotse.utils import fastcopy

from icefall_lite.data.datamodule import encoder_frames

TEXT_KINDS = ("random-text", "swap-text")
FEATURE_KINDS = ("scale-features", "truncate", "silence", "noise-burst", "concat")
KINDS = TEXT_KINDS + FEATURE_KINDS
# The kinds of outlier utterance that real corpora hold, which the "mix" method spreads its cuts over evenly.
MIX_KINDS = ("swap-text", "truncate", "silence", "noise-burst", "concat")
SILENCE_FACTOR = 2.0
BURST_SECONDS = 1.0
BURST_DB = 20.0
# lhotse's noise mixing sums exp(log-mel) over a cut in float32 (max ~3.4e38).
MAX_MIXABLE_ENERGY = 1e37
PARTNER_DRAWS = 50  # swap-text and concat: partners drawn at most, per cut


class CorruptionError(ValueError):
    """Bad corruption settings or inputs (the message names the fix)."""


@dataclass
class Context:
    """What the kinds draw on: the BPE model, the random draws, the settings, the clean training cuts
    (``pool``: partners of swap-text and concat) and where new feature arrays go."""

    sp: Any
    rng: random.Random
    density: float
    scale: float
    pool: Dict[str, Cut]
    writer: Optional[NumpyFilesWriter] = None
    storage_path: str = ""
    pieces: List[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.pieces:
            self.pieces = text_pieces(self.sp)
        self.pool_ids = sorted(self.pool)

    def partner(self, cut: Cut) -> Cut:
        """A clean training cut other than ``cut``, drawn at random."""
        while True:
            other = self.pool[self.rng.choice(self.pool_ids)]
            if other.id != cut.id:
                return other


@dataclass
class Edit:
    """A kind's change to one cut: new features (None: unchanged), the new transcript, what it did."""

    feats: Optional[np.ndarray]
    text: str
    info: Dict[str, Any]


def text_pieces(sp: Any) -> List[int]:
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
    pieces = text_pieces(sp) if pieces is None else pieces
    ids = [rng.choice(pieces) for _ in range(num_tokens)]
    text = sp.decode(ids).strip()
    while len(ids) > 1 and (not text or len(sp.encode(text)) > num_tokens):
        ids.pop()
        text = sp.decode(ids).strip()
    return text


def _text(cut: Cut) -> str:
    return cut.supervisions[0].text


def _fits(sp: Any, text: str, num_frames: int) -> bool:
    """No more BPE tokens than encoder frames (the transducer loss needs it)."""
    return len(sp.encode(text)) <= encoder_frames(num_frames)


def edit_random_text(cut: Cut, ctx: Context) -> Edit:
    target = max(1, int(ctx.density * encoder_frames(cut.num_frames)))
    text = random_text(ctx.sp, target, ctx.rng, ctx.pieces)
    while text == _text(cut):
        text = random_text(ctx.sp, target, ctx.rng, ctx.pieces)
    info = {"encoder_frames": encoder_frames(cut.num_frames), "tokens_before": len(ctx.sp.encode(_text(cut)))}
    return Edit(None, text, {**info, "tokens_after": len(ctx.sp.encode(text))})


def edit_swap_text(cut: Cut, ctx: Context) -> Optional[Edit]:
    for _ in range(PARTNER_DRAWS):
        other = ctx.partner(cut)
        if _text(other) != _text(cut) and _fits(ctx.sp, _text(other), cut.num_frames):
            return Edit(None, _text(other), {"text_of": other.id})
    return None


def edit_scale_features(cut: Cut, ctx: Context) -> Edit:
    feats = cut.load_features().astype(np.float32) * np.float32(ctx.scale)
    energy = float(np.exp(np.float64(feats.max()))) * feats.size
    if not np.isfinite(energy) or energy > MAX_MIXABLE_ENERGY:
        raise CorruptionError(
            f"cut {cut.id}: features x {ctx.scale} reach {feats.max():.1f}; lhotse's noise mixing would overflow "
            f"(exp(feature) summed in float32). Use a smaller scale (e.g. 10)."
        )
    return Edit(feats, _text(cut), {"max_before": float(feats.max() / ctx.scale), "max_after": float(feats.max())})


def edit_truncate(cut: Cut, ctx: Context) -> Edit:
    feats = cut.load_features()
    return Edit(feats[: feats.shape[0] // 3], _text(cut), {"frames_before": int(feats.shape[0])})


def _insert(feats: np.ndarray, block: np.ndarray, rng: random.Random) -> Tuple[np.ndarray, int]:
    at = rng.randint(0, feats.shape[0])
    return np.concatenate([feats[:at], block.astype(feats.dtype), feats[at:]]), at


def edit_silence(cut: Cut, ctx: Context) -> Edit:
    feats = cut.load_features()
    length = int(round(SILENCE_FACTOR * feats.shape[0]))
    out, at = _insert(feats, np.repeat(feats.min(axis=0, keepdims=True), length, axis=0), ctx.rng)
    return Edit(out, _text(cut), {"inserted_frames": length, "at_frame": at})


def edit_noise_burst(cut: Cut, ctx: Context) -> Edit:
    feats = cut.load_features()
    length = int(round(BURST_SECONDS / cut.frame_shift))
    jitter = np.random.default_rng(ctx.rng.getrandbits(32)).standard_normal((length, feats.shape[1]))
    loudest = feats.max(axis=0, keepdims=True) + BURST_DB / 10 * math.log(10)
    out, at = _insert(feats, loudest + jitter, ctx.rng)
    return Edit(out, _text(cut), {"inserted_frames": length, "at_frame": at})


def concat_limit(longest_seconds: float, frame_shift: float) -> int:
    """Frames a concatenation may reach: the training's longest duration."""
    return int(math.floor(longest_seconds / frame_shift + 1e-6))


def edit_concat(cut: Cut, ctx: Context, max_frames: int) -> Optional[Edit]:
    parts, texts, ids = [cut.load_features()], [_text(cut)], []
    frames = parts[0].shape[0]
    for _ in range(PARTNER_DRAWS):
        other = ctx.partner(cut)
        if frames + other.num_frames > max_frames:
            break
        parts.append(other.load_features())
        texts.append(_text(other))
        ids.append(other.id)
        frames += other.num_frames
    if not ids:
        return None
    return Edit(np.concatenate(parts), " ".join(texts), {"appended": ids, "frames_before": int(parts[0].shape[0])})


def edit_for(kind: str, longest_seconds: float) -> Callable[[Cut, Context], Optional[Edit]]:
    """The function of ``kind`` (one of :data:`KINDS`); ``longest_seconds``: the training's longest cut."""
    if kind == "concat":
        return lambda cut, ctx: edit_concat(cut, ctx, concat_limit(longest_seconds, cut.frame_shift))
    edits = {
        "random-text": edit_random_text,
        "swap-text": edit_swap_text,
        "scale-features": edit_scale_features,
        "truncate": edit_truncate,
        "silence": edit_silence,
        "noise-burst": edit_noise_burst,
    }
    if kind not in edits:
        raise CorruptionError(f"unknown corruption kind {kind!r}; choose one of {KINDS}")
    return edits[kind]


def edited_duration(cut: Cut, edit: Edit) -> float:
    return cut.duration if edit.feats is None else round(edit.feats.shape[0] * cut.frame_shift, 6)


def trainable(cut: Cut, edit: Edit, sp: Any, duration_range: Tuple[float, float]) -> bool:
    """Whether train.py's filter keeps the edited cut (duration in range, no more tokens than frames)."""
    frames = cut.num_frames if edit.feats is None else edit.feats.shape[0]
    return duration_range[0] <= edited_duration(cut, edit) <= duration_range[1] and _fits(sp, edit.text, frames)


def apply_edit(cut: Cut, edit: Edit, ctx: Context) -> Cut:
    """``cut`` with ``edit`` applied: new features are written by ``ctx.writer``. A cut whose length changed
    spans its new features from 0 (its supervision too) and keeps no recording (its audio is no longer what
    the features show)."""
    sups = [fastcopy(cut.supervisions[0], text=edit.text)] + list(cut.supervisions[1:])
    if edit.feats is None:
        return fastcopy(cut, supervisions=sups)
    if ctx.writer is None:
        raise CorruptionError("feature kinds need a directory for the new feature arrays")
    key = ctx.writer.write(cut.id, edit.feats.astype(np.float32))
    stored = dict(storage_type=ctx.writer.name, storage_path=ctx.storage_path, storage_key=key)
    if edit.feats.shape[0] == cut.num_frames:
        return fastcopy(cut, features=fastcopy(cut.features, **stored), supervisions=sups)
    duration = edited_duration(cut, edit)
    frames = int(edit.feats.shape[0])
    # Without a recording, the cut's recording id is its features': the one its supervision names.
    features = fastcopy(
        cut.features, **stored, num_frames=frames, start=0.0, duration=duration, recording_id=cut.recording_id
    )
    sup = fastcopy(cut.supervisions[0], start=0.0, duration=duration, text=edit.text)
    return fastcopy(cut, start=0.0, duration=duration, features=features, recording=None, supervisions=[sup])
