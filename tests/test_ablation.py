"""The ablation on the tiny corpus: lstm_transducer_stateless/ablation.py end to end (RESULTS.md table
checked against the decode outputs, checkpoints, training logs and raw TensorBoard events it came from;
PNG plots; a rerun that skips finished arms and resumes a cut-off one), and the corrupted training set
of local/make_corrupted_cuts.py (deterministic, exact fraction, which cuts, what changes)."""

import gzip
import importlib.util
import json
import re
import shlex
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import matplotlib.image
import numpy as np
import pytest
import sentencepiece as spm
import torch
from lhotse import load_manifest
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

from conftest import RECIPE, recipe_env
from icefall_lite.train.checkpoint import load_checkpoint_file
from icefall_lite.data.corrupt import CorruptionConfig, CorruptionError, make_corrupted_dir
from icefall_lite.data.datamodule import encoder_frames
from test_train import TINY_MODEL

from train import TB_TAGS, TRAIN_DURATION_RANGE  # noqa: E402  (the recipe's train.py owns these)

ABLATION = RECIPE / "lstm_transducer_stateless" / "ablation.py"
CORRUPT = RECIPE / "local" / "make_corrupted_cuts.py"
TRAIN_MANIFEST = "librispeech_cuts_train-clean-100.jsonl.gz"
BPE = "data/lang_bpe_100/bpe.model"
ARM_ROWS = [  # (training set, arm dir, label, filter on, clip on), in table order
    (t, d, label, f, c)
    for t in ("clean", "corrupted")
    for d, label, f, c in (
        ("a-none", "(a) no filter, no clipping", False, False),
        ("b-clip", "(b) clip_grad_norm only", False, True),
        ("c-filter", "(c) GradientFilter only", True, False),
        ("d-filter-clip", "(d) filter + clipping", True, True),
    )
]
CUT_OFF_ARM = ("corrupted", "c-filter")
FRACTION = 0.1  # 4 of the tiny corpus's 40 training cuts


# --------------------------------------------------------------------------
# Independent readers of the files the table is made from
# --------------------------------------------------------------------------


def read_cuts(path: Path) -> Dict[str, dict]:
    """{cut id: cut dict} of a gzipped JSONL manifest, read without lhotse."""
    with gzip.open(path, "rt") as f:
        return {c["id"]: c for c in map(json.loads, f)}


def raw_scalars(tb_dir: Path, tag: str) -> Dict[int, float]:
    """{step: value} of ``tag`` from the raw event files, oldest first; a newer file (a resumed run)
    replaces the points from its own first point of ``tag`` on."""
    out: Dict[int, float] = {}
    for path in sorted(tb_dir.glob("events.out.tfevents.*"), key=lambda p: int(p.name.split(".")[3])):
        points = [(e.step, v.simple_value) for e in LegacyEventFileLoader(str(path)).Load()
                  for v in e.summary.value if v.tag == tag]
        if points:
            out = {step: value for step, value in out.items() if step < points[0][0]}
            out.update(points)
    return out


