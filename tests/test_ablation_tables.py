"""Every Markdown table the ablation's report writes has rows exactly as wide as its header: the section
rendered from round 1's committed summaries, and from a made-up round with every part the report has (runs
decoded at three points on two CPU models, the pilot, replays with all five branches); the table writer
refuses a row of another width."""

import math
import os

import pytest
from test_markdown_tables import cell_count, tables

from studies.ablation import cli
from studies.ablation.arms import STUDY, RunKey, Thresholds, make_arms
from studies.ablation.cli import STUDY_DIR
from studies.ablation.markdown import markdown_table
from studies.ablation.replay.events import (
    EVENT_ONLY,
    FILTER,
    MATCHED,
    MATCHED_REFERENCE,
    NO_CONTROL,
    UNIFORM,
    Event,
    Matched,
    ReplayKey,
)
from studies.ablation.replay.result import Branch, ReplayResult, parameter_layout
from studies.ablation.report.common import ReportSetup
from studies.ablation.report.render import render_report
from studies.ablation.report.write import gather_report, render
from studies.ablation.runs import RunResult, round_summaries

KEYS = [("greedy_search", "test-clean"), ("greedy_search", "test-other")]


def assert_tables_well_formed(text: str) -> int:
    """Every table of ``text``: rows as wide as the header, and a header whose cells are not empty; returns
    how many tables there are."""
    count = 0
    for header_line, rows in tables(text):
        width = cell_count(rows[0][1])
        bad = [(n, cell_count(row)) for n, row in rows[1:] if cell_count(row) != width]
        assert not bad, f"table at line {header_line} ({rows[0][1][:80]}): header {width} cells, rows {bad}"
        count += 1
    return count


def test_the_table_writer_refuses_a_row_of_another_width():
    assert markdown_table(["a", "b"], [["1", "x|y"]]) == "| a | b |\n|---|---|\n| 1 | x\\|y |"
    with pytest.raises(ValueError, match=r"table 'a \| b': row 2 has 3 cells, its header 2"):
        markdown_table(["a", "b"], [["1", "2"], ["1", "2", "3"]])
    with pytest.raises(ValueError, match="3 alignments for 2 columns"):
        markdown_table(["a", "b"], [], "rrr")


def test_round_1s_report_has_well_formed_tables():
    """Round 1's committed summaries, read where they are, rendered (the plots named, not drawn)."""
    parser = cli.get_parser()
    summaries = os.path.relpath(round_summaries("ablation-runs"), STUDY_DIR)
    args = parser.parse_args(["--summaries", summaries])
    s = cli.resolve_settings(parser, args, need_data=False)
    text = render(s, gather_report(s, "cmd", "2026-11-25", "m"))
    # The replay table: one row per replay, its start step in the second column under "from step".
    assert "| seed | from step | event step | event layer | max/median |" in text
    assert "| 42 | 445 | 446 | 0 | 46.6 |" in text
    # family, per arm, replay controls, icefall, WER points, set-up, outliers per layer and per seed, paired,
    # replays, second moments
    assert assert_tables_well_formed(text) == 11


# The arms whose runs clip here (every step, to 0.02); the guard (clip_grad_norm 1000) never does.
CLIPPING = (
    "clip-grad-norm",
    "grad-filter-threshold+clip-grad-norm",
    "clip-grad-norm-relative",
    "clip-grad-norm-relative-5",
)


def _run(arm, seed, base, cpu="Intel Xeon"):
    steps = 12
    wer_at = {p: {k: base + 10 * (k[1] == "test-other") - p / 4 for k in KEYS} for p in (4, 8, 12)}
    scalars = {
        "simple_loss": [(s, 1.0 / s) for s in range(1, steps + 1)],
        "pruned_loss": [(s, 0.5 / s) for s in range(1, steps + 1)],
        "grad_norm": [(s, 300.0 + s) for s in range(1, steps + 1)],
        "clip_scale": [(s, 0.02 if arm in CLIPPING else 1.0) for s in range(1, steps + 1)],
        "valid_loss": [(steps, 0.2)],
    }
    filters = {(layer, "max_over_median"): [(s, 3.0 + s) for s in range(1, steps + 1)] for layer in (0, 1)}
    return RunResult(
        RunKey("digits", arm, seed),
        wer_at[12],
        scalars,
        filters,
        {"train": 60.0},
        2,
        {"cpu_model": cpu, "torch": "2.13.0"},
        wer_at,
        {"avg": 2, "use_averaged_model": True},
        [f"train {arm} {seed}"],
    )


