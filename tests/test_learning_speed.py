"""The learning-speed study (studies/learning_speed): result bookkeeping, its README's generated section, and
the study end to end on the tiny corpus."""

import json

import pytest

from studies.learning_speed.report import README, SECTION, compare_to_baseline, format_table, seed_spread
from studies.learning_speed.run import DONE_FILE, StudyResult, first_step_below
from studies.learning_speed.study import main
from studies.runner import Section


def _result(name, clean, other, steps=100):
    return StudyResult(
        name=name,
        change=f"change of {name}",
        steps=steps,
        train_seconds=300.0,
        wall_seconds=345.0,
        train_loss=0.5,
        valid_loss=0.4,
        num_parameters=5_482_756,
        wers={"test-clean": clean, "test-other": other},
        simple_below_target_step=40,
    )


def test_seed_spread_and_comparison_with_the_baseline():
    base = [_result("baseline", 60.0, 80.0), _result("baseline-seed2", 62.0, 79.0)]
    arms = [_result("big-win", 40.0, 70.0), _result("noise", 60.5, 78.0), _result("half", 50.0, 79.9)]
    assert seed_spread(base, "test-clean") == 2.0
    assert seed_spread(base, "test-other") == 1.0
    assert seed_spread(base[:1], "test-clean") is None
    rows = {name: (dc, do, real) for name, dc, do, real in compare_to_baseline(base + arms, base)}
    assert set(rows) == {"big-win", "noise", "half"}
    assert rows["big-win"] == (pytest.approx(-21.0), pytest.approx(-9.5), True)
    # Within the spread on test-clean (0.5 < 2.0): not real.
    assert rows["noise"][2] is False
    # Beyond on test-clean (-11), within on test-other (+0.4 < 1.0): not real either.
    assert rows["half"][0] == pytest.approx(-11.0) and rows["half"][2] is False


def test_format_table_has_one_row_per_arm_in_order():
    table = format_table([_result("b", 61.234, 80.0, steps=321), _result("a", 50.0, 70.0)])
    lines = table.splitlines()
    assert len(lines) == 4
    assert lines[2].startswith("| b | change of b | 5.48 M | 321 | 5.0 | 5.8 | 40 | 0.5000 | 0.4000 | 61.23 | 80.00 |")
    assert lines[3].startswith("| a |")


def test_a_section_is_appended_then_replaced_and_read_back(tmp_path):
    md = tmp_path / "RESULTS.md"
    md.write_text("# Results\n\nkept text\n")
    study, other = Section("study", "me.py"), Section("other", "you.py")
    assert study.read(md) is None
    study.write(md, "first version")
    other.write(md, "another section")
    study.write(md, "second version\n\nwith a table\n")
    text = md.read_text()
    assert "first version" not in text
    assert text.count("second version") == 1 and "another section" in text and "kept text" in text
    assert text.index("second version") < text.index("another section")
    assert "<!-- study:begin (written by me.py) -->\nsecond version\n\nwith a table\n<!-- study:end -->" in text
    assert study.read(md) == "second version\n\nwith a table\n" and other.read(md) == "another section\n"


def _committed_rows(table: str) -> list:
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]


def test_readme_learning_speed_tables_follow_from_their_arms():
    """The generated section of the study's README.md: its arms' results were not committed (they stayed in
    the runs' folders), so the figures derived from them are checked instead: the per-arm table, read back
    into results, renders as committed, and the seed spread and every arm against the baseline mean come
    out as committed."""
    held = SECTION.read(README)
    assert held is not None, "studies/learning_speed/README.md has no generated learning-speed section"
    table = held.split("\n\n| arm | change from the defaults |", 1)[1].split("\n\n", 1)[0]
    table = "| arm | change from the defaults |" + table
    results = [
        StudyResult(
            name=name,
            change=change,
            steps=int(steps),
            train_seconds=60 * float(train_min),
            wall_seconds=60 * float(wall_min),
            train_loss=float(train_loss),
            valid_loss=float(valid_loss),
            num_parameters=round(float(params.removesuffix(" M")) * 1e6),
            wers={"test-clean": float(clean), "test-other": float(other)},
            simple_below_target_step=None if landmark == "never" else int(landmark),
        )
        for name, change, params, steps, train_min, wall_min, landmark, train_loss, valid_loss, clean, other in (
            _committed_rows(table)
        )
    ]
    assert len(results) == 17
    assert format_table(results) == table
    base = [r for r in results if r.name.startswith("baseline")]
    spread = held.split("Seed spread of the baseline", 1)[1].split("\n", 1)[0]
    assert spread == (
        f" ({len(base)} seeds): {seed_spread(base, 'test-clean'):.2f} WER points on test-clean, "
        f"{seed_spread(base, 'test-other'):.2f} on test-other. An arm's difference from the baseline mean counts "
        "as real below only when it exceeds that spread on both test sets."
    )
    committed = _committed_rows(held.split("| arm | test-clean vs baseline mean |", 1)[1].split("\n\n", 1)[0])
    rows = [
        [name, f"{d_clean:+.2f}", f"{d_other:+.2f}", "yes" if real else "no"]
        for name, d_clean, d_other, real in compare_to_baseline(results, base)
    ]
    assert rows == committed and len(rows) == 15


def test_first_step_below_uses_the_moving_average():
    series = [(1, 0.9), (2, 0.3), (3, 0.6), (4, 0.4), (5, 0.35)]
    # Window 2 averages: step 2 0.6, step 3 0.45 (the first below 0.5).
    assert first_step_below(series, 0.5, 2) == 3
    assert first_step_below(series, 0.5, 1) == 2
    assert first_step_below(series, 0.1, 2) is None


def test_study_runs_arms_resumes_and_writes_the_section(tiny_data, tmp_path, isolated_logging):
    results_md = tmp_path / "RESULTS.md"
    exp_root = tmp_path / "exp"
    argv = [
        "--work-dir",
        str(tiny_data),
        "--exp-root",
        str(exp_root),
        "--results-md",
        str(results_md),
        "--base-vocab-size",
        "120",
        "--minutes",
        "0.002",
    ]
    # An arm cut off before (no done file) is started again from scratch.
    (exp_root / "baseline").mkdir(parents=True)
    (exp_root / "baseline" / "checkpoint-7.pt").write_bytes(b"left over")
    assert main(argv + ["--arms", "baseline", "bpe100"]) == 0
    for name in ("baseline", "bpe100"):
        done = json.loads((exp_root / name / DONE_FILE).read_text())
        assert done["steps"] >= 1 and set(done["wers"]) == {"test-clean", "test-other"}
        assert not (exp_root / name / "checkpoint-7.pt").exists()
    assert (exp_root / "lang_bpe_100" / "bpe.model").is_file() and (exp_root / "lang_bpe_120" / "bpe.model").is_file()
    text = results_md.read_text()
    assert "## Learning speed" in text and "| baseline | none (seed 42) |" in text and "| bpe100 |" in text
    written_by = "## Learning speed\n\nWritten by `python -m studies.learning_speed` on "
    assert SECTION.read(results_md).startswith(written_by)
    assert "--bpe-model " + str(exp_root / "lang_bpe_100" / "bpe.model") in text
    # A rerun skips finished arms (their done files are left as they were).
    before = (exp_root / "baseline" / DONE_FILE).stat().st_mtime_ns
    assert main(argv + ["--arms", "baseline"]) == 0
    assert (exp_root / "baseline" / DONE_FILE).stat().st_mtime_ns == before
    with pytest.raises(SystemExit):
        main(argv + ["--arms", "no-such-arm"])
