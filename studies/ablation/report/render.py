"""The ablation's report, ``studies/ablation/README.md``: the whole document put together from the headings'
templates (one function per heading, in :mod:`~studies.ablation.report.answer`, ``landscape``, ``depth`` and
``tables``), over the figures computed once (:func:`~studies.ablation.report.figures.compute_figures`)."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from studies.ablation.arms import Arm
from studies.ablation.metrics import format_table, format_wer_curves
from studies.ablation.replay.result import ReplayResult
from studies.ablation.report.answer import answer_section
from studies.ablation.report.common import ReportSetup, cpu_line, reproductions_sentence
from studies.ablation.report.depth import depth_section, pilot_section
from studies.ablation.report.figures import Figures, compute_figures
from studies.ablation.report.how_to_run import HOW_TO_RUN
from studies.ablation.report.landscape import family_section, landscape_section
from studies.ablation.report.tables import column_notes, outliers_sections, paired_section, replay_section, setup_text
from studies.ablation.runs import RunResult

TITLE = "# Ablation: GradientFilter, clip_grad_norm and the other gradient controls"
OLD_UNIFORM = "-m studies.ablation.uniform_filter"  # branch (e)'s module before the library's uniform mode


def head_section(results: Sequence[RunResult], replays: Sequence[ReplayResult], setup: ReportSetup) -> List[str]:
    """When and where the report was made, the CPUs of its runs, the runs left waiting and the command."""
    return [
        f"Date: {setup.date}. Machine: {setup.machine}.",
        "",
        f"CPU models of the summaries: {cpu_line(results, replays)}."
        + reproductions_sentence(setup.reproductions, setup.summaries),
        "",
        *(
            [
                "Trained to fewer steps than their condition's budget (steps made of the budget), left out of every "
                "table until they train on (their set's command resumes them from their last checkpoint): "
                + ", ".join(setup.waiting)
                + ".",
                "",
            ]
            if setup.waiting
            else []
        ),
        "The study's design (conditions, the round fixed before its runs, arms, pairing, replays): "
        "[PROTOCOL.md](PROTOCOL.md).",
        "",
        f"Command (from `egs/librispeech/ASR`, once its corpus is prepared: `make ablation` from the repository "
        f"root prepares it and runs this; the runs' summaries are in `{setup.summaries}/`):",
        "",
        "```bash",
        setup.command,
        "```",
        "",
    ]


def arms_section(results: Sequence[RunResult], arms: Dict[str, Arm], setup: ReportSetup) -> List[str]:
    """The WER at each decoding point, then the set-up and every arm's row."""
    return [
        "## WER at each decoding point",
        "",
        format_wer_curves(results, arms, setup.methods),
        "",
        "## Set-up and every arm",
        "",
        *setup_text(setup, results, arms),
        "",
        column_notes(setup.thresholds.grad_filter_threshold, sorted({r.warm_end for r in results})),
        "",
        format_table(results, arms, setup.methods),
        "",
    ]


def closing_sections(commands: Sequence[str], plots: Dict[str, str], provenance: Optional[str] = None) -> List[str]:
    """The plots (``{kind: link relative to the report}``), every command, the manual and the runs'
    hand-written provenance (``provenance``: Markdown copied as it is, under its own heading)."""
    lines = [
        "## Plots",
        "",
        *[f"![{kind}]({link})" for kind, link in plots.items()],
        "",
        "<details><summary>Every command the ablation ran (from egs/librispeech/ASR)</summary>",
        "",
        "```bash",
        *commands,
        "```",
        "",
        "</details>",
        "",
        *(
            [
                "The commands above that run `python -m studies.ablation.uniform_filter` are branch (e) as its replays "
                "recorded it; that module is gone, its arithmetic is now train.py's `--grad-filter-mode uniform` (bit "
                "for bit: tests/test_rules.py), which the study runs for branch (e) now.",
                "",
            ]
            if any(OLD_UNIFORM in c for c in commands)
            else []
        ),
        "## How to run",
        "",
        "```text",
        HOW_TO_RUN.rstrip("\n"),
        "```",
    ]
    if provenance:
        lines += ["", "## The runs", "", provenance.rstrip("\n")]
    return lines


def render_report(
    results: Sequence[RunResult],
    replays: Sequence[ReplayResult],
    arms: Dict[str, Arm],
    plots: Dict[str, str],
    setup: ReportSetup,
    pilots: Sequence[RunResult] = (),
    observing_arm: str = "none",
    provenance: Optional[str] = None,
) -> str:
    """The report as Markdown. ``plots``: ``{kind: link relative to the report}``; ``pilots``: the budget
    checks made, of the round's condition and of the deep one; ``provenance``: hand-written Markdown on where
    the runs were made, copied at the end."""
    f: Figures = compute_figures(results, replays, setup.config, setup.methods, pilots, observing_arm)
    labels = {name: f"`{name}`" for name in arms}
    lines = [
        TITLE,
        "",
        *head_section(results, replays, setup),
        *answer_section(f.rows, f.runs_of, replays, f.measures, arms, labels, setup, f.originals),
        *family_section(f.rows, setup, results, f.condition),
        *landscape_section(results, arms, setup),
        *depth_section(results, labels, setup, f.pilot_of.get(setup.config.depth_condition)),
        *arms_section(results, arms, setup),
        *outliers_sections(results, setup, observing_arm),
        *paired_section(f.comparisons, arms),
        *replay_section(replays, f.measures, setup, f.originals),
        *pilot_section(f.pilot_of.get(setup.config.condition), setup.config, results),
        *closing_sections([c for r in [*pilots, *results, *replays] for c in r.commands], plots, provenance),
    ]
    return "\n".join(lines) + "\n"
