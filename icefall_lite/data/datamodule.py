"""The lhotse datamodule of the LibriSpeech recipe (icefall's ``asr_datamodule.py``).

Usage, as in icefall's ``train.py``::

    parser = argparse.ArgumentParser()
    LibriSpeechAsrDataModule.add_arguments(parser, max_duration=TRAIN_MAX_DURATION)
    args = parser.parse_args()
    LibriSpeechAsrDataModule.check_args(parser, args)
    librispeech = LibriSpeechAsrDataModule(args)
    sp = load_bpe_model(args.bpe_model)
    train_cuts = filter_cuts(librispeech.train_cuts(), sp, TRAIN_CUT_DURATION_RANGE)
    train_dl = librispeech.train_dataloaders(train_cuts)
    valid_dl = librispeech.valid_dataloaders(librispeech.valid_cuts())
    test_dl = librispeech.test_dataloaders(librispeech.test_clean_cuts())

A batch is a dict: ``inputs``, a float tensor (N, T, 80) of fbank frames, and
``supervisions``, a dict with ``text`` (list of N str), ``sequence_idx``,
``start_frame`` and ``num_frames`` (int tensors of N) and, with
``--return-cuts true`` (default), ``cut`` (list of N lhotse cuts).

Manifests (made by ``prepare.sh``) are read from ``--manifest-dir``
(``data/fbank``): ``librispeech_cuts_<part>.jsonl.gz`` for the parts
train-clean-100 (the training part; also the synthetic corpus's), dev-clean,
dev-other, test-clean, test-other, and the noise that ``--enable-musan`` mixes
into training cuts: ``musan_cuts.jsonl.gz`` (MUSAN, as icefall) or, without it,
``noise_cuts.jsonl.gz`` (the synthetic noise corpus that stands in for MUSAN).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

import numpy as np
import torch
from lhotse import CutSet, Fbank, FbankConfig, load_manifest, load_manifest_lazy
from lhotse.cut import Cut
from lhotse.dataset import (
    CutMix,
    DynamicBucketingSampler,
    K2SpeechRecognitionDataset,
    SimpleCutSampler,
    SpecAugment,
)
from lhotse.dataset.input_strategies import OnTheFlyFeatures, PrecomputedFeatures
from lhotse.utils import compute_num_frames
from torch.utils.data import DataLoader

from icefall_lite.data.features import NUM_MEL_BINS
from icefall_lite.data.layout import (
    FULL_TRAIN_PARTS,
    MINI_DEV_PART,
    MINI_TRAIN_PART,
    MUSAN_CUTS_NAME,
    NOISE_CUTS_NAME,
    TRAIN_PART,
    librispeech_cuts_name,
)
from icefall_lite.nn.encoder import subsampled_length
from icefall_lite.utils import str2bool

FRAME_SHIFT = 0.01

# icefall's defaults (tdnn_lstm_ctc/asr_datamodule.py).
NOISE_MIX_PROB = 0.5
NOISE_SNR_DB = (10, 20)
SPEC_AUG = dict(num_feature_masks=2, features_mask_size=27, num_frame_masks=10, frames_mask_size=100)


class _SeedWorkers:
    """Seed ``random``, numpy and torch in each DataLoader worker (seed + worker id)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __call__(self, worker_id: int) -> None:
        seed = self.seed + worker_id
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)


