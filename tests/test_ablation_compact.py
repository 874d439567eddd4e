"""Compact run summaries (studies/ablation/compact.py): a full-form summary (the series inline, as every summary
was written before) and its compact pair read as the same run, value for value and bit for bit; the series
file's layout is the one its docstring describes (a file built here by hand reads back); the converter
rewrites a full-form summary once and leaves a compact one alone."""

import json
import lzma
import math
import struct
from pathlib import Path

import pytest

from studies.ablation.arm_names import ARM_ALIASES, canonical_arm
from studies.ablation.arms import STUDY, Thresholds, make_arms
from studies.ablation.compact import (
    compact_folder,
    compact_summary,
    read_run_summary,
    series_path,
    unpack_series,
)
from studies.ablation.cpus import computes_as, read_reproductions
from studies.ablation.family import FamilyComparison
from studies.ablation.records import RunKey, RunResult
from studies.ablation.runs import load_summaries, read_summary, stored_runs, write_summary

# A full-form summary as the study wrote them before the series moved out: 7-digit values, a nan and an inf
# written as strings, a batch digest above 2^23 (a float32 would round it), validation every 2 steps, a value
# that is not a float32's 7 digits (it must survive as it is), and a field this reader does not know.
OLD_STYLE = {
    "key": {"condition": "digits", "arm": "filter", "seed": 42},
    "wer": [["greedy_search", "test-clean", 0.9], ["greedy_search", "test-other", 7.59]],
    "wer_at": [[4, "greedy_search", "test-clean", 3.31], [4, "greedy_search", "test-other", 13.09]],
    "decoding": {"avg": 2, "use_averaged_model": True, "save_every_n": 2},
    "scalars": {
        "simple_loss": [[1, 9.388041], [2, 0.7905285], [3, "nan"], [4, 1.05074]],
        "grad_norm": [[1, 9388.04], [2, "inf"], [3, 587.9773], [4, 1e-07]],
        "valid_loss": [[2, 0.5], [4, 0.25]],
        "batch_digest": [[1, 14570774], [2, 3], [3, 16777215], [4, 0]],
        "clip_scale": [[1, 1.0], [2, 0.123456789012], [3, -0.0], [4, 1.0]],
    },
    "filters": [[0, "max_over_median", [[1, 1.05074], [2, 3.421232]]], [1, "fraction_filtered", []]],
    "wall_s": {"train": 992.8269076347351},
    "warm_end": 100,
    "machine": {"cpu_model": "AMD EPYC", "threads": "2"},
    "commands": ["python train.py --seed 42"],
    "cpu_s": {"train": 1.5},
    "note": "kept as it was",
}


def _bits(result: RunResult):
    """Every series as (name, step, the value's 8 bytes): nan equals nan, -0.0 differs from 0.0."""
    named = [(k, v) for k, v in result.scalars.items()] + [(k, v) for k, v in result.filters.items()]
    return [(k, s, struct.pack("<d", v)) for k, series in named for s, v in series] + [list(result.scalars)]


def test_an_old_style_summary_and_its_compact_pair_read_as_the_same_run(tmp_path):
    path = tmp_path / "digits" / "filter" / "seed-42.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(OLD_STYLE))
    old = read_run_summary(path)
    assert old.scalars["batch_digest"][0] == (1, 14570774.0) and math.isnan(old.scalars["simple_loss"][2][1])
    assert compact_summary(path) is True
    data = json.loads(path.read_text())
    assert "scalars" not in data and "filters" not in data and data["series"] == "seed-42.series.xz"
    assert data["note"] == "kept as it was" and list(data)[:4] == ["key", "wer", "wer_at", "decoding"]
    assert series_path(path).is_file()
    new = read_run_summary(path)
    assert _bits(new) == _bits(old)
    assert new.to_json_without_series() == old.to_json_without_series()
    assert list(new.filters) == [(0, "max_over_median"), (1, "fraction_filtered")]
    # How each series was stored: the digests as integers, the 7-digit values as float32, the one value a
    # float32 cannot give back in float64; the validation steps listed, the others from their first.
    layout = json.loads(lzma.decompress(series_path(path).read_bytes()).split(b"\n", 1)[0])["series"]
    stored = {entry.get("scalar", entry.get("stat")): (entry["dtype"], entry["first"]) for entry in layout}
    assert stored["batch_digest"] == ("i4", 1) and stored["simple_loss"] == ("f4", 1)
    assert stored["clip_scale"] == ("f8", 1) and stored["valid_loss"] == ("f4", None)
    # Converting again changes nothing; the reader of a round adds the CPU, as from the full form.
    before = path.read_bytes()
    assert compact_summary(path) is False and path.read_bytes() == before
    assert read_summary(tmp_path, RunKey("digits", "filter", 42)).scalars.keys() == old.scalars.keys()


