"""80-dim fbank features for cut manifests, and their validation.

Features are computed with :class:`lhotse.Fbank` (pure torch) and stored with
``LilcomChunkyWriter``.  Work is split into many chunks run by a pool of
``spawn`` worker processes (one torch thread each), so the progress bar moves
per chunk.  A cut manifest is written under a temporary name and renamed when
all its features are stored: the manifest is the "done" marker, and a rerun
deletes any feature storage left without one.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import time
from concurrent.futures import Executor, ProcessPoolExecutor
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from lhotse import CutSet, Fbank, FbankConfig, LilcomChunkyWriter, load_manifest, load_manifest_lazy
from lhotse.cut import Cut
from lhotse.utils import compute_num_frames

from icefall_lite.data.layout import librispeech_cuts_path
from icefall_lite.data.manifests import manifest_paths
from icefall_lite.utils import atomic_output, progress_bar, remove_path

NUM_MEL_BINS = 80
# The value of a padding frame (lhotse pads fbank batches with log(1e-10)).
LOG_EPS = math.log(1e-10)
# icefall pads this many frames of LOG_EPS at the end of every utterance
# before the LSTM encoder when decoding, against deletions at the end of utterances.
NUM_TAIL_PADDED_FRAMES = 35
CUTS_PER_CHUNK = 200
SPEED_FACTORS = (0.9, 1.1)
TIME_TOLERANCE = 2e-3  # seconds


def fbank_extractor() -> Fbank:
    """icefall's features: lhotse ``Fbank`` with 80 mel bins (25 ms / 10 ms)."""
    return Fbank(FbankConfig(num_mel_bins=NUM_MEL_BINS))


def _one_thread() -> None:
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)


def _compute_chunk(cuts: CutSet, storage_path: Path) -> CutSet:
    return cuts.compute_and_store_features(
        extractor=fbank_extractor(),
        storage_path=storage_path,
        storage_type=LilcomChunkyWriter,
        progress_bar=False,
    ).to_eager()


def feature_executor(num_jobs: int) -> Optional[ProcessPoolExecutor]:
    """A pool of ``num_jobs`` spawned one-thread workers, or None for ``num_jobs <= 1``.

    Make one per script and pass it to every :func:`compute_features` call, so
    workers start (import torch and lhotse) once.
    """
    if num_jobs <= 1:
        return None
    ctx = multiprocessing.get_context("spawn")
    return ProcessPoolExecutor(num_jobs, mp_context=ctx, initializer=_one_thread)


def compute_features(cuts: CutSet, storage_dir: Path, executor: Optional[Executor], desc: str) -> CutSet:
    """Compute and store fbank of ``cuts`` under ``storage_dir`` (recreated); return the cuts.

    The cuts are split in chunks of ``CUTS_PER_CHUNK``, each stored in its own
    ``feats-<i>.lca``; chunks run on ``executor`` (in this process if None).
    Cuts whose audio cannot be loaded are dropped by lhotse with a warning;
    the number dropped is logged.
    """
    remove_path(storage_dir)
    storage_dir.mkdir(parents=True)
    cuts = cuts.to_eager()
    num_chunks = max(1, math.ceil(len(cuts) / CUTS_PER_CHUNK))
    chunks = cuts.split(num_chunks) if num_chunks > 1 else [cuts]
    paths = [storage_dir / f"feats-{i}" for i in range(len(chunks))]
    if executor is None:
        results = [_compute_chunk(c, p) for c, p in progress_bar(list(zip(chunks, paths)), desc=desc)]
    else:
        futures = [executor.submit(_compute_chunk, c, p) for c, p in zip(chunks, paths)]
        results = [f.result() for f in progress_bar(futures, desc=desc)]
    out = CutSet.from_cuts(c for r in results for c in r)
    if len(out) != len(cuts):
        logging.warning(f"{desc}: {len(cuts) - len(out)} of {len(cuts)} cuts had unreadable audio and were dropped")
    return out


def compute_fbank_librispeech(
    manifest_dir: Path,
    fbank_dir: Path,
    parts: Sequence[str],
    num_jobs: int = 1,
    perturb_speed: bool = False,
) -> List[Path]:
    """Cut manifests with features for each part; return their paths.

    With ``perturb_speed`` the training parts (``train*``) get 0.9x and 1.1x
    speed-perturbed copies, as in icefall.  Finished parts are skipped.
    """
    todo = []
    for part in parts:
        out_path = librispeech_cuts_path(fbank_dir, part)
        if out_path.is_file():
            logging.info(f"{part}: {out_path} exists - skipping")
        else:
            todo.append(part)
    if todo:
        # Worker processes pay off only when there is more than one chunk.
        num_cuts = sum(len(load_manifest(manifest_paths(manifest_dir, p)[1])) for p in todo)
        executor = feature_executor(num_jobs if num_cuts > CUTS_PER_CHUNK else 1)
        try:
            for part in todo:
                _fbank_part(manifest_dir, fbank_dir, part, executor, perturb_speed)
        finally:
            if executor is not None:
                executor.shutdown()
    return [librispeech_cuts_path(fbank_dir, part) for part in parts]