class LibriSpeechAsrDataModule:
    """Cut loading, sampling, augmentation and DataLoaders for LibriSpeech-layout data."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, *, max_duration: float) -> None:
        """Add the datamodule's flags (icefall's names) to ``parser``; ``max_duration`` is the script's
        default batch size in seconds (:mod:`icefall_lite.recipe_defaults`)."""
        group = parser.add_argument_group(
            title="ASR data related options",
            description="Options for lhotse cuts, sampling, augmentation and data loading.",
        )
        group.add_argument(
            "--full-libri",
            type=str2bool,
            default=False,
            help="train on all 960 h (real LibriSpeech only); else train-clean-100",
        )
        group.add_argument(
            "--mini-libri",
            type=str2bool,
            default=False,
            help=f"mini LibriSpeech (prepare.sh --corpus mini_librispeech): train on {MINI_TRAIN_PART}, validate "
            f"on {MINI_DEV_PART} (and decode it by default)",
        )
        group.add_argument(
            "--manifest-dir",
            type=Path,
            default=Path("data/fbank"),
            help="folder of librispeech_cuts_<part>.jsonl.gz and musan_cuts.jsonl.gz or noise_cuts.jsonl.gz",
        )
        group.add_argument(
            "--max-duration",
            type=float,
            default=max_duration,
            help="seconds of audio per batch (icefall: 200 on a GPU)",
        )
        group.add_argument(
            "--bucketing-sampler",
            type=str2bool,
            default=True,
            help="DynamicBucketingSampler (cuts of similar duration batched together)",
        )
        group.add_argument(
            "--num-buckets",
            type=int,
            default=10,
            help="buckets of the DynamicBucketingSampler (icefall: 30, for 281k cuts; "
            "10 suits the few thousand cuts of the synthetic corpus)",
        )
        group.add_argument("--shuffle", type=str2bool, default=True, help="shuffle the training cuts every epoch")
        group.add_argument(
            "--drop-last",
            type=str2bool,
            default=False,
            help="drop incomplete training batches (icefall: true). With false, lhotse still "
            "gives every DDP rank the same number of batches; with true a small corpus "
            "loses a partial batch per bucket every epoch (all of the tiny corpus)",
        )
        group.add_argument(
            "--return-cuts", type=str2bool, default=True, help="put the cuts in batch['supervisions']['cut']"
        )
        group.add_argument("--num-workers", type=int, default=1, help="DataLoader worker processes (icefall: 2)")
        group.add_argument(
            "--enable-spec-aug",
            type=str2bool,
            default=False,
            help="SpecAugment: time warp, 2 feature masks of <=27, 10 frame masks of <=100 (icefall: "
            "true; off by default here: it slowed learning within the demo's budget)",
        )
        group.add_argument(
            "--spec-aug-time-warp-factor",
            type=int,
            default=80,
            help="SpecAugment time warp factor; < 1 disables time warping",
        )
        group.add_argument(
            "--enable-musan",
            "--enable-noise",
            dest="enable_musan",
            type=str2bool,
            default=True,
            help="mix MUSAN (musan_cuts.jsonl.gz) or, without it, the noise corpus (noise_cuts.jsonl.gz) into "
            f"training cuts: CutMix p={NOISE_MIX_PROB}, SNR {NOISE_SNR_DB} dB",
        )
        group.add_argument(
            "--on-the-fly-feats",
            type=str2bool,
            default=False,
            help="compute fbank from audio during training instead of loading stored features",
        )

    @staticmethod
    def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
        """argparse errors naming the flag for bad data flags (training and decoding share this check)."""
        if args.full_libri and args.mini_libri:
            parser.error("--full-libri and --mini-libri exclude each other")
        if not args.max_duration > 0:
            parser.error(f"--max-duration must be positive, got {args.max_duration}")
        if args.num_buckets < 1:
            parser.error(f"--num-buckets must be >= 1, got {args.num_buckets}")
        if args.num_workers < 0:
            parser.error(f"--num-workers must be >= 0, got {args.num_workers}")

    # --- manifests -------------------------------------------------------------

    def _cuts(self, name: str) -> CutSet:
        path = Path(self.args.manifest_dir) / name
        if not path.is_file():
            raise FileNotFoundError(f"no cut manifest {path}: run egs/librispeech/ASR/prepare.sh first")
        logging.info(f"loading {path}")
        cuts = load_manifest_lazy(path)
        # lhotse returns None for a manifest without a line.
        return CutSet() if cuts is None else cuts

    def part_cuts(self, part: str) -> CutSet:
        """The cuts of one LibriSpeech part, e.g. ``part_cuts("dev-clean")`` (lazy)."""
        return self._cuts(librispeech_cuts_name(part))

    def train_clean_100_cuts(self) -> CutSet:
        """train-clean-100: the training part (also of the synthetic corpus)."""
        return self.part_cuts(TRAIN_PART)

    def train_clean_360_cuts(self) -> CutSet:
        return self.part_cuts("train-clean-360")

    def train_other_500_cuts(self) -> CutSet:
        return self.part_cuts("train-other-500")

    def train_cuts(self) -> CutSet:
        """The training cuts: train-clean-100; all three parts with ``--full-libri`` (multiplexed lazily in
        proportion to their sizes); train-clean-5 with ``--mini-libri``."""
        if self.args.mini_libri:
            return self.part_cuts(MINI_TRAIN_PART)
        if not self.args.full_libri:
            return self.train_clean_100_cuts()
        missing = [
            p for p in FULL_TRAIN_PARTS if not (Path(self.args.manifest_dir) / librispeech_cuts_name(p)).is_file()
        ]
        if missing:  # prepare.sh makes the two larger parts only when asked: name that flag, not just the script
            raise FileNotFoundError(
                f"--full-libri true trains on {', '.join(FULL_TRAIN_PARTS)}; {self.args.manifest_dir} has no cut "
                f"manifest of {', '.join(missing)}: run egs/librispeech/ASR/prepare.sh --corpus librispeech "
                "--full-libri true first"
            )
        return CutSet.mux(*(self.part_cuts(p) for p in FULL_TRAIN_PARTS), weights=list(FULL_TRAIN_PARTS.values()))

    def valid_cuts(self) -> CutSet:
        """The validation cuts: dev-clean + dev-other; dev-clean-2 with ``--mini-libri``."""
        if self.args.mini_libri:
            return self.part_cuts(MINI_DEV_PART)
        return self.dev_clean_cuts() + self.dev_other_cuts()

    def dev_clean_cuts(self) -> CutSet:
        return self.part_cuts("dev-clean")

    def dev_other_cuts(self) -> CutSet:
        return self.part_cuts("dev-other")

    def test_clean_cuts(self) -> CutSet:
        return self.part_cuts("test-clean")

    def test_other_cuts(self) -> CutSet:
        return self.part_cuts("test-other")

    def noise_cuts(self) -> CutSet:
        """The cuts mixed into training cuts (10 s windows with features), loaded eagerly:
        ``musan_cuts.jsonl.gz`` (real MUSAN, prepared with LibriSpeech) when it exists, else
        ``noise_cuts.jsonl.gz`` (the synthetic noise corpus)."""
        for name in (MUSAN_CUTS_NAME, NOISE_CUTS_NAME):
            path = Path(self.args.manifest_dir) / name
            if path.is_file():
                logging.info(f"noise for mixing: {path}")
                return load_manifest(path)
        raise FileNotFoundError(
            f"no noise cuts in {self.args.manifest_dir} (neither {MUSAN_CUTS_NAME} nor {NOISE_CUTS_NAME}): "
            "run prepare.sh --stage 3 --stop-stage 3 (MUSAN with --corpus librispeech), or pass --enable-musan false"
        )

    # --- loaders ---------------------------------------------------------------

    def _input_strategy(self) -> Any:
        if self.args.on_the_fly_feats:
            return OnTheFlyFeatures(Fbank(FbankConfig(num_mel_bins=NUM_MEL_BINS)))
        return PrecomputedFeatures()

    def train_dataloaders(self, cuts_train: CutSet, sampler_state_dict: Optional[Dict[str, Any]] = None) -> DataLoader:
        """The training DataLoader: noise mixing and SpecAugment as enabled.

        ``sampler_state_dict`` (from ``train_dl.sampler.state_dict()`` in a
        checkpoint) resumes the sampler in the middle of an epoch.
        """
        args = self.args
        transforms = []
        if args.enable_musan:
            logging.info(f"noise mixing on: CutMix p={NOISE_MIX_PROB}, SNR {NOISE_SNR_DB} dB")
            # An RNG of our own (lhotse's default is a fixed seed, the same every
            # epoch) whose state a checkpoint can save: see transform_rng_state().
            mix_rng = random.Random(int(torch.randint(0, 2**31 - 1, ()).item()))
            transforms.append(
                CutMix(cuts=self.noise_cuts(), p=NOISE_MIX_PROB, snr=NOISE_SNR_DB, preserve_id=True, seed=mix_rng)
            )
        input_transforms = []
        if args.enable_spec_aug:
            warp = args.spec_aug_time_warp_factor if args.spec_aug_time_warp_factor >= 1 else None
            logging.info(f"SpecAugment on: time warp factor {warp}, {SPEC_AUG}")
            input_transforms.append(SpecAugment(time_warp_factor=warp, **SPEC_AUG))
        dataset = K2SpeechRecognitionDataset(
            input_strategy=self._input_strategy(),
            cut_transforms=transforms,
            input_transforms=input_transforms,
            return_cuts=args.return_cuts,
        )
        sampler = self._sampler(cuts_train, args.bucketing_sampler, args.shuffle, args.drop_last)
        if sampler_state_dict is not None:
            logging.info("loading the sampler state")
            sampler.load_state_dict(sampler_state_dict)
        seed = int(torch.randint(0, 100000, ()).item())
        return DataLoader(
            dataset,
            sampler=sampler,
            batch_size=None,
            num_workers=args.num_workers,
            persistent_workers=False,
            worker_init_fn=_SeedWorkers(seed),
            pin_memory=torch.cuda.is_available(),  # page-locked batches copy to the GPU asynchronously
        )

    def _sampler(self, cuts: CutSet, bucketing: bool, shuffle: bool, drop_last: bool) -> Any:
        """DynamicBucketingSampler with at most one bucket per cut (lhotse refuses
        more buckets than cuts), or SimpleCutSampler."""
        num_buckets = sum(1 for _ in itertools.islice(cuts, self.args.num_buckets))
        if bucketing and num_buckets > 1:
            return DynamicBucketingSampler(
                cuts,
                max_duration=self.args.max_duration,
                shuffle=shuffle,
                num_buckets=num_buckets,
                drop_last=drop_last,
            )
        return SimpleCutSampler(cuts, max_duration=self.args.max_duration, shuffle=shuffle, drop_last=drop_last)

    def _eval_dataloader(self, cuts: CutSet) -> DataLoader:
        dataset = FiniteFeaturesDataset(input_strategy=self._input_strategy(), return_cuts=self.args.return_cuts)
        sampler = self._sampler(cuts, bucketing=True, shuffle=False, drop_last=False)
        return DataLoader(
            dataset,
            sampler=sampler,
            batch_size=None,
            num_workers=self.args.num_workers,
            pin_memory=torch.cuda.is_available(),
        )

    def valid_dataloaders(self, cuts_valid: CutSet) -> DataLoader:
        """Validation DataLoader: no augmentation, no shuffling."""
        return self._eval_dataloader(cuts_valid)

    def test_dataloaders(self, cuts: CutSet) -> DataLoader:
        """Test DataLoader: no augmentation, no shuffling.

        Raises :class:`EmptyCutSetError` for an empty cut set; iterating raises
        :class:`NonFiniteFeaturesError` or :class:`FeaturesUnreadableError`
        naming a cut whose features hold NaN/inf or cannot be read.
        """
        return self._eval_dataloader(require_nonempty(cuts, "test"))


class CutDataError(RuntimeError):
    """Bad data in a cut set, with a message naming the cut(s) or the set and the fix.

    Scripts catch it at the top and exit with the message instead of a traceback.
    """


class NonFiniteFeaturesError(CutDataError):
    """Features of a cut hold NaN or inf."""


class FeaturesUnreadableError(CutDataError):
    """Features of a cut cannot be read (missing or damaged feature file)."""


_RECOMPUTE_HINT = (
    "recompute the part's features (remove data/fbank/librispeech_cuts_<part>.jsonl.gz and its "
    "librispeech_feats_<part> folder, rerun prepare.sh --stage 2 --stop-stage 2) and check the manifest "
    "with local/validate_manifest.py"
)


class FiniteFeaturesDataset(K2SpeechRecognitionDataset):
    """lhotse's K2SpeechRecognitionDataset that names the cut when its features are unreadable or non-finite.

    Used for validation and decoding, where a non-finite input would silently
    turn into wrong hypotheses or a NaN loss. (Training needs no check: an
    utterance with a non-finite loss is dropped and counted by ``train.py``.)
    """

    def _cut_inputs(self, cut: Cut) -> torch.Tensor:
        return self.input_strategy(CutSet.from_cuts([cut]))[0]

    def __getitem__(self, cuts: CutSet) -> Dict[str, Any]:
        try:
            batch = super().__getitem__(cuts)
        except (OSError, ValueError, RuntimeError) as e:
            bad = []
            for cut in cuts:
                try:
                    self._cut_inputs(cut)
                except (OSError, ValueError, RuntimeError) as cut_error:
                    bad.append(f"{cut.id} ({cut_error})")
            if not bad:
                raise
            raise FeaturesUnreadableError(f"cannot read the features of cut(s) {bad}: {_RECOMPUTE_HINT}") from e
        if not torch.isfinite(batch["inputs"]).all():
            bad = [c.id for c in cuts if not torch.isfinite(self._cut_inputs(c)).all()]
            raise NonFiniteFeaturesError(f"NaN/inf in the features of cut(s) {bad}: {_RECOMPUTE_HINT}")
        return batch


class EmptyCutSetError(CutDataError):
    """A cut set that should hold cuts is empty (after filtering)."""


def require_nonempty(cuts: CutSet, what: str) -> CutSet:
    """Raise :class:`EmptyCutSetError` naming ``what`` when ``cuts`` has no cut (reads one cut)."""
    if next(iter(cuts), None) is None:
        raise EmptyCutSetError(
            f"the {what} cut set is empty (after filtering; see the log for why cuts were removed). "
            "Check --manifest-dir and rerun prepare.sh if the manifests are empty."
        )
    return cuts


def _transform_rngs(dataloader: DataLoader) -> List[random.Random]:
    dataset = dataloader.dataset
    return [
        t.seed
        for t in getattr(dataset, "cut_transforms", []) or []
        if isinstance(getattr(t, "seed", None), random.Random)
    ]


def transform_rng_state(dataloader: DataLoader) -> List[Any]:
    """States of the RNGs of the loader's cut transforms (noise mixing), for a checkpoint.

    With ``--num-workers 0`` these and the global RNGs make a resumed epoch
    draw the same augmentation as an uninterrupted one.
    """
    return [rng.getstate() for rng in _transform_rngs(dataloader)]


def set_transform_rng_state(dataloader: DataLoader, states: List[Any]) -> None:
    """Restore :func:`transform_rng_state` into a loader built with the same flags."""
    rngs = _transform_rngs(dataloader)
    if len(rngs) != len(states):
        raise ValueError(f"checkpoint has {len(states)} transform RNG states, the loader {len(rngs)} transforms")
    for rng, state in zip(rngs, states):
        rng.setstate(state)


# --- filtering cuts the encoder cannot handle ----------------------------------


# icefall trains on 1-20 s utterances (local/make_corrupted_cuts.py corrupts among the same cuts).
TRAIN_CUT_DURATION_RANGE = (1.0, 20.0)


def encoder_frames(num_frames: int) -> int:
    """Frames after the encoder's Conv2dSubsampling (:func:`icefall_lite.nn.encoder.subsampled_length`)."""
    return int(subsampled_length(num_frames))