def test_a_series_file_built_by_hand_reads_back():
    """The layout of the module's docstring, written here with struct: a header line, then per series its
    listed steps (if any) and its values, each array's bytes plane by plane."""

    def planes(fmt: str, values) -> bytes:
        items = [struct.pack("<" + fmt, v) for v in values]
        return bytes(item[i] for i in range(len(items[0])) for item in items)

    header = {
        "format": 1,
        "series": [
            {"scalar": "grad_norm", "n": 3, "dtype": "f4", "first": 5},
            {"scalar": "valid_loss", "n": 2, "dtype": "f8", "first": None},
            {"layer": 3, "stat": "max_over_median", "n": 2, "dtype": "i4", "first": 1},
        ],
    }
    body = planes("f", [0.1, 2.5, 1e30]) + planes("i", [10, 300]) + planes("d", [0.2, -1.0]) + planes("i", [7, -2])
    scalars, filters = unpack_series(lzma.compress(json.dumps(header).encode() + b"\n" + body))
    assert scalars == {"grad_norm": [(5, 0.1), (6, 2.5), (7, 1e30)], "valid_loss": [(10, 0.2), (300, -1.0)]}
    assert filters == {(3, "max_over_median"): [(1, 7.0), (2, -2.0)]}
    with pytest.raises(ValueError, match="bytes after its last series"):
        unpack_series(lzma.compress(json.dumps(header).encode() + b"\n" + body + b"\0"))


def test_written_summaries_are_compact_and_the_loader_reads_both_forms(tmp_path):
    run = RunResult.from_json(OLD_STYLE)
    write_summary(tmp_path, run)  # the compact pair
    old = tmp_path / "digits" / "none" / "seed-7.json"
    old.parent.mkdir(parents=True)
    old.write_text(json.dumps({**OLD_STYLE, "key": {"condition": "digits", "arm": "none", "seed": 7}}))
    replay = tmp_path / "digits" / "replays" / "seed-42-from-3.json"
    replay.parent.mkdir(parents=True)
    replay.write_text("{}")
    loaded = load_summaries(tmp_path)
    assert [r.key for r in loaded] == [RunKey("digits", "grad-filter-threshold", 42), RunKey("digits", "none", 7)]
    assert _bits(loaded[1]) == _bits(run), "the full form as it is"
    # Written now, the series are kept as the full form keeps them: OLD_STYLE's one value past 7 digits rounded.
    assert _bits(loaded[0]) == _bits(RunResult.from_json(run.to_json())) != _bits(run)
    written = tmp_path / "digits" / "grad-filter-threshold" / "seed-42.json"
    assert json.loads(written.read_text())["series"] == "seed-42.series.xz", "written under the arm's name now"
    assert [p.name for p in compact_folder(tmp_path)] == ["seed-7.json"], "the replay and the compact one untouched"
    assert replay.read_text() == "{}"


