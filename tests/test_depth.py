"""The depth pilot's report (studies/depth) on runs made by hand, every number worked out here, and on the
pilot's committed summaries as its README.md shows them; the pilot script's argument check; and the ablation's
--base-lr, which the pilot uses to try a learning rate per depth."""

import json
import shlex
import subprocess
from pathlib import Path

import pytest
from test_markdown_tables import cell_count, tables

from conftest import REPO
from studies.ablation.arms import CONDITIONS, RunKey
from studies.ablation.metrics import layer_outliers
from studies.ablation.records import RunResult
from studies.ablation.settings import with_budget
from studies.depth.report import format_report, load_runs, main

DEPTH = REPO / "studies" / "depth"


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


def _blank(path) -> bool:
    import matplotlib.image
    import numpy as np

    pixels = matplotlib.image.imread(path)
    return len(np.unique((pixels * 255).astype(np.uint8))) <= 10


DEPTHS = ("digits", "digits-12")


def test_the_plots_of_steps_acting_and_of_outliers_by_depth(tmp_path):
    """write_plots adds the steps-acting plot once a landscape arm has runs, and the outliers-by-depth plot once
    the observing arm ran in two of the conditions that differ in depth alone; the numbers behind the first
    are each seed's % of steps acting."""
    from dataclasses import replace

    from studies.ablation.arms import Thresholds, make_arms
    from studies.ablation.plots import acting_by_arm, write_plots

    arms = {a.name: a for a in make_arms(Thresholds())}
    shallow = _run({0: [1, 30, 2, 2], 1: [1, 6, 1, 1]})
    deep = replace(_run({0: [1, 2, 2, 2], 1: [1, 3, 40, 1], 2: [1, 1, 1, 90]}), key=RunKey("digits-12", "none", 42))
    zclip = [
        replace(_run({0: [1, 1, 1, 1]}, seed=seed), key=RunKey("digits", "zclip-z-threshold", seed))
        for seed in (42, 43)
    ]
    zclip[0].scalars["clip_scale"] = [(1, 1.0), (2, 0.5), (3, 1.0), (4, 1.0)]  # 1 of 4 steps
    zclip[1].scalars["clip_scale"] = [(1, 0.9), (2, 0.5), (3, 1.0), (4, 1.0)]  # 2 of 4
    errors = replace(_run({0: [1, 1, 1, 1]}), key=RunKey("digits", "error-clip", 42))  # logged no statistic
    groups = {"none": [shallow], "zclip-z-threshold": zclip, "error-clip": [errors]}
    assert acting_by_arm(groups, arms) == {"zclip-z-threshold": [(42, 25.0), (43, 50.0)], "error-clip": []}

    plots = write_plots(
        [shallow, *zclip, errors], arms, tmp_path / "a", [25], landscape=["zclip-z-threshold", "agc-clipping"]
    )
    assert "digits steps-acting" in plots and "depth outliers" not in plots
    assert not _blank(plots["digits steps-acting"])
    assert "digits landscape-wer-per-seed" not in plots  # no landscape condition named
    plots = write_plots(
        [shallow, *zclip], arms, tmp_path / "e", [25], landscape=["zclip-z-threshold"], landscape_condition="digits"
    )
    assert not _blank(plots["digits landscape-wer-per-seed"]) and not _blank(plots["digits wer-per-seed"])
    assert "digits steps-acting" not in write_plots([shallow, *zclip], arms, tmp_path / "b", [25])

    stress = replace(shallow, key=RunKey("stress", "none", 42))  # another corpus and model: not a depth
    assert "depth outliers" not in write_plots([shallow, stress], arms, tmp_path / "d", [25], depths=["digits"])
    plots = write_plots(
        [shallow, deep, stress], arms, tmp_path / "c", [25], landscape=["zclip-z-threshold"], depths=DEPTHS
    )
    assert plots["depth outliers"].name == "ablation-depth-outliers.png" and not _blank(plots["depth outliers"])
    assert not any(kind.endswith("steps-acting") for kind in plots)


def test_the_landscape_rules_get_a_wer_figure_of_their_own_over_their_seeds():
    from dataclasses import replace

    from studies.ablation.plots import split_landscape

    def runs(arm, seeds):
        return [replace(_run({0: [1, 1, 1, 1]}, seed=seed), key=RunKey("digits", arm, seed)) for seed in seeds]

    groups = {"none": runs("none", range(42, 59)), "filter": runs("filter", range(42, 59))}
    groups["zclip"], groups["value"] = runs("zclip", (42, 43)), runs("value", (42,))
    others, versus = split_landscape(groups, ["value", "agc", "zclip"], "none", "filter")
    assert list(others) == ["none", "filter"] and [r.key.seed for r in others["none"]] == list(range(42, 59))
    # none first, the round's filter, then the rules that ran in the landscape's order; none and the filter
    # over the rules' seeds only.
    assert list(versus) == ["none", "filter", "value", "zclip"]
    assert [r.key.seed for r in versus["none"]] == [42, 43] and [r.key.seed for r in versus["filter"]] == [42, 43]
    assert split_landscape({"none": groups["none"]}, ["zclip"], "none", "filter") == ({"none": groups["none"]}, {})
    # No filter run: the figure has none and the rules.
    assert list(split_landscape({k: groups[k] for k in ("none", "zclip")}, ["zclip"], "none", "filter")[1]) == [
        "none",
        "zclip",
    ]


