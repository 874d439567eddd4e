"""The depth pilot's report (studies/depth.py) on runs made by hand, every number worked out here; and
ablation.py's --base-lr, which the pilot uses to try a learning rate per depth."""

import json

import pytest
from test_markdown_tables import cell_count, tables

from studies.ablation.arms import CONDITIONS, RunKey
from studies.ablation.runs import RunResult
from studies.ablation.study import with_budget
from studies.depth import format_report, layer_outliers, load_runs, main


def _run(ratios, warm_end=2, seed=42):
    """Layer -> max/median per step (step 1 on)."""
    filters = {(layer, "max_over_median"): list(enumerate(xs, 1)) for layer, xs in ratios.items()}
    steps = len(next(iter(ratios.values())))
    scalars = {
        "grad_norm": [(s, 1.0) for s in range(1, steps + 1)],
        "simple_loss": [(s, 0.2) for s in range(1, steps + 1)],
        "pruned_loss": [(s, 0.1 if s >= 4 else 1.0) for s in range(1, steps + 1)],
    }
    wer_at = {
        3: {("greedy_search", "test-clean"): 40.0, ("greedy_search", "test-other"): 55.5},
        6: {("greedy_search", "test-clean"): 9.25, ("greedy_search", "test-other"): 20.0},
    }
    return RunResult(
        RunKey("digits", "none", seed),
        wer_at[6],
        scalars,
        filters,
        {"train": 90.0, "decode": 30.0},
        warm_end,
        {},
        wer_at,
    )


def test_layer_outliers_counts_from_the_warm_up_end_top_layer_first():
    # Step 1 (before warm-up ends at step 2) has the largest value of layer 0: it must not count.
    run = _run({0: [500.0, 2.0, 30.0, 3.0, 40.0, 1.0], 1: [1.0, 1.5, 2.5, 26.0, 2.0, 3.0]})
    top, bottom = layer_outliers(run, threshold=25)
    assert top.layer == 1 and bottom.layer == 0
    # layer 0 from step 2: 2, 30, 3, 40, 1 -> sorted 1, 2, 3, 30, 40; nearest-rank median = 3, 99th = 40
    assert (bottom.median, bottom.p99, bottom.largest, bottom.largest_step) == (3.0, 40.0, 40.0, 5)
    assert bottom.percent_over == pytest.approx(100 * 2 / 5) and bottom.first_over == 3
    # layer 1 from step 2: 1.5, 2.5, 26, 2, 3 -> median 2.5; one step over 25, at step 4
    assert (top.median, top.largest, top.largest_step, top.first_over) == (2.5, 26.0, 4, 4)
    assert top.percent_over == pytest.approx(20.0)
    quiet = layer_outliers(_run({0: [1.0, 2.0, 3.0]}), threshold=25)[0]
    assert quiet.first_over is None and quiet.percent_over == 0.0


def test_report_names_the_first_layer_over_and_the_largest_ratio():
    run = _run({0: [500.0, 2.0, 30.0, 3.0, 40.0, 1.0], 1: [1.0, 1.5, 2.5, 26.0, 2.0, 3.0]})
    shallow = [_run({0: [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]}, seed=s) for s in (7, 8)]
    text = format_report([("L2 d8", [run]), ("L1 d8", shallow)], threshold=25)
    # Layer 0 goes over first (step 3); its 40x at step 5 is the largest after warm-up; the loss
    # (0.5 x 0.2 + pruned) falls below 0.3 from step 4, so the 5-step trailing mean first does at step 8 -> never
    # in 6 steps ("-"); wall time (90 + 30) s = 2.0 min.
    assert "| L2 d8 | 42 | 6 | 3: 40.00 / 55.50; 6: 9.25 / 20.00 | - | 0 (3) | 40.0: 0 (5) | 2.0 |" in text
    # Two seeds of one model: a column each; its missing layer 1 is left blank.
    assert "| layer | L2 d8 | L1 d8 s7 | L1 d8 s8 |" in text
    assert "| 1 | 20.00 (4) |  |  |" in text and "| 0 | 40.00 (3) | 0.00 | 0.00 |" in text
    assert "| 1 | 26.0 (4) |  |  |" in text and "| 0 | 40.0 (5) | 6.0 (6) | 6.0 (6) |" in text
    assert "| L1 d8 s7 | 7 | 6 |" in text and "| never | 6.0: 0 (6) |" in text
    for _, rows in tables(text):
        assert len({cell_count(line) for _, line in rows}) == 1


def test_load_runs_reads_an_ablation_summaries_folder(tmp_path, capsys):
    run = _run({0: [1.0, 2.0, 30.0]})
    folder = tmp_path / "runs" / "digits" / "none"
    folder.mkdir(parents=True)
    (folder / "seed-42.json").write_text(json.dumps(run.to_json()))
    (tmp_path / "runs" / "ablation-config.json").write_text("{}")
    [loaded] = load_runs(tmp_path / "runs")
    assert loaded.filter_series(0, "max_over_median") == [(1, 1.0), (2, 2.0), (3, 30.0)]
    main([f"L1 d4={tmp_path / 'runs'}"])
    assert "| L1 d4 | 42 | 3 |" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="no run summaries"):
        load_runs(tmp_path / "empty")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "runs")])  # no LABEL=


def test_base_lr_replaces_the_conditions_learning_rate():
    digits = with_budget(CONDITIONS["digits"], None, None, None, 0.0015)
    assert digits.all_train_flags() == ["--model-warm-step", "50", "--base-lr", "0.0015"]
    assert with_budget(CONDITIONS["digits"], None, None, None, None).train_flags == ("--base-lr", "0.003")
    stress = with_budget(CONDITIONS["stress"], None, None, None, 0.005)
    assert stress.train_flags.count("--base-lr") == 1 and stress.train_flags[-2:] == ("--base-lr", "0.005")