def test_summaries_and_cpu_records_of_the_old_arm_names_load_under_the_new_ones(tmp_path):
    """A round written before the arms took their flags' names: folders, keys and cpus.json of the old names
    (``filter``, ``guard``); the readers give the arms by their names now, through the one alias table."""
    for arm, seed in (("filter", 42), ("guard", 42), ("none", 42)):
        path = tmp_path / "digits" / arm / f"seed-{seed}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**OLD_STYLE, "key": {"condition": "digits", "arm": arm, "seed": seed}}))
    assert stored_runs(tmp_path, "digits") == [
        RunKey("digits", "clip-grad-norm-1000", 42),
        RunKey("digits", "grad-filter-threshold", 42),
        RunKey("digits", "none", 42),
    ]
    assert stored_runs(tmp_path, "digits", "grad-filter-threshold") == [RunKey("digits", "grad-filter-threshold", 42)]
    for asked in ("guard", "clip-grad-norm-1000"):  # the old name asked for finds it too
        assert read_summary(tmp_path, RunKey("digits", asked, 42)).key.arm == "clip-grad-norm-1000"
    assert read_summary(tmp_path, RunKey("digits", "clip-grad-norm", 42)) is None, "no run of plain clip here"
    # cpus.json's runs of old names: a reproduction joins the CPUs for the runs' arms by their names now.
    record = {"cpu": "B", "of": "A", "steps": 3, "runs": {"digits/filter/seed-42": None, "digits/guard/seed-42": None}}
    record.update(date="2026-11-27", commands=[], torch="2.13.0")
    (tmp_path / "cpus.json").write_text(json.dumps({"reproductions": [record]}))
    (reproduction,) = read_reproductions(tmp_path)
    assert set(reproduction.runs) == {"digits/grad-filter-threshold/seed-42", "digits/clip-grad-norm-1000/seed-42"}
    assert computes_as(tmp_path, "digits", "2.13.0") == {"A": "A", "B": "A"}
    # family.json keeps the names of its day; the configuration read from it has the arms' names now.
    assert canonical_arm("filter-clip") == "grad-filter-threshold+clip-grad-norm" and canonical_arm("none") == "none"
    assert STUDY.family[0] == FamilyComparison("grad-filter-threshold", "none")
    assert set(STUDY.seeds_per_arm) == {arm.name for arm in make_arms(Thresholds()) if arm.name in STUDY.seeds_per_arm}
    assert set(ARM_ALIASES.values()) <= {arm.name for arm in make_arms(Thresholds())}, "each new name is an arm's"
    assert not set(ARM_ALIASES) & {arm.name for arm in make_arms(Thresholds())}, "no old name is a new one"


def test_a_run_written_now_keeps_its_series_at_the_full_forms_7_digits(tmp_path):
    """TensorBoard's float32 values, as a finished run's folder gives them, are kept to 7 significant digits in
    either form: the run reads back as its full form would (a retraining is compared with it at those digits)."""
    raw = RunResult.from_json(OLD_STYLE)
    raw.scalars["simple_loss"] = [(1, 5.1940107345581055), (2, 0.30000001192092896)]
    raw.filters = {(0, "max_over_median"): [(1, 3.4212319850921631)]}
    write_summary(tmp_path, raw)
    back = read_summary(tmp_path, raw.key)
    assert back.scalars["simple_loss"] == [(1, 5.194011), (2, 0.3)]
    assert back.filters == {(0, "max_over_median"): [(1, 3.421232)]}
    assert _bits(back) == _bits(RunResult.from_json(raw.to_json()))


def test_the_committed_study_outputs_are_compact_and_within_15_mb():
    """Every committed run summary is the compact pair (its series file beside it), and the ablation's and the
    depth pilot's outputs (summaries and plots) stay within 15 MB, as issue 60 asks (70 MB of inline per-step
    JSON before)."""
    studies = Path(__file__).resolve().parents[1] / "studies"
    folders = [studies / "ablation" / "summaries", studies / "ablation" / "plots", studies / "depth" / "summaries"]
    summaries = [p for f in folders[::2] for p in f.rglob("seed-*.json") if p.stem[len("seed-") :].isdigit()]
    assert len(summaries) >= 161
    for path in summaries:
        assert json.loads(path.read_text())["series"] == series_path(path).name and series_path(path).is_file(), path
    assert sum(p.stat().st_size for f in folders for p in f.rglob("*") if p.is_file()) <= 15_000_000
