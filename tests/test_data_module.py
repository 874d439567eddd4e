"""The lhotse datamodule (icefall_lite.data.datamodule) on a small hand-made data set:
tone audio with fbank, a noise corpus of coloured noise, a BPE model."""

import argparse
import logging
from pathlib import Path
from typing import List

import numpy as np
import pytest
import soundfile as sf
import torch
from lhotse import load_manifest, load_manifest_lazy
from lhotse.cut import MixedCut

from icefall_lite.data.bpe import load_bpe_model, train_bpe_model, write_transcript_words
from icefall_lite.data.datamodule import LibriSpeechAsrDataModule, encoder_frames, filter_cuts, rejection_reason
from icefall_lite.data.features import compute_fbank_librispeech, librispeech_cuts_path
from icefall_lite.data.manifests import prepare_librispeech_manifests
from icefall_lite.data.synthetic.noise import coloured_noise
from icefall_lite.data.synthetic.noise_corpus import prepare_noise_cuts

SR = 16000
WORDS = "THE QUICK BROWN FOX JUMPS OVER A LAZY DOG AND RUNS AWAY FROM HOME AT NIGHT".split()
LONG_TEXT = " ".join(WORDS * 2)  # many tokens for 0.3 s


def _write_part(corpus: Path, part: str, durations: List[float], texts: List[str]) -> None:
    rng = np.random.default_rng(len(durations))
    folder = corpus / part / "7" / "70"
    folder.mkdir(parents=True)
    lines = []
    for i, (seconds, text) in enumerate(zip(durations, texts)):
        t = np.arange(int(seconds * SR)) / SR
        audio = 0.3 * np.sin(2 * np.pi * rng.uniform(100, 500) * t) + 0.02 * rng.standard_normal(t.size)
        sf.write(str(folder / f"7-70-{i:04d}.flac"), audio.astype(np.float32), SR, format="FLAC", subtype="PCM_16")
        lines.append(f"7-70-{i:04d} {text}\n")
    (folder / "7-70.trans.txt").write_text("".join(lines))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dm")
    rng = np.random.default_rng(0)
    n = 24
    durations = [float(d) for d in rng.uniform(2.0, 4.0, size=n)] + [0.05, 0.3]
    texts = [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 6)))) for _ in range(n)] + ["THE DOG", LONG_TEXT]
    corpus = root / "LibriSpeech"
    _write_part(corpus, "train-clean-100", durations, texts)
    _write_part(corpus, "dev-clean", durations[:6], texts[:6])
    parts = ["train-clean-100", "dev-clean"]
    prepare_librispeech_manifests(corpus, parts, root / "manifests")
    compute_fbank_librispeech(root / "manifests", root / "fbank", parts)
    noise_dir = root / "noise"
    for colour in ("white", "brown"):
        (noise_dir / colour).mkdir(parents=True)
        samples = 0.1 * coloured_noise(colour, 12 * SR, rng)
        sf.write(str(noise_dir / colour / f"{colour}-0.flac"), samples, SR, format="FLAC", subtype="PCM_16")
    prepare_noise_cuts(noise_dir, root / "manifests", root / "fbank")
    write_transcript_words(texts * 4, root / "lang" / "transcript_words.txt")
    train_bpe_model(root / "lang" / "transcript_words.txt", root / "lang", vocab_size=30)
    return root