def parse_table(results_md: Path) -> Tuple[List[str], List[List[str]]]:
    """Header and rows of the markdown table in RESULTS.md's ablation section."""
    text = results_md.read_text()
    section = text.split("<!-- ablation:begin", 1)[1].split("<!-- ablation:end -->", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert set("".join(cells[1])) <= {"-"}, cells[1]
    return cells[0], cells[2:]


def wer_from_summary(res_dir: Path, test_set: str) -> str:
    """The WER cell of the one wer-summary file of ``test_set`` in ``res_dir``."""
    (path,) = res_dir.glob(f"wer-summary-{test_set}-*.txt")
    header, row = path.read_text().splitlines()
    assert header == "settings\tWER"
    return "%.2f" % float(row.split("\t")[1])


def train_log(arm_dir: Path) -> str:
    return "\n".join(p.read_text() for p in sorted((arm_dir / "log").glob("log-train-*")))


def png_size(path: Path) -> Tuple[int, int]:
    """(width, height) from the PNG signature and IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    assert data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


# --------------------------------------------------------------------------
# The tiny ablation, run twice
# --------------------------------------------------------------------------


def ablation_args(work: Path, out: Path, *extra: str) -> List[str]:
    return [
        sys.executable, str(ABLATION), "--work-dir", str(work), "--exp-root", str(out / "exp"),
        "--results-dir", str(out / "results"), "--epochs", "1", "--max-duration", "30",
        "--decoding-methods", "greedy_search", "--save-every-n", "3", "--corrupt-fraction", str(FRACTION),
        "--model-args", shlex.join(TINY_MODEL), *extra,
    ]


def run_ablation(args: List[str]) -> subprocess.CompletedProcess:
    # One thread per process: the tiny model gains nothing from two, and the runs are much faster.
    env = {**recipe_env(), "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)


def file_state(root: Path) -> Dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def ablation(tiny_data, tmp_path_factory):
    """First run; then one arm is cut off (as if killed after its checkpoint at batch 6) and the script rerun."""
    out = tmp_path_factory.mktemp("ablation")
    start = time.time()
    first = run_ablation(ablation_args(tiny_data, out))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    first_md = (out / "results" / "RESULTS.md").read_text()
    cut_off = out / "exp" / CUT_OFF_ARM[0] / CUT_OFF_ARM[1]
    finished_model = load_checkpoint_file(cut_off / "epoch-1.pt")["model"]
    assert (cut_off / "checkpoint-6.pt").is_file()
    for name in ("epoch-1.pt", "best-train-loss.pt", "best-valid-loss.pt", "ablation-done.json"):
        (cut_off / name).unlink()
    shutil.rmtree(cut_off / "greedy_search")
    before = file_state(out / "exp")
    second = run_ablation(ablation_args(tiny_data, out))
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    return {"out": out, "first": first, "second": second, "first_md": first_md, "before": before,
            "finished_model": finished_model, "elapsed": time.time() - start}


def test_table_rows_match_their_sources(ablation, tiny_data):
    out = ablation["out"]
    header, rows = parse_table(out / "results" / "RESULTS.md")
    assert header == ["training set", "arm", "greedy_search test-clean", "greedy_search test-other",
                      "final train loss", "valid loss", "skipped steps", "steps", "wall time (min)"]
    assert [(r[0], r[1]) for r in rows] == [(t, label) for t, _, label, _, _ in ARM_ROWS]
    steps = set()
    for row, (training_set, dirname, _, _, _) in zip(rows, ARM_ROWS):
        arm_dir = out / "exp" / training_set / dirname
        cell = dict(zip(header, row))
        assert cell["greedy_search test-clean"] == wer_from_summary(arm_dir / "greedy_search", "test-clean")
        assert cell["greedy_search test-other"] == wer_from_summary(arm_dir / "greedy_search", "test-other")
        checkpoint = load_checkpoint_file(arm_dir / "epoch-1.pt")
        assert int(cell["steps"]) == checkpoint["batch_idx_train"]
        steps.add(checkpoint["batch_idx_train"])
        log = train_log(arm_dir)
        assert int(cell["skipped steps"]) == int(re.findall(r"Done\. Training took .* skipped steps: (\d+)", log)[-1])
        valid = float(re.findall(r"Epoch 1 done in .* validation: loss=([0-9.]+)", log)[-1])
        assert float(cell["valid loss"]) == pytest.approx(valid, rel=1e-3)
        # Final train loss: mean per-frame loss over the steps of the (only) epoch, from the raw events.
        losses = raw_scalars(arm_dir / "tensorboard", "train/loss")
        assert sorted(losses) == list(range(1, checkpoint["batch_idx_train"] + 1))
        assert cell["final train loss"] == "%.4f" % np.mean(list(losses.values()))
        wall = json.loads((arm_dir / "ablation-wall.json").read_text())
        assert 0 < float(cell["wall time (min)"]) * 60 <= ablation["elapsed"] + 3
        assert cell["wall time (min)"] == "%.1f" % (sum(wall.values()) / 60)
    assert len(steps) == 1 and steps.pop() >= 6, "every arm takes the same steps"


def test_arms_train_what_they_say(ablation):
    out = ablation["out"]
    for training_set, dirname, _, filter_on, clip_on in ARM_ROWS:
        log = train_log(out / "exp" / training_set / dirname)
        assert re.search(rf"^\s+grad_filter_threshold: {25.0 if filter_on else 0.0}$", log, re.M), dirname
        assert re.search(rf"^\s+clip_grad_norm: {5.0 if clip_on else 0.0}$", log, re.M), dirname
        manifest_dir = re.search(r"^\s+manifest_dir: (.*)$", log, re.M).group(1)
        expected = out / "exp" / "manifests-corrupted" if training_set == "corrupted" else Path("data/fbank")
        assert Path(manifest_dir) == expected
        filter_stats = raw_scalars(out / "exp" / training_set / dirname / "tensorboard", "grad_filter/layer0/fraction_filtered")
        assert bool(filter_stats) == filter_on, dirname


def test_results_md_commands_and_plots(ablation, tiny_data):
    results = ablation["out"] / "results"
    text = (results / "RESULTS.md").read_text()
    assert re.search(r"Date: \d{4}-\d{2}-\d{2}\.", text)
    assert "./lstm_transducer_stateless/ablation.py --work-dir" in text
    assert "--corrupt-fraction 0.1" in text
    assert "4 of 40 training cuts" in text
    images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", text)
    assert {"ablation-grad-norm.png", "ablation-filter-fraction.png", "ablation-valid-loss.png"} <= set(images)
    for name in images:
        width, height = png_size(results / name)
        assert width >= 400 and height >= 300, name
        pixels = matplotlib.image.imread(results / name)
        assert pixels.shape[:2] == (height, width)
        assert len(np.unique((pixels * 255).astype(np.uint8))) > 10, f"{name} looks blank"


def test_rerun_skips_finished_arms_and_resumes_the_cut_off_one(ablation):
    out, first, second = ablation["out"], ablation["first"], ablation["second"]
    assert first.stderr.count(": starting") == 8
    assert second.stderr.count("done earlier - skipped") == 7
    assert second.stderr.count(": starting") == 1
    assert f"{CUT_OFF_ARM[0]} (c) GradientFilter only: starting" in second.stderr
    after = file_state(out / "exp")
    cut_off = str(Path(*CUT_OFF_ARM))
    for path, mtime in ablation["before"].items():
        if not path.startswith(cut_off):
            assert after.get(path) == mtime, f"{path} changed in the rerun"
    new_files = set(after) - set(ablation["before"])
    assert new_files and all(p.startswith(cut_off) or p.startswith("log-ablation") for p in new_files), new_files
    arm_dir = out / "exp" / CUT_OFF_ARM[0] / CUT_OFF_ARM[1]
    log = train_log(arm_dir)
    assert re.search(r"Loading checkpoint \S*checkpoint-6\.pt", log)
    resumed = load_checkpoint_file(arm_dir / "epoch-1.pt")["model"]
    for name, value in ablation["finished_model"].items():
        assert torch.equal(value, resumed[name]), f"resumed arm differs from the uninterrupted one in {name}"
    # Same table, but for the wall time of the resumed arm (its second run adds to it).
    header, rows = parse_table(out / "results" / "RESULTS.md")
    first_md = out / "first-RESULTS.md"
    first_md.write_text(ablation["first_md"])
    _, first_rows = parse_table(first_md)
    wall = header.index("wall time (min)")
    assert [r[:wall] for r in rows] == [r[:wall] for r in first_rows]


def _load_ablation_script():
    spec = importlib.util.spec_from_file_location("icefall_lite_ablation_script", ABLATION)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_rerun_with_other_settings_is_refused(ablation, tiny_data, isolated_logging, capsys):
    out = ablation["out"]
    args = ablation_args(tiny_data, out)[2:]
    args[args.index("--epochs") + 1] = "2"
    assert _load_ablation_script().main(args) == 1
    err = capsys.readouterr().err
    assert "was made with other settings (epochs: was 1, now 2)" in err
    assert "use another --exp-root" in err
    assert not (out / "exp" / "clean" / "a-none" / "epoch-2.pt").exists()


# --------------------------------------------------------------------------
# The corrupted training set
# --------------------------------------------------------------------------


def test_corrupted_set_is_deterministic_with_the_exact_fraction(tiny_data, tmp_path):
    cli = subprocess.run(
        [sys.executable, str(CORRUPT), "--src-dir", "data/fbank", "--out-dir", str(tmp_path / "cli"),
         "--bpe-model", BPE, "--fraction", str(FRACTION), "--seed", "7"],
        cwd=tiny_data, capture_output=True, text=True, env=recipe_env(),
    )
    assert cli.returncode == 0, cli.stderr
    sp = spm.SentencePieceProcessor()
    sp.load(str(tiny_data / BPE))
    make_corrupted_dir(tiny_data / "data" / "fbank", tmp_path / "lib", CorruptionConfig(fraction=FRACTION, seed=7), sp, TRAIN_DURATION_RANGE)
    make_corrupted_dir(tiny_data / "data" / "fbank", tmp_path / "seed8", CorruptionConfig(fraction=FRACTION, seed=8), sp, TRAIN_DURATION_RANGE)

    source = read_cuts(tiny_data / "data" / "fbank" / TRAIN_MANIFEST)
    corrupted = read_cuts(tmp_path / "cli" / TRAIN_MANIFEST)
    assert list(corrupted) == list(source), "same cuts in the same order"
    changed = sorted(i for i in source if source[i] != corrupted[i])
    assert len(changed) == round(FRACTION * len(source)) == 4
    assert (tmp_path / "cli" / "corrupted_cut_ids.txt").read_text().split() == changed
    # Deterministic: the same seed gives the same set (script and library); another seed other cuts.
    assert read_cuts(tmp_path / "lib" / TRAIN_MANIFEST) == corrupted
    assert (tmp_path / "seed8" / "corrupted_cut_ids.txt").read_text().split() != changed
    for cut_id in changed:
        old, new = source[cut_id], corrupted[cut_id]
        assert 1.0 <= old["duration"] <= 20.0, "only cuts that train.py trains on"
        assert {k: v for k, v in new.items() if k != "supervisions"} == {k: v for k, v in old.items() if k != "supervisions"}
        old_text, new_text = old["supervisions"][0]["text"], new["supervisions"][0]["text"]
        assert new_text != old_text
        frames = encoder_frames(old["features"]["num_frames"])
        # Denser than the real transcript, yet short enough for the transducer (tokens <= frames).
        assert len(sp.encode(old_text)) < len(sp.encode(new_text)) <= frames
    # The other manifests are the clean ones.
    for name in ("librispeech_cuts_dev-clean.jsonl.gz", "librispeech_cuts_test-other.jsonl.gz", "noise_cuts.jsonl.gz"):
        assert read_cuts(tmp_path / "cli" / name) == read_cuts(tiny_data / "data" / "fbank" / name)
    # At least one cut for a small fraction.
    few = make_corrupted_dir(tiny_data / "data" / "fbank", tmp_path / "few", CorruptionConfig(fraction=0.001), sp, TRAIN_DURATION_RANGE)
    assert few["num_corrupted"] == 1


def test_corrupted_set_rerun_and_other_settings(tiny_data, tmp_path):
    sp = spm.SentencePieceProcessor()
    sp.load(str(tiny_data / BPE))
    src = tiny_data / "data" / "fbank"
    make_corrupted_dir(src, tmp_path / "c", CorruptionConfig(fraction=FRACTION), sp, TRAIN_DURATION_RANGE)
    mtime = (tmp_path / "c" / TRAIN_MANIFEST).stat().st_mtime_ns
    make_corrupted_dir(src, tmp_path / "c", CorruptionConfig(fraction=FRACTION), sp, TRAIN_DURATION_RANGE)
    assert (tmp_path / "c" / TRAIN_MANIFEST).stat().st_mtime_ns == mtime
    with pytest.raises(CorruptionError, match=r"made with other settings.*remove it or choose another output"):
        make_corrupted_dir(src, tmp_path / "c", CorruptionConfig(fraction=0.2), sp, TRAIN_DURATION_RANGE)
    with pytest.raises(CorruptionError, match=r"fraction of corrupted cuts must be in \(0, 1\]"):
        make_corrupted_dir(src, tmp_path / "d", CorruptionConfig(fraction=0.0), sp, TRAIN_DURATION_RANGE)
    cli = subprocess.run(
        [sys.executable, str(CORRUPT), "--out-dir", str(tmp_path / "e"), "--bpe-model", "missing.model"],
        cwd=tiny_data, capture_output=True, text=True, env=recipe_env(),
    )
    assert cli.returncode == 1 and "--bpe-model missing.model does not exist" in cli.stderr


def test_scale_features_multiplies_only_the_chosen_cuts(tiny_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tiny_data)  # feature paths in the manifests are relative to the work dir
    sp = spm.SentencePieceProcessor()
    sp.load(BPE)
    out = tmp_path / "scaled"
    make_corrupted_dir(Path("data/fbank"), out, CorruptionConfig(method="scale-features", fraction=FRACTION, scale=3.0), sp, TRAIN_DURATION_RANGE)
    chosen = set((out / "corrupted_cut_ids.txt").read_text().split())
    source = {c.id: c for c in load_manifest(Path("data/fbank") / TRAIN_MANIFEST)}
    scaled = {c.id: c for c in load_manifest(out / TRAIN_MANIFEST)}
    assert len(chosen) == 4 and chosen <= set(source)
    for cut_id, cut in scaled.items():
        original = source[cut_id].load_features()
        if cut_id in chosen:
            np.testing.assert_array_equal(cut.load_features(), original * np.float32(3.0))
            assert cut.supervisions[0].text == source[cut_id].supervisions[0].text
        else:
            assert cut.to_dict() == source[cut_id].to_dict()


def test_train_py_tensorboard_tags_round_trip_the_filter_statistics():
    """The reports read train.py's tags through its TB_TAGS table, filter tags included."""
    assert TB_TAGS.loss == "train/loss" and TB_TAGS.simple_loss == "train/simple_loss"
    tag = TB_TAGS.filter_tag(12, "max_over_median")
    assert tag == "grad_filter/layer12/max_over_median"
    assert TB_TAGS.parse_filter_tag(tag) == (12, "max_over_median")
    assert TB_TAGS.parse_filter_tag("grad_filter/layerx/fraction_filtered") is None
    assert TB_TAGS.parse_filter_tag(TB_TAGS.grad_norm) is None