def _fbank_part(
    manifest_dir: Path, fbank_dir: Path, part: str, executor: Optional[Executor], perturb_speed: bool
) -> None:
    """Features and the cut manifest of one part."""
    start = time.time()
    out_path = librispeech_cuts_path(fbank_dir, part)
    rec_path, sup_path = manifest_paths(manifest_dir, part)
    cuts = CutSet.from_manifests(recordings=load_manifest(rec_path), supervisions=load_manifest(sup_path))
    if perturb_speed and part.startswith("train"):
        logging.info(f"{part}: adding speed perturbation {SPEED_FACTORS}")
        cuts = cuts + cuts.perturb_speed(SPEED_FACTORS[0]) + cuts.perturb_speed(SPEED_FACTORS[1])
    storage = fbank_dir / f"librispeech_feats_{part}"
    cuts = compute_features(cuts, storage, executor, desc=f"fbank {part}")
    with atomic_output(out_path) as tmp:
        cuts.to_file(tmp)
    hours = sum(c.duration for c in cuts) / 3600
    secs = time.time() - start
    logging.info(
        f"{part}: wrote {len(cuts)} cuts ({hours:.3f} h) to {out_path} in {secs:.1f} s "
        f"({hours * 3600 / max(secs, 1e-6):.0f}x real time)"
    )


class ManifestError(ValueError):
    """A cut manifest fails validation; the message names the cut."""


def validate_cut(cut: Cut, supervised: bool = True, check_storage: bool = True, load: bool = False) -> None:
    """Check one cut: a non-empty supervision within the cut (when ``supervised``),
    features whose frame count matches the duration, an existing feature file
    (when ``check_storage``), readable finite features (when ``load``).

    Raises:
        ManifestError: naming the cut id and the problem.
    """
    if supervised and not cut.supervisions:
        raise ManifestError(f"cut {cut.id}: has no supervision")
    for sup in cut.supervisions:
        if not (sup.text or "").strip():
            raise ManifestError(f"cut {cut.id}: supervision {sup.id} has empty text")
        if sup.start < -TIME_TOLERANCE or sup.end > cut.duration + TIME_TOLERANCE:
            raise ManifestError(
                f"cut {cut.id}: supervision {sup.id} [{sup.start:.3f}, {sup.end:.3f}] s "
                f"lies outside the cut [0, {cut.duration:.3f}] s"
            )
    if not cut.has_features:
        raise ManifestError(f"cut {cut.id}: has no features")
    feats = cut.features
    expected = compute_num_frames(feats.duration, feats.frame_shift, feats.sampling_rate)
    if feats.num_frames != expected:
        raise ManifestError(
            f"cut {cut.id}: {feats.num_frames} feature frames but the features' duration "
            f"{feats.duration:.3f} s needs {expected}"
        )
    if cut.start < feats.start - TIME_TOLERANCE or cut.end > feats.start + feats.duration + TIME_TOLERANCE:
        raise ManifestError(
            f"cut {cut.id}: [{cut.start:.3f}, {cut.end:.3f}] s is not covered by its features "
            f"[{feats.start:.3f}, {feats.start + feats.duration:.3f}] s"
        )
    if check_storage:
        storage = Path(cut.features.storage_path)
        if not storage.exists():
            raise ManifestError(f"cut {cut.id}: feature file {storage} is missing")
    if load:
        feats = cut.load_features()
        if feats.shape[0] != cut.num_frames or not torch.isfinite(torch.from_numpy(feats)).all():
            raise ManifestError(f"cut {cut.id}: stored features have shape {feats.shape} or non-finite values")


def validate_cut_manifest(path: Path, supervised: bool = True, load_features: bool = False) -> int:
    """Validate every cut of the manifest at ``path`` (see :func:`validate_cut`);
    return the number of cuts.

    Raises:
        ManifestError: the first bad cut (named), or an empty manifest.
    """
    n = 0
    seen_storage: set = set()
    for cut in progress_bar(load_manifest_lazy(path), desc=f"validating {path.name}"):
        storage = cut.features.storage_path if cut.has_features else None
        validate_cut(cut, supervised, check_storage=storage not in seen_storage, load=load_features)
        seen_storage.add(storage)
        n += 1
    if n == 0:
        raise ManifestError(f"{path}: no cuts")
    return n


# --- tail padding (decoding always, training with --tail-pad-frames) ------------


def pad_tail(feature: torch.Tensor, feature_lens: torch.Tensor, num_frames: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Append ``num_frames`` frames of log(1e-10) to every utterance (icefall's fix for tail deletions).

    As icefall, the frames are appended after the batch's last frame; lhotse
    pads a shorter utterance with log(1e-10) already, so every utterance is
    followed by at least ``num_frames`` frames of log(1e-10).

    Args:
      feature: (N, T, C) padded batch (padding log(1e-10), as lhotse's).
      feature_lens: (N,) valid frames.
      num_frames: frames to append (icefall's decode.py: :data:`NUM_TAIL_PADDED_FRAMES`).
    Returns:
      feature (N, T + num_frames, C) and feature_lens + num_frames.
    """
    feature = F.pad(feature, (0, 0, 0, num_frames), mode="constant", value=LOG_EPS)
    return feature, feature_lens + num_frames