def test_a_seed_line_breaks_where_an_arm_has_no_run_of_that_seed():
    import math
    from dataclasses import replace

    from studies.ablation.plots import seed_line

    key = ("greedy_search", "test-other")

    def run(arm, seed, wer):
        return replace(_run({0: [1]}, seed=seed), key=RunKey("digits", arm, seed), wer={key: wer})

    groups = {"none": [run("none", 42, 7.5), run("none", 43, 7.3)], "agc": [run("agc", 42, 7.2)]}
    groups["value"] = [run("value", 42, 9.9), run("value", 43, 9.1)]
    assert seed_line(groups, 42, key) == [7.5, 7.2, 9.9]
    line = seed_line(groups, 43, key)
    assert line[0] == 7.3 and math.isnan(line[1]) and line[2] == 9.1
    assert all(math.isnan(x) for x in seed_line(groups, 43, ("greedy_search", "test-clean")))


def test_depth_report_draws_its_plot(tmp_path, capsys):
    for label, run in (
        ("L2", _run({0: [1, 30, 2, 2], 1: [1, 6, 1, 1]})),
        ("L3", _run({0: [1, 2], 1: [3, 1], 2: [1, 50]})),
    ):
        folder = tmp_path / label / "digits" / "none"
        folder.mkdir(parents=True)
        (folder / "seed-42.json").write_text(json.dumps(run.to_json()))
    png = tmp_path / "depth.png"
    main([f"L2={tmp_path / 'L2'}", f"L3={tmp_path / 'L3'}", "--plot", str(png)])
    assert "| L3 | 42 |" in capsys.readouterr().out
    assert png.is_file() and not _blank(png)


def test_the_ablation_names_each_seeds_first_outlier_layer_and_icefalls_beside_the_deep_condition():
    from studies.ablation.report.common import icefall_published
    from studies.ablation.report.tables import first_outliers

    # Seed 43 given first: the rows go by seed. Seed 42: from step 2 (warm-up), layer 0 goes over 25 at step
    # 3, layer 1 at step 4: layer 0 first; the largest, 40 at layer 0, step 5; the objective 0.5 x 0.2 + pruned
    # falls below 0.3 from step 4 and the 5-step trailing mean first does at step 8: never in 6 steps.
    # Seed 43: layers 0 and 1 both over at step 2: the lower, 0; the largest, 90 at layer 1, step 6.
    runs = [
        _run({0: [1.0, 30.0, 2.0, 2.0, 2.0, 2.0], 1: [1.0, 26.0, 2.0, 2.0, 2.0, 90.0]}, seed=43),
        _run({0: [500.0, 2.0, 30.0, 3.0, 40.0, 1.0], 1: [1.0, 1.5, 2.5, 26.0, 2.0, 3.0]}),
    ]
    lines = first_outliers(runs, beside_icefall=False)
    text = "\n".join(lines)
    assert "| 42 | - | 0 (3) | 40.0: 0 (5) |\n| 43 | - | 0 (2) | 90.0: 1 (6) |" in text
    assert "icefall" not in text and len(list(tables(text))) == 1
    quiet = "\n".join(first_outliers([_run({0: [1.0, 2.0, 3.0]}, seed=7)], beside_icefall=False))
    assert "| 7 | - | never | 3.0: 0 (3) |" in quiet
    beside = "\n".join(first_outliers(runs, beside_icefall=True))
    explosion = icefall_published()["explosion"]
    assert "layer 10" in explosion["text"] and "pull/558" in explosion["source"]
    assert f"not measured here: {explosion['text']}. Source: {explosion['source']}." in beside


def _readme_command() -> list:
    """The arguments of the ``python -m studies.depth`` command in the depth README's code block."""
    readme = (DEPTH / "README.md").read_text(encoding="utf-8")
    block = readme.split("python -m studies.depth ", 1)[1].split("\n```", 1)[0]
    return shlex.split(block.replace("\\\n", " "))


def test_the_readme_tables_re_render_from_the_committed_summaries(tmp_path, capsys, monkeypatch):
    """The README's command, run from the repository root (its plot redirected), prints the README's three
    tables character for character, from the pilot's committed summaries."""
    argv = _readme_command()
    plot = argv.index("--plot")
    assert argv[plot + 1] == "studies/depth/depth-outliers.png" and (DEPTH / "depth-outliers.png").is_file()
    argv[plot + 1] = str(tmp_path / "depth-outliers.png")
    assert [a.split("=", 1)[0] for a in argv if "=" in a] == [
        "L4 d256",
        "L8 d256",
        "L12 d256",
        "L12 d256 lr 0.0015",
        "L12 d128",
    ]
    monkeypatch.chdir(REPO)
    main(argv)
    tables_text = capsys.readouterr().out
    assert tables_text.count("\n| layer |") == 2 and "| L12 d256 | 42 | 1200 |" in tables_text
    assert tables_text in (DEPTH / "README.md").read_text(encoding="utf-8")
    assert not _blank(tmp_path / "depth-outliers.png")


def test_the_pilot_script_refuses_a_model_without_a_label(tmp_path: Path) -> None:
    """pilot.sh checks its arguments before it starts a run: too few, and a model without LABEL=."""
    script = DEPTH / "pilot.sh"
    out = subprocess.run(["bash", str(script), str(tmp_path / "out")], capture_output=True, text=True)
    assert out.returncode == 2 and "usage:" in out.stderr
    out = subprocess.run(
        ["bash", str(script), str(tmp_path / "out"), "--num-encoder-layers 8"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "write LABEL=MODEL_FLAGS" in out.stderr
    assert not (tmp_path / "out" / "exp").exists()