def _args(data_dir: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    LibriSpeechAsrDataModule.add_arguments(parser, max_duration=100.0)
    return parser.parse_args(
        ["--manifest-dir", str(data_dir / "fbank"), "--num-workers", "0", "--max-duration", "10", *extra]
    )


def test_flags_and_defaults() -> None:
    parser = argparse.ArgumentParser()
    LibriSpeechAsrDataModule.add_arguments(parser, max_duration=25.0)
    args = parser.parse_args([])
    # The script gives --max-duration's default; the library has none of its own.
    assert args.max_duration == 25.0 and args.bucketing_sampler and args.num_buckets == 10
    assert args.shuffle and not args.drop_last and not args.enable_spec_aug and args.enable_musan
    assert args.num_workers == 1 and args.manifest_dir == Path("data/fbank") and args.return_cuts
    assert args.spec_aug_time_warp_factor == 80 and not args.on_the_fly_feats and not args.full_libri
    assert not parser.parse_args(["--enable-noise", "false"]).enable_musan
    assert not parser.parse_args(["--enable-musan", "no", "--drop-last", "true"]).enable_musan
    for argv, flag in (
        (["--max-duration", "0"], "--max-duration"),
        (["--num-buckets", "0"], "--num-buckets"),
        (["--num-workers", "-1"], "--num-workers"),
    ):
        with pytest.raises(SystemExit):
            LibriSpeechAsrDataModule.check_args(parser, parser.parse_args(argv))


def test_encoder_frames_formula() -> None:
    assert [encoder_frames(t) for t in (7, 8, 9, 10, 11, 100)] == [0, 0, 1, 1, 1, 23]


def test_filter_removes_and_counts(data_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    sp = load_bpe_model(data_dir / "lang" / "bpe.model")
    cuts = load_manifest_lazy(librispeech_cuts_path(data_dir / "fbank", "train-clean-100"))
    with caplog.at_level(logging.INFO):
        kept = filter_cuts(cuts, sp, name="train")
    assert kept.is_lazy
    ids = [c.id for c in kept]
    assert len(ids) == 24 and not any(i.startswith(("7-70-0024", "7-70-0025")) for i in ids)
    assert "train: removed 2 of 26 cuts" in caplog.text
    assert "1 too short for the encoder's subsampling" in caplog.text
    assert "1 more tokens than frames after subsampling" in caplog.text
    by_utt = {c.supervisions[0].id: c for c in cuts}
    assert rejection_reason(by_utt["7-70-0025"], None) == ""  # without a BPE model only length counts
    assert rejection_reason(by_utt["7-70-0001"], sp, cut_duration_range=(0.0, 0.5)).startswith("longer than")
    assert rejection_reason(by_utt["7-70-0001"], sp, cut_duration_range=(5.0, 100.0)).startswith("shorter than")


def _epoch(dl) -> list:
    return list(dl)


def test_train_batch_keys_and_shapes(data_dir: Path) -> None:
    dm = LibriSpeechAsrDataModule(_args(data_dir))
    sp = load_bpe_model(data_dir / "lang" / "bpe.model")
    cuts = filter_cuts(dm.train_clean_100_cuts(), sp)
    batches = _epoch(dm.train_dataloaders(cuts))
    assert batches
    seen = []
    for batch in batches:
        assert set(batch) == {"inputs", "supervisions"}
        x, sup = batch["inputs"], batch["supervisions"]
        assert x.dim() == 3 and x.shape[2] == 80 and x.dtype == torch.float32 and torch.isfinite(x).all()
        n = x.shape[0]
        assert set(sup) == {"text", "sequence_idx", "start_frame", "num_frames", "cut"}
        assert len(sup["text"]) == n == len(sup["cut"]) == sup["num_frames"].numel()
        assert int(sup["num_frames"].max()) <= x.shape[1]
        assert sum(c.duration for c in sup["cut"]) <= 10.0 + 1e-6
        seen += [c.id for c in sup["cut"]]
    assert sorted(seen) == sorted(c.id for c in cuts)  # drop_last false: one epoch = every cut once
    assert any(isinstance(c, MixedCut) for b in batches for c in b["supervisions"]["cut"])


def test_augmentation_switches(data_dir: Path) -> None:
    stored = {
        c.id: torch.from_numpy(c.load_features())
        for c in load_manifest(librispeech_cuts_path(data_dir / "fbank", "train-clean-100"))
    }

    def differences(*flags: str) -> int:
        torch.manual_seed(0)
        dm = LibriSpeechAsrDataModule(_args(data_dir, *flags))
        changed = 0
        for batch in dm.train_dataloaders(dm.train_clean_100_cuts()):
            sup = batch["supervisions"]
            for i, cut in enumerate(sup["cut"]):
                n = int(sup["num_frames"][i])
                changed += not torch.allclose(batch["inputs"][i, :n], stored[cut.id], atol=1e-5)
        return changed

    assert differences("--enable-spec-aug", "false", "--enable-musan", "false") == 0
    assert differences("--enable-spec-aug", "true", "--enable-musan", "false") > 5
    assert differences("--enable-spec-aug", "false", "--enable-musan", "true") > 5


def test_missing_noise_manifest_is_explained(data_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "librispeech_cuts_train-clean-100.jsonl.gz").symlink_to(
        librispeech_cuts_path(data_dir / "fbank", "train-clean-100")
    )
    dm = LibriSpeechAsrDataModule(_args(data_dir, "--manifest-dir", str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="noise_cuts.jsonl.gz.*stage 3.*--enable-musan false"):
        dm.train_dataloaders(dm.train_clean_100_cuts())
    with pytest.raises(FileNotFoundError, match="librispeech_cuts_dev-other.jsonl.gz: run .*prepare.sh"):
        dm.dev_other_cuts()
    full = LibriSpeechAsrDataModule(_args(data_dir, "--manifest-dir", str(tmp_path), "--full-libri", "true"))
    with pytest.raises(
        FileNotFoundError,
        match="no cut manifest of train-clean-360, train-other-500: run .*prepare.sh --corpus "
        "librispeech --full-libri true first",
    ):
        full.train_cuts()


def test_valid_and_test_loaders_are_plain_and_ordered(data_dir: Path) -> None:
    dm = LibriSpeechAsrDataModule(_args(data_dir))
    cuts = dm.dev_clean_cuts()
    first = [[c.id for c in b["supervisions"]["cut"]] for b in dm.valid_dataloaders(cuts)]
    again = [[c.id for c in b["supervisions"]["cut"]] for b in dm.test_dataloaders(cuts)]
    assert first == again and sorted(sum(first, [])) == sorted(c.id for c in cuts)
    stored = {c.id: torch.from_numpy(c.load_features()) for c in cuts}
    for batch in dm.test_dataloaders(cuts):
        for i, cut in enumerate(batch["supervisions"]["cut"]):
            assert not isinstance(cut, MixedCut)
            n = int(batch["supervisions"]["num_frames"][i])
            assert torch.allclose(batch["inputs"][i, :n], stored[cut.id], atol=1e-5)


def test_sampler_state_resumes_mid_epoch(data_dir: Path) -> None:
    dm = LibriSpeechAsrDataModule(_args(data_dir, "--max-duration", "4"))
    cuts = dm.train_clean_100_cuts()
    dl = dm.train_dataloaders(cuts)
    it = iter(dl)
    done = [[c.id for c in next(it)["supervisions"]["cut"]] for _ in range(2)]
    state = dl.sampler.state_dict()
    rest = [[c.id for c in b["supervisions"]["cut"]] for b in it]
    resumed = dm.train_dataloaders(cuts, sampler_state_dict=state)
    assert [[c.id for c in b["supervisions"]["cut"]] for b in resumed] == rest
    assert len(done) == 2 and rest


def test_on_the_fly_features_and_plain_sampler(data_dir: Path) -> None:
    dm = LibriSpeechAsrDataModule(
        _args(data_dir, "--on-the-fly-feats", "true", "--bucketing-sampler", "false", "--enable-musan", "false")
    )
    batch = next(iter(dm.train_dataloaders(dm.dev_clean_cuts())))
    assert batch["inputs"].shape[2] == 80 and batch["inputs"].shape[0] == len(batch["supervisions"]["text"])