def _branch(loss, moments, event_moments=()):
    window = range(4, 8)
    return Branch(
        [(s, loss) for s in window],
        [(s, float(s)) for s in window],
        {k: 10.0 + loss for k in KEYS},
        0.25,
        2.0,
        list(moments),
        list(event_moments),
    )


def test_a_full_rounds_section_has_well_formed_tables():
    arms = {a.name: a for a in make_arms(Thresholds())}
    results = [
        _run(arm, seed, 10 + seed % 3 + 0.1 * len(arm) * (seed - 41))
        for arm in [*STUDY.seeds_per_arm, *(c.arm for c in STUDY.landscape_family)]
        for seed in (42, 43, 44)
    ]
    results[0] = _run("none", 42, 10, cpu="AMD EPYC")  # its pairs straddle two CPU models
    layout = parameter_layout([])
    ones = [1.0] * len(layout)
    twos = [2.0] * len(layout)
    branches = {
        NO_CONTROL: _branch(0.1, twos, twos),
        EVENT_ONLY: _branch(0.09, ones, ones),
        FILTER: _branch(0.08, ones, ones),
        UNIFORM: _branch(0.095, twos, ones),
        MATCHED: _branch(0.07, ones),
        MATCHED_REFERENCE: _branch(0.07, twos),
    }
    replays = [
        ReplayResult(ReplayKey("digits", 43, 3), Event(4, 1, 40.0), 4, branches, layout, Matched(8, 2.0)),
        ReplayResult(
            ReplayKey("digits", 44, 3),
            Event(4, 0, 30.0),
            4,
            {k: v for k, v in branches.items() if k not in (MATCHED, MATCHED_REFERENCE)},
            layout,
            None,
        ),
    ]
    for r in replays:  # branch (a) equals the run over the window, as it must
        run = next(x for x in results if x.key == RunKey("digits", "none", r.key.seed))
        r.branches[NO_CONTROL] = Branch(
            [(s, v) for s, v in run.objective() if 3 < s <= 7],
            [(s, float(s)) for s in range(4, 8)],
            {},
            0,
            1,
            twos,
            twos,
        )
        r.branches[NO_CONTROL].wer = {k: 10.0 for k in KEYS}
    pilot = _run("none", 42, 10)
    pilot.wer_at = {600: pilot.wer_at[4], STUDY.steps: pilot.wer_at[8], STUDY.pilot.steps: pilot.wer_at[12]}
    setup = ReportSetup(
        command="./lstm_transducer_stateless/ablation.py",
        config=STUDY,
        summaries=STUDY.summaries,
        stored={
            "round": STUDY.round,
            "conditions": {"digits": {"max_duration": 60.0, "flags": ["--base-lr", "0.003"]}},
        },
        thresholds=Thresholds(),
        methods=["greedy_search"],
        planned_replays=10,
        date="2026-12-01",
        machine="x86_64",
    )
    text = render_report(results, replays, arms, {}, setup, [pilot])
    assert assert_tables_well_formed(text) == 12 and "## The clipping landscape" in text
    # The answer: the plan's 7 arms x 3 seeds of its 59 runs (17 + 17 + 5 x 5), the landscape's not counted.
    assert "21 of the 59 runs planned for round 2 and 2 of the 10 planned replays are in." in text
    # clip-grad-norm: WER base + 10 - step / 4 with base 11.4, 13.8, 16.2 (seeds 42-44: 10 + seed % 3 + 0.1 x 14
    # letters x (seed - 41)): 22.8 / 21.8 / 20.8 at 4 / 8 / 12, sd 2.4; the objective 1 / step leaves the plateau
    # at step 6 ((1/2 + ... + 1/6) / 5 = 0.29); every step clipped to 0.02; the guard (not in CLIPPING) never clipped.
    assert (
        "| clip_grad_norm 5 | 3 (42-44) | 22.80 ± 2.40 | 21.80 ± 2.40 | 20.80 ± 2.40 | 6 ± 0 | - | 100.0 ± 0.0 | "
        "normalisation (at least 90% of steps) | 0.020 |"
    ) in text
    assert "| 0.0 ± 0.0 | never acted | 1.000 |" in text
    # none / seed 42 ran on another CPU model: filter - none, guard - none, clip-relative - none lose a pair each.
    assert "Pairs left out because their two runs ran on different CPU models: 3." in text
    assert "fixed on 2026-11-26 before the runs of round 2" in text
    assert "| (e) filter's mean scale, uniform, no capping |" in text
    assert "2 replays of 10 planned" in text and "Branch (d) ran in 1 of 2 replays" in text
    assert math.isfinite(float(text.split("CPU models of the summaries: ")[1].split("AMD EPYC: ")[1].split(" ")[0]))
