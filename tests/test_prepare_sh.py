"""End to end: `prepare.sh --size tiny` (every stage), the tiny synthetic corpus
it builds, reruns, and the real-LibriSpeech path against a local mirror."""

import argparse
import functools
import json
import os
import shutil
import signal
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import soundfile as sf
from lhotse import load_manifest

from icefall_lite.data.bpe import load_bpe_model
from icefall_lite.data.datamodule import LibriSpeechAsrDataModule, filter_cuts
from icefall_lite.data.synthetic import tts
from icefall_lite.data.synthetic.corpus import EVAL_PARTS, PARTS, SIZES, TRAIN_PART, plan_corpus, render_utterance
from icefall_lite.data.text_norm import ALLOWED_CHARS

RECIPE = Path(__file__).resolve().parents[1] / "egs" / "librispeech" / "ASR"


def run_prepare(*args: str) -> subprocess.CompletedProcess:
    """Run prepare.sh; stdout and stderr together in .stdout."""
    return subprocess.run(
        ["bash", str(RECIPE / "prepare.sh"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


@pytest.fixture(scope="module")
def tiny(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of the session's `prepare.sh --size tiny` work dir
    (conftest.py's ``tiny_data``), which these tests rerun and damage."""
    work = tmp_path_factory.mktemp("tiny") / "work"
    shutil.copytree(tiny_data, work, symlinks=True)
    return work


def _transcripts(part_dir: Path) -> Dict[str, str]:
    out = {}
    for trans in part_dir.rglob("*.trans.txt"):
        for line in trans.read_text().splitlines():
            utt, text = line.split(maxsplit=1)
            out[utt] = text
    return out


def test_every_stage_wrote_its_outputs(tiny: Path) -> None:
    fbank = tiny / "data" / "fbank"
    for part in PARTS:
        assert (tiny / "download" / "LibriSpeech" / part / ".completed").is_file()
        assert (tiny / "data" / "manifests" / f"librispeech_recordings_{part}.jsonl.gz").is_file()
        assert (tiny / "data" / "manifests" / f"librispeech_supervisions_{part}.jsonl.gz").is_file()
        assert (fbank / f"librispeech_cuts_{part}.jsonl.gz").is_file()
    assert (fbank / "noise_cuts.jsonl.gz").is_file()
    for name in ("bpe.model", "tokens.txt", "transcript_words.txt"):
        assert (tiny / "data" / "lang_bpe_100" / name).is_file()
    leftovers = [p for p in tiny.rglob("*") if p.name.startswith(".tmp") or p.name.endswith(".partial")]
    assert leftovers == []


def test_tiny_corpus_layout_and_audio(tiny: Path) -> None:
    corpus = tiny / "download" / "LibriSpeech"
    info = json.loads((corpus / "SYNTHETIC.json").read_text())
    for part in PARTS:
        texts = _transcripts(corpus / part)
        assert len(texts) == info["parts"][part]["utterances"]
        for utt, text in texts.items():
            spk, chap, _ = utt.split("-")
            flac = corpus / part / spk / chap / f"{utt}.flac"
            meta = sf.info(str(flac))
            assert meta.samplerate == 16000 and meta.channels == 1 and meta.format == "FLAC"
            assert 5 <= len(text.split()) <= 20 and set(text) <= ALLOWED_CHARS and text == text.upper()
    assert info["parts"][TRAIN_PART]["utterances"] == SIZES["tiny"].max_train_utts
    assert all(info["parts"][p]["utterances"] == SIZES["tiny"].eval_utts for p in EVAL_PARTS)


def test_sentences_never_cross_parts_and_voices_split_as_librispeech(tiny: Path) -> None:
    corpus = tiny / "download" / "LibriSpeech"
    texts = {p: _transcripts(corpus / p) for p in PARTS}
    speakers = {p: {u.split("-")[0] for u in texts[p]} for p in PARTS}
    for i, a in enumerate(PARTS):
        for b in PARTS[i + 1 :]:
            assert not set(texts[a].values()) & set(texts[b].values()), (a, b)
    assert speakers["dev-clean"] <= speakers[TRAIN_PART] and speakers["test-clean"] <= speakers[TRAIN_PART]
    for part in ("dev-other", "test-other"):
        assert not speakers[part] & speakers[TRAIN_PART]
    assert not speakers["dev-other"] & speakers["test-other"]


def test_other_parts_are_noisy_and_voices_unseen_in_the_plan() -> None:
    plan = plan_corpus(SIZES["tiny"], 42)
    train_voices = {u.voice for u in plan.utterances if u.part == TRAIN_PART}
    for u in plan.utterances:
        if u.part.endswith("-other"):
            assert u.voice not in train_voices and u.noise in ("white", "pink", "brown", "babble")
            assert 10.0 <= u.snr_db <= 20.0
            if u.voice.engine == "espeak":
                accent, variant = u.voice.name.split("+")
                assert accent in tts.OTHER_ACCENTS or variant in tts.OTHER_VARIANTS
            else:
                assert u.voice.name in tts.OTHER_FLITE
        else:
            assert u.noise is None
    names = {u.voice.name for u in plan.utterances if u.part.endswith("-other")}
    assert not names & {v.name for v in train_voices}


@functools.lru_cache(maxsize=1)
def _espeak_data_dir() -> Path:
    version = subprocess.run(["espeak-ng", "--version"], capture_output=True, text=True, check=True).stdout
    return Path(version.split("Data at:")[1].strip())


def _klatt_mode(variant: str) -> int:
    """The ``klatt N`` line of espeak-ng's file for ``variant`` (0 when it has none)."""
    path = _espeak_data_dir() / "voices" / "!v" / variant
    modes = [int(line.split()[1]) for line in path.read_text().splitlines() if line.split()[:1] == ["klatt"]]
    return modes[0] if modes else 0


def test_extra_variants_exist_and_share_nothing_with_the_unseen_voices() -> None:
    assert not set(tts.EXTRA_VARIANTS) & set(tts.TRAIN_VARIANTS + tts.OTHER_VARIANTS)
    assert len(set(tts.EXTRA_VARIANTS)) == len(tts.EXTRA_VARIANTS)
    reserved_klatt = {_klatt_mode(v) for v in tts.OTHER_VARIANTS} - {0}
    assert reserved_klatt == {2, 4}
    # No extra variant is built on a Klatt mode that only the unseen voices use.
    assert {v: _klatt_mode(v) for v in tts.EXTRA_VARIANTS if _klatt_mode(v) in reserved_klatt} == {}
    assert _klatt_mode("UniRobot") == 4  # the check can fail: a variant it rules out
    accents = sorted(tts.TRAIN_ACCENTS)
    for i, variant in enumerate(tts.EXTRA_VARIANTS):
        voice = tts.Voice("espeak", f"{accents[i % len(accents)]}+{variant}", 170, 50)
        samples = tts.synthesize(voice, "one two")
        assert samples.size > 0.3 * tts.SAMPLE_RATE and np.abs(samples).max() > 0.01, variant


def test_default_corpus_is_small_plus_extra_speech_with_the_same_eval_parts() -> None:
    small, default = plan_corpus(SIZES["small"], 42), plan_corpus(SIZES["default"], 42)
    n = len(small.utterances)
    # Everything of the small corpus (training base, dev, test, babble) is in the default one, unchanged.
    assert default.utterances[:n] == small.utterances
    assert default.babble_sentences == small.babble_sentences
    extra = default.utterances[n:]
    size = SIZES["default"]
    assert extra and all(u.part == TRAIN_PART and u.noise is None for u in extra)
    hours = sum(0.52 + 0.24 * len(u.text.split()) for u in extra) / 3600  # the planning estimate
    assert size.extra_train_hours <= hours < size.extra_train_hours + 0.01
    assert len({u.voice for u in extra}) == size.extra_train_speakers
    variants = set()
    for u in extra:
        if u.voice.engine == "espeak":
            accent, variant = u.voice.name.split("+")
            assert accent in tts.TRAIN_ACCENTS and variant in tts.TRAIN_VARIANTS + tts.EXTRA_VARIANTS
            variants.add(variant)
        else:
            assert u.voice.name in tts.TRAIN_FLITE
    # The extra voices spread over the extra variants, not only the base's ten.
    assert len(variants & set(tts.EXTRA_VARIANTS)) >= len(tts.EXTRA_VARIANTS) // 2
    assert len({u.utt_id for u in default.utterances}) == len(default.utterances)
    # No extra sentence is in an evaluation part, in the -other parts' babble, or in the base
    # training text; each has a word outside the base vocabulary.
    eval_text = {u.text for u in small.utterances if u.part != TRAIN_PART}
    base_text = {u.text for u in small.utterances if u.part == TRAIN_PART}
    extra_text = {u.text for u in extra}
    assert not extra_text & (eval_text | base_text | set(small.babble_sentences))
    base_words = {w for t in base_text | eval_text for w in t.split()}
    assert all(any(w not in base_words for w in t.split()) for t in extra_text)
    assert len(extra_text) == len(extra)  # 7 h of unique sentences: no sentence read twice


def test_corpus_is_deterministic_for_a_seed(tiny: Path, tmp_path: Path) -> None:
    a, b, c = plan_corpus(SIZES["tiny"], 42), plan_corpus(SIZES["tiny"], 42), plan_corpus(SIZES["tiny"], 43)
    assert a.utterances == b.utterances and a.utterances != c.utterances
    # Re-render clean and noisy utterances in this process (prepare.sh used 2
    # worker processes): the FLACs must be identical to the bytes.
    from icefall_lite.data.synthetic import corpus as synth_corpus

    bank = synth_corpus.make_babble_bank(a, SIZES["tiny"], 1)
    synth_corpus.set_babble_bank(bank)
    chosen = [u for u in a.utterances if u.noise is None][:2] + [u for u in a.utterances if u.noise][:4]
    for utt in chosen:
        utt_id, seconds, error = render_utterance((utt, tmp_path))
        assert error == "" and seconds > 0
        built = tiny / "download" / "LibriSpeech" / utt.relpath
        assert (tmp_path / utt.relpath).read_bytes() == built.read_bytes(), utt_id


def test_manifests_load_and_agree(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tiny)  # feature paths are relative to the work dir, as in icefall
    info = json.loads((tiny / "download" / "LibriSpeech" / "SYNTHETIC.json").read_text())
    for part in PARTS:
        sups = load_manifest(tiny / "data" / "manifests" / f"librispeech_supervisions_{part}.jsonl.gz")
        recs = load_manifest(tiny / "data" / "manifests" / f"librispeech_recordings_{part}.jsonl.gz")
        cuts = load_manifest(tiny / "data" / "fbank" / f"librispeech_cuts_{part}.jsonl.gz")
        assert len(sups) == len(recs) == len(cuts) == info["parts"][part]["utterances"]
        cut = cuts[0]
        assert cut.load_features().shape == (cut.num_frames, 80)
    noise = load_manifest(tiny / "data" / "fbank" / "noise_cuts.jsonl.gz")
    kinds = {c.recording_id.split("-")[0] for c in noise}
    assert kinds == {"white", "pink", "brown", "babble"} and all(5.0 < c.duration <= 10.0 for c in noise)


def test_bpe_of_the_tiny_corpus(tiny: Path) -> None:
    lang = tiny / "data" / "lang_bpe_100"
    sp = load_bpe_model(lang / "bpe.model")
    assert sp.get_piece_size() == 100
    tokens = (lang / "tokens.txt").read_text().splitlines()
    assert tokens[:3] == ["<blk> 0", "<sos/eos> 1", "<unk> 2"] and len(tokens) == 100
    train = (lang / "transcript_words.txt").read_text().splitlines()
    assert len(train) == SIZES["tiny"].max_train_utts
    for text in train + list(_transcripts(tiny / "download" / "LibriSpeech" / "test-clean").values()):
        assert sp.decode(sp.encode(text)) == text


def test_training_batch_from_the_tiny_data(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tiny)
    parser = argparse.ArgumentParser()
    LibriSpeechAsrDataModule.add_arguments(parser, max_duration=100.0)
    args = parser.parse_args(
        ["--manifest-dir", str(tiny / "data" / "fbank"), "--max-duration", "20", "--num-workers", "1"]
    )
    dm = LibriSpeechAsrDataModule(args)
    sp = load_bpe_model(tiny / "data" / "lang_bpe_100" / "bpe.model")
    batch = next(iter(dm.train_dataloaders(filter_cuts(dm.train_cuts(), sp))))
    x, sup = batch["inputs"], batch["supervisions"]
    assert x.dim() == 3 and x.shape[2] == 80 and x.shape[0] == len(sup["text"]) >= 1
    assert {"text", "sequence_idx", "start_frame", "num_frames", "cut"} <= set(sup)
    n_test = sum(len(b["supervisions"]["text"]) for b in dm.test_dataloaders(dm.test_other_cuts()))
    assert n_test == SIZES["tiny"].eval_utts


def test_rerun_skips_finished_stages(tiny: Path) -> None:
    stamp = (tiny / "data" / "fbank" / "librispeech_cuts_dev-clean.jsonl.gz").stat().st_mtime_ns
    proc = run_prepare("--size", "tiny", "--work-dir", str(tiny))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "already holds the tiny corpus" in proc.stdout
    for n in (1, 2, 3, 4):
        assert f"Stage {n}:" in proc.stdout and "already done" in proc.stdout.split(f"Stage {n}:")[1].split("\n")[0]
    assert (tiny / "data" / "fbank" / "librispeech_cuts_dev-clean.jsonl.gz").stat().st_mtime_ns == stamp


def test_interrupted_stage_is_redone_without_trusting_leftovers(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tiny)
    fbank = tiny / "data" / "fbank"
    (fbank / ".librispeech.done").unlink()
    (fbank / "librispeech_cuts_test-other.jsonl.gz").unlink()  # killed while writing test-other:
    (fbank / ".tmp-librispeech_cuts_test-other.jsonl.gz").write_bytes(b"half a gzip")
    (fbank / "librispeech_feats_test-other" / "feats-0.lca").write_bytes(b"garbage")
    proc = run_prepare("--size", "tiny", "--work-dir", str(tiny), "--stage", "2", "--stop-stage", "2")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "dev-clean" in proc.stdout and "exists - skipping" in proc.stdout
    assert "test-other: wrote 8 cuts" in proc.stdout
    assert not (fbank / ".tmp-librispeech_cuts_test-other.jsonl.gz").exists()
    assert (fbank / ".librispeech.done").is_file()
    cuts = load_manifest(fbank / "librispeech_cuts_test-other.jsonl.gz")
    assert all(np.isfinite(c.load_features()).all() for c in cuts)


def test_too_large_vocab_fails_clearly(tiny: Path) -> None:
    proc = run_prepare("--size", "tiny", "--work-dir", str(tiny), "--stage", "4", "--vocab-size", "500")
    assert proc.returncode != 0
    assert "support at most" in proc.stdout and "--vocab-size 500" in proc.stdout
    assert not (tiny / "data" / "lang_bpe_500" / "bpe.model").exists()
    assert not (tiny / "data" / "lang_bpe_500" / ".done").exists()


def test_other_size_on_an_existing_corpus_is_refused(tiny: Path) -> None:
    proc = run_prepare("--work-dir", str(tiny), "--stop-stage", "0")
    assert proc.returncode != 0
    assert "was built with size=tiny seed=42, not size=default seed=42" in proc.stdout


def test_bad_options_are_refused() -> None:
    for args in (["--no-such-option", "1"], ["--corpus", "timit"], ["--stage"]):
        proc = run_prepare(*args)
        assert proc.returncode == 2 and "prepare.sh:" in proc.stdout


def _mirror(corpus: Path, parts: List[str], mirror: Path, resource: str = "12", names: Dict[str, str] = {}) -> None:
    """OpenSLR layout: <mirror>/<resource>/<name>.tar.gz holding LibriSpeech/<name>/... (12: LibriSpeech,
    31: mini LibriSpeech); part ``p`` of ``corpus`` is published as ``names.get(p, p)``."""
    (mirror / resource).mkdir(parents=True)
    for part in parts:
        name = names.get(part, part)
        with tarfile.open(mirror / resource / f"{name}.tar.gz", "w:gz") as tar:
            tar.add(
                corpus / part,
                arcname=f"LibriSpeech/{name}",
                filter=lambda t: None if t.name.endswith(".completed") else t,
            )


def test_librispeech_corpus_from_a_local_mirror(tiny: Path, tmp_path: Path) -> None:
    _mirror(tiny / "download" / "LibriSpeech", list(PARTS), tmp_path / "mirror")
    work = tmp_path / "real"
    proc = run_prepare(
        "--corpus",
        "librispeech",
        "--work-dir",
        str(work),
        "--stop-stage",
        "1",
        "--librispeech-url",
        (tmp_path / "mirror").as_uri(),
    )
    assert proc.returncode == 0, proc.stdout[-5000:]
    # Speed perturbation (stage 2) is on by default for real LibriSpeech; it is
    # exercised in test_data_manifests.py::test_fbank_manifests_with_speed_perturbation.
    assert "perturb_speed=true" in proc.stdout
    for part in PARTS:
        assert (work / "download" / f"{part}.tar.gz").is_file()
        assert (work / "download" / "LibriSpeech" / part / ".completed").is_file()
        sups = load_manifest(work / "data" / "manifests" / f"librispeech_supervisions_{part}.jsonl.gz")
        assert sorted(s.text for s in sups) == sorted(_transcripts(tiny / "download" / "LibriSpeech" / part).values())


def test_mini_librispeech_from_a_local_mirror(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare.sh --corpus mini_librispeech: OpenSLR 31's train-clean-5 and dev-clean-2 (here the tiny corpus's
    train-clean-100 and dev-clean under those names), every stage, then train.py's data with --mini-libri."""
    names = {TRAIN_PART: "train-clean-5", "dev-clean": "dev-clean-2"}
    _mirror(tiny / "download" / "LibriSpeech", list(names), tmp_path / "mirror", resource="31", names=names)
    work = tmp_path / "mini"
    proc = run_prepare(
        "--corpus",
        "mini_librispeech",
        "--work-dir",
        str(work),
        "--size",
        "tiny",  # of the synthetic noise corpus that stands in for MUSAN (--musan defaults to false here)
        "--vocab-size",
        "60",
        "--librispeech-url",
        (tmp_path / "mirror").as_uri(),
    )
    assert proc.returncode == 0, proc.stdout[-5000:]
    assert "perturb_speed=true musan=false parts: train-clean-5 dev-clean-2" in proc.stdout
    fbank = work / "data" / "fbank"
    assert sorted(p.name for p in fbank.glob("librispeech_cuts_*.jsonl.gz")) == [
        "librispeech_cuts_dev-clean-2.jsonl.gz",
        "librispeech_cuts_train-clean-5.jsonl.gz",
    ]
    assert (fbank / "noise_cuts.jsonl.gz").is_file() and not (work / "download" / "musan").exists()
    train_texts = sorted(_transcripts(tiny / "download" / "LibriSpeech" / TRAIN_PART).values())
    # speed perturbation: the training part three times (1.0, 0.9, 1.1), the dev part once
    train = load_manifest(fbank / "librispeech_cuts_train-clean-5.jsonl.gz")
    assert sorted(c.supervisions[0].text for c in train) == sorted(train_texts * 3)
    dev = load_manifest(fbank / "librispeech_cuts_dev-clean-2.jsonl.gz")
    assert sorted(c.supervisions[0].text for c in dev) == sorted(
        _transcripts(tiny / "download" / "LibriSpeech" / "dev-clean").values()
    )
    # the BPE model is trained on train-clean-5's transcripts
    lang = work / "data" / "lang_bpe_60"
    assert sorted((lang / "transcript_words.txt").read_text().splitlines()) == train_texts

    monkeypatch.chdir(work)
    parser = argparse.ArgumentParser()
    LibriSpeechAsrDataModule.add_arguments(parser, max_duration=100.0)
    args = parser.parse_args(["--manifest-dir", str(fbank), "--max-duration", "20", "--mini-libri", "true"])
    LibriSpeechAsrDataModule.check_args(parser, args)
    dm = LibriSpeechAsrDataModule(args)
    assert len(dm.train_cuts().to_eager()) == len(train) and len(dm.valid_cuts().to_eager()) == len(dev)
    sp = load_bpe_model(lang / "bpe.model")
    batch = next(iter(dm.train_dataloaders(filter_cuts(dm.train_cuts(), sp))))
    assert batch["inputs"].shape[2] == 80 and batch["inputs"].shape[0] == len(batch["supervisions"]["text"]) >= 1
    with pytest.raises(SystemExit):
        LibriSpeechAsrDataModule.check_args(parser, parser.parse_args(["--mini-libri", "true", "--full-libri", "true"]))


def _cuts_and_features(fbank: Path, part: str) -> Dict[str, tuple]:
    """{cut id: (duration, transcript, features)} of one part's cut manifest (run from the work dir)."""
    out = {}
    for cut in load_manifest(fbank / f"librispeech_cuts_{part}.jsonl.gz"):
        out[cut.id] = (cut.duration, cut.supervisions[0].text, cut.load_features())
    return out


def test_killed_fbank_stage_rerun_gives_the_uninterrupted_outputs(
    tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    shutil.copytree(tiny_data, work, symlinks=True)
    fbank = work / "data" / "fbank"
    (fbank / ".librispeech.done").unlink()
    for path in fbank.glob("librispeech_*"):
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    cmd = [
        "bash",
        str(RECIPE / "prepare.sh"),
        "--size",
        "tiny",
        "--work-dir",
        str(work),
        "--stage",
        "2",
        "--stop-stage",
        "2",
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    # Kill the whole stage (bash and its python) once the first part's manifest is out: half-way.
    deadline = time.time() + 300
    while not list(fbank.glob("librispeech_cuts_*.jsonl.gz")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "stage 2 finished before it could be killed"
    assert not (fbank / ".librispeech.done").exists()
    assert len(list(fbank.glob("librispeech_cuts_*.jsonl.gz"))) < len(PARTS)
    rerun = run_prepare(*cmd[2:])
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert not list(fbank.glob(".tmp-*")) and (fbank / ".librispeech.done").is_file()
    for part in PARTS:
        monkeypatch.chdir(tiny_data)
        want = _cuts_and_features(tiny_data / "data" / "fbank", part)
        monkeypatch.chdir(work)
        got = _cuts_and_features(fbank, part)
        assert got.keys() == want.keys(), part
        for cut_id, (duration, text, feats) in want.items():
            assert got[cut_id][:2] == (duration, text), cut_id
            np.testing.assert_array_equal(got[cut_id][2], feats, err_msg=cut_id)
