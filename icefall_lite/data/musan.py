"""Noise for CutMix, as icefall prepares MUSAN: recordings cut into 10 s windows with fbank.

icefall's LibriSpeech recipe mixes MUSAN (OpenSLR 17: music, speech and
noise recordings) into training cuts. Its preparation, here in the same steps:

1. download and untar ``musan.tar.gz`` into ``<dl_dir>/musan`` with lhotse
   (:func:`download_musan`; skipped when the folder exists);
2. lhotse's ``prepare_musan`` manifests of the three parts,
   ``data/manifests/musan_{recordings,supervisions}_<part>.jsonl.gz``
   (:func:`prepare_musan_manifests`);
3. every recording of the three parts cut into 10 s windows, the windows of
   5 s or less dropped, 80-dim fbank stored in ``data/fbank/musan_feats/``,
   cuts in ``data/fbank/musan_cuts.jsonl.gz`` (:func:`noise_window_cuts`,
   shared with the synthetic noise corpus that stands in for MUSAN).

The datamodule mixes these cuts into training cuts (``--enable-musan``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict

from lhotse import CutSet, RecordingSet

from icefall_lite.data.features import compute_features, feature_executor
from icefall_lite.data.layout import MUSAN_CUTS_NAME
from icefall_lite.utils import atomic_output

MUSAN_URL = "https://www.openslr.org/resources/17/musan.tar.gz"
MUSAN_PARTS = ("music", "speech", "noise")
WINDOW_SECONDS = 10.0
MIN_WINDOW_SECONDS = 5.0


class MusanError(FileNotFoundError):
    """The MUSAN folder is missing or not in MUSAN's layout."""


def download_musan(dl_dir: Path, url: str = MUSAN_URL) -> Path:
    """``<dl_dir>/musan``, downloaded and unpacked by lhotse unless the folder exists."""
    musan_dir = Path(dl_dir) / "musan"
    if musan_dir.is_dir():
        logging.info(f"{musan_dir} exists - not downloading MUSAN")
        return musan_dir
    from lhotse.recipes import download_musan as lhotse_download_musan

    logging.info(f"downloading MUSAN from {url} into {dl_dir} (about 11 GB)")
    return Path(lhotse_download_musan(dl_dir, url=url))


def check_musan_dir(musan_dir: Path) -> None:
    """Raise :class:`MusanError` naming the folder and the fix unless ``musan_dir`` has MUSAN's
    three part folders with WAV files in them."""
    fix = (
        "download it with prepare.sh --corpus librispeech --stage 3 --stop-stage 3 (OpenSLR 17, about 11 GB), "
        "or unpack musan.tar.gz there"
    )
    if not musan_dir.is_dir():
        raise MusanError(f"no MUSAN folder at {musan_dir}: {fix}")
    for part in MUSAN_PARTS:
        part_dir = musan_dir / part
        if not part_dir.is_dir() or next(part_dir.rglob("*.wav"), None) is None:
            raise MusanError(
                f"{musan_dir} is not MUSAN: {part_dir} is missing or has no .wav files "
                f"(MUSAN has {', '.join(p + '/' for p in MUSAN_PARTS)} folders of WAVs): {fix}"
            )


def prepare_musan_manifests(musan_dir: Path, manifest_dir: Path) -> RecordingSet:
    """lhotse's MUSAN manifests of the three parts in ``manifest_dir``; returns all their recordings."""
    from lhotse.recipes import prepare_musan

    check_musan_dir(musan_dir)
    manifests: Dict[str, Dict] = prepare_musan(corpus_dir=musan_dir, output_dir=manifest_dir, parts=MUSAN_PARTS)
    recordings = [rec for part in MUSAN_PARTS for rec in manifests[part]["recordings"]]
    logging.info(
        "MUSAN recordings: " + ", ".join(f"{part} {len(manifests[part]['recordings'])}" for part in MUSAN_PARTS)
    )
    return RecordingSet.from_recordings(recordings)


def noise_window_cuts(
    recordings: RecordingSet, fbank_dir: Path, cuts_name: str, feats_name: str, num_jobs: int = 1
) -> Path:
    """Cut ``recordings`` into windows of ``WINDOW_SECONDS``, keep those longer than
    ``MIN_WINDOW_SECONDS``, store their fbank in ``fbank_dir/feats_name`` and the cuts in
    ``fbank_dir/cuts_name`` (written atomically); return the cut manifest's path."""
    cuts_path = Path(fbank_dir) / cuts_name
    cuts = (
        CutSet.from_manifests(recordings=recordings)
        .cut_into_windows(WINDOW_SECONDS)
        .filter(lambda cut: cut.duration > MIN_WINDOW_SECONDS)
        .to_eager()
    )
    if len(cuts) == 0:
        raise ValueError(
            f"no recording of {len(recordings)} gives a window longer than {MIN_WINDOW_SECONDS} s; "
            f"nothing to write to {cuts_path}"
        )
    executor = feature_executor(num_jobs)
    try:
        cuts = compute_features(cuts, Path(fbank_dir) / feats_name, executor, desc=f"fbank {feats_name}")
    finally:
        if executor is not None:
            executor.shutdown()
    with atomic_output(cuts_path) as tmp:
        cuts.to_file(tmp)
    logging.info(f"wrote {len(cuts)} cuts ({sum(c.duration for c in cuts) / 3600:.3f} h) to {cuts_path}")
    return cuts_path


def compute_fbank_musan(musan_dir: Path, manifest_dir: Path, fbank_dir: Path, num_jobs: int = 1) -> Path:
    """Steps 2 and 3: manifests and ``fbank_dir/musan_cuts.jsonl.gz`` (skipped if it exists)."""
    cuts_path = Path(fbank_dir) / MUSAN_CUTS_NAME
    if cuts_path.is_file():
        logging.info(f"{cuts_path} exists - skipping")
        return cuts_path
    recordings = prepare_musan_manifests(Path(musan_dir), Path(manifest_dir))
    return noise_window_cuts(recordings, fbank_dir, MUSAN_CUTS_NAME, "musan_feats", num_jobs)


__all__ = [
    "MUSAN_PARTS",
    "MUSAN_URL",
    "MusanError",
    "check_musan_dir",
    "compute_fbank_musan",
    "download_musan",
    "noise_window_cuts",
    "prepare_musan_manifests",
]