def cut_num_frames(cut: Cut) -> int:
    """Feature frames of ``cut`` (stored, or computed from its duration at 10 ms)."""
    if cut.has_features:
        return cut.num_frames
    return compute_num_frames(cut.duration, FRAME_SHIFT, cut.sampling_rate)


def rejection_reason(
    cut: Cut,
    sp: Optional[Any] = None,
    cut_duration_range: Optional[Tuple[float, float]] = None,
) -> str:
    """Why ``cut`` cannot be trained on ("" if it can).

    Reasons: no supervision text; duration outside ``cut_duration_range``
    (seconds, both ends included); fewer than one frame after subsampling;
    more BPE tokens (with ``sp``) than frames after subsampling (the
    transducer loss needs ``T' >= U``).
    """
    text = " ".join(s.text or "" for s in cut.supervisions).strip()
    if not text:
        return "no supervision text"
    if cut_duration_range is not None:
        shortest, longest = cut_duration_range
        if cut.duration < shortest:
            return f"shorter than {shortest} s"
        if cut.duration > longest:
            return f"longer than {longest} s"
    t_out = encoder_frames(cut_num_frames(cut))
    if t_out < 1:
        return "too short for the encoder's subsampling"
    if sp is not None and len(sp.encode(text)) > t_out:
        return "more tokens than frames after subsampling"
    return ""


@dataclass(frozen=True)
class _KeepIds:
    """A picklable cut predicate: keep the cuts whose id is in ``ids``."""

    ids: FrozenSet[str]

    def __call__(self, cut: Cut) -> bool:
        return cut.id in self.ids


def filter_cuts(
    cuts: CutSet,
    sp: Optional[Any] = None,
    cut_duration_range: Optional[Tuple[float, float]] = None,
    name: str = "cuts",
) -> CutSet:
    """Remove the cuts :func:`rejection_reason` rejects; log how many and why.

    One pass decides (and logs each removed cut at DEBUG level, the counts per
    reason at INFO/WARNING); the result filters by cut id, so it stays lazy for
    a lazy ``cuts``.
    """
    kept = set()
    reasons: Counter = Counter()
    for cut in cuts:
        reason = rejection_reason(cut, sp, cut_duration_range)
        if reason:
            reasons[reason] += 1
            logging.debug(f"removing cut {cut.id} ({cut.duration:.2f} s): {reason}")
        else:
            kept.add(cut.id)
    removed = sum(reasons.values())
    total = removed + len(kept)
    detail = ", ".join(f"{n} {r}" for r, n in sorted(reasons.items()))
    if removed:
        logging.warning(f"{name}: removed {removed} of {total} cuts ({detail})")
    else:
        logging.info(f"{name}: kept all {total} cuts")
    return cuts.filter(_KeepIds(frozenset(kept)))
