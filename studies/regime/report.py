"""The pilot's report (this folder's README.md), rendered from its summaries and ``pilot.json``: the grid's
table, the rule applied to it (once every run is in) and where the runs were made."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from icefall_lite.data.corruptions import MIX_KINDS
from icefall_lite.data.synthetic.digits import DIGITS_SIZES
from icefall_lite.utils import write_text_atomic
from studies.regime.family import control_stage, diverged, family_section, family_stage
from studies.regime.grid import CELLS, CORRUPTIONS, REFERENCE, SETTINGS, Cell
from studies.regime.onset import load_design
from studies.regime.onset_report import onset_section, write_plots
from studies.regime.pilot import DESIGN, load_summaries
from studies.regime.stage import Stage

REPORT = Path(__file__).resolve().parent / "README.md"
COMMAND = "python -m studies.regime"  # from the repository root; --report-only re-renders this file
MIN_GAP = 2.0  # pilot.json's "hurt": points of mean test-other WER above the reference
MIN_DIVERGED = 0.3
# Words in test-other of `prepare.sh --corpus digits --size regime` (its default seed): the corpus is not built
# in CI, so tests/test_regime.py plans it (no audio) and counts them.
TEST_OTHER_WORDS = 15234


def cell_runs(summaries: Dict[Tuple[str, int], Dict], cell: Cell) -> List[Dict]:
    return [summaries[(cell.name, s)] for s in DESIGN["seeds"] if (cell.name, s) in summaries]


def mean_wer(runs: List[Dict], test_set: str = "test-other") -> Optional[float]:
    return statistics.fmean(r["wer"][test_set] for r in runs) if runs else None


def verdicts(summaries: Dict[Tuple[str, int], Dict]) -> Dict[str, Dict]:
    """Per cell with every seed in: its mean WER, the gap to the reference's, runs diverged, whether it still
    learns and whether it hurts ``none`` (pilot.json's rules)."""
    seeds = len(DESIGN["seeds"])
    reference = cell_runs(summaries, REFERENCE)
    if len(reference) < seeds:
        return {}
    out = {}
    for cell in CELLS:
        runs = cell_runs(summaries, cell)
        if len(runs) < seeds:
            continue
        n_div = sum(diverged(r) for r in runs)
        gap = mean_wer(runs) - mean_wer(reference)
        out[cell.name] = {
            "mean": mean_wer(runs),
            "gap": gap,
            "diverged": n_div,
            "learns": n_div <= seeds // 2,
            "hurts": gap >= MIN_GAP or n_div / seeds >= MIN_DIVERGED,
        }
    return out


def pick(v: Dict[str, Dict]) -> Optional[str]:
    """The cell that still learns and hurts ``none`` most (largest gap), None when none qualifies."""
    qualified = [name for name, x in v.items() if x["learns"] and x["hurts"] and name != REFERENCE.name]
    return max(qualified, key=lambda name: v[name]["gap"]) if qualified else None


def _fmt(x: Optional[float], digits: int = 2) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def grid_table(summaries: Dict[Tuple[str, int], Dict]) -> List[str]:
    seeds = DESIGN["seeds"]
    head = ["cell", *(f"test-other seed {s}" for s in seeds), "mean", "vs base.clean", "diverged"]
    head += ["test-clean mean", "valid loss", "max seq/median", "steps > 25x"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    v = verdicts(summaries)
    for cell in CELLS:
        runs = {r["key"]["seed"]: r for r in cell_runs(summaries, cell)}
        if not runs:
            continue
        rs = list(runs.values())
        ratio = max((r["max_over_median"]["max"] or 0.0) for r in rs)
        above = sum(r["max_over_median"]["steps_above_25"] for r in rs)
        steps = sum(r["max_over_median"]["steps"] for r in rs)
        gap = v.get(cell.name, {}).get("gap")
        row = [
            f"`{cell.name}`",
            *(_fmt(runs[s]["wer"]["test-other"]) if s in runs else "" for s in seeds),
            _fmt(mean_wer(rs)),
            "" if gap is None else f"{gap:+.2f}",
            f"{sum(diverged(r) for r in rs)} of {len(rs)}",
            _fmt(mean_wer(rs, "test-clean")),
            " / ".join(_fmt(r["valid_loss"], 3) for r in rs),
            f"{ratio:.1f}",
            f"{above} of {steps}",
        ]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _share(k: int, n: int) -> str:
    return f"{100 * k / n:.1f}% ({k}/{n})" if n else "-"


def _rates(seq: Dict) -> Tuple[Dict[str, Dict[str, int]], int, int, int]:
    """One run's (or a pool's) counts by kind, and its corrupted cuts' flagged and seen occurrences and its clean
    cuts' flagged ones."""
    by_kind = seq["by_kind"]
    bad = [c for k, c in by_kind.items() if k != "clean"]
    clean = by_kind.get("clean", {"occurrences": 0, "flagged": 0})
    return by_kind, sum(c["flagged"] for c in bad), sum(c["occurrences"] for c in bad), clean["flagged"]


def _pool(logged: List[Dict]) -> Dict:
    total: Dict[str, Dict[str, int]] = {}
    for seq in logged:
        for kind, c in seq["by_kind"].items():
            t = total.setdefault(kind, {"occurrences": 0, "flagged": 0})
            t["occurrences"] += c["occurrences"]
            t["flagged"] += c["flagged"]
    return {"by_kind": total}


def _range(xs: List[float]) -> str:
    """The runs' range of a rate (in %), where there are two runs or more to range over."""
    return f"; runs {100 * min(xs):.1f}-{100 * max(xs):.1f}%" if len(xs) > 1 else ""


def sequences_table(groups: List[Tuple[str, List[Dict]]]) -> List[str]:
    """Per group of runs (a label and their summaries), over those with a sequence log: how often some layer saw
    a corrupted cut above ``flag_at`` x the batch median (recall, per kind) and how many of the occurrences it
    saw there were corrupted (precision), beside the clean cuts' rate; pooled over the runs, with the runs'
    range of recall and precision (the pool alone would hide how much they vary from seed to seed)."""
    head = ["runs of", "runs", "recall", *(f"recall: {k}" for k in MIX_KINDS), "precision", "clean cuts flagged"]
    rows = []
    for label, runs in groups:
        logged = [r["sequences"] for r in runs if r.get("sequences")]
        if not logged:
            continue
        total, bad_flagged, bad_seen, clean_flagged = _rates(_pool(logged))
        per_run = [_rates(seq) for seq in logged]
        recalls = [f / n for _, f, n, _ in per_run if n]
        precisions = [f / (f + c) for _, f, n, c in per_run if n and f + c]
        clean = total.get("clean", {"occurrences": 0, "flagged": 0})
        per_kind = [_share(total[k]["flagged"], total[k]["occurrences"]) if k in total else "-" for k in MIX_KINDS]
        row = [label, str(len(logged)), _share(bad_flagged, bad_seen) + (_range(recalls) if bad_seen else "")]
        row += per_kind
        precision = _share(bad_flagged, bad_flagged + clean_flagged) + _range(precisions)
        row += [precision if bad_seen else "-"]
        row += [_share(clean["flagged"], clean["occurrences"])]
        rows.append("| " + " | ".join(row) + " |")
    if not rows:
        return ["No run with a sequence log yet."]
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *rows]


def verdict_text(summaries: Dict[Tuple[str, int], Dict]) -> List[str]:
    total = len(CELLS) * len(DESIGN["seeds"])
    if len(summaries) < total:
        return [f"The pilot is under way: {len(summaries)} of {total} runs in; the rule is applied once all are."]
    v = verdicts(summaries)
    chosen = pick(v)
    hurt = [name for name, x in v.items() if x["hurts"] and name != REFERENCE.name]
    if chosen is None:
        return [
            f"No cell hurt `none` by {MIN_GAP:g} points of test-other WER or made 30% of its runs diverge: "
            "on this grid, training without any gradient control could not be hurt or made to diverge at "
            f"{DESIGN['steps']} steps. That is the finding; the study stops here."
        ]
    x = v[chosen]
    return [
        f"Cells that hurt `none` (pilot.json's rule): {', '.join(f'`{h}`' for h in hurt)}. "
        f"The pick: `{chosen}`, mean test-other WER {x['mean']:.2f} ({x['gap']:+.2f} against `base.clean`), "
        f"{x['diverged']} of {len(DESIGN['seeds'])} runs diverged."
    ]


def machines(summaries: Dict[tuple, Dict]) -> str:
    """How many of the runs were made on each machine (CPU model and flags, threads, torch)."""
    seen: Dict[str, int] = {}
    for s in summaries.values():
        m = s["machine"]
        name = f"{m['cpu_model']} (flags {m['cpu_flags']}), {m['threads']} threads, torch {m['torch']}"
        seen[name] = seen.get(name, 0) + 1
    return "; ".join(f"{n} run{'s' if n > 1 else ''} on {name}" for name, n in seen.items()) or "no run yet"


def _arms_against_baseline(family: Stage) -> str:
    """ "`a`, `b` and `c` change against `baseline`" for the family's comparisons."""
    arms = [f"`{arm}`" for arm, _ in family.design["comparisons"]]
    listed = arms[0] if len(arms) == 1 else f"{', '.join(arms[:-1])} and {arms[-1]}"
    return f"{listed} change against `{family.design['baseline']}`"


def render(
    summaries: Dict[Tuple[str, int], Dict],
    family: Optional[Stage] = None,
    family_runs=None,
    control: Optional[Stage] = None,
    control_runs=None,
    onset: Optional[Dict] = None,
) -> str:
    settings = "; ".join(f"`{s.name}`: {s.description}" for s in SETTINGS)
    corruptions = ", ".join(f"`{c.name}` ({c.fraction:.0%})" for c in CORRUPTIONS)
    example = next(iter(summaries.values()), None)
    family_runs = family_runs or {}
    family_lines = family_section(family, family_runs, control, control_runs)
    if family is not None:
        arms = [(f"`{arm}`", [s for (_, a, _), s in family_runs.items() if a == arm]) for arm, _ in family.arms]
        family_lines += [
            "",
            "Where the corrupted utterances' gradients go, per arm (as in the pilot's table below; in `filter-25` "
            "each layer sees gradients the layers above it have filtered):",
        ]
        family_lines += ["", *sequences_table(arms), ""]
    lines = [
        "# Where the GradientFilter has work to do: a pilot, a family in the cell it picks"
        + ("" if onset is None else ", and two confirmatory questions"),
        "",
        "Generated by `python -m studies.regime` (`--report-only` re-renders it from the summaries); the pilot's "
        "design, fixed before its runs, is [pilot.json](pilot.json)"
        + (
            ""
            if family is None
            else "; the family's, fixed after the pilot and before its runs, [family.json](family.json)"
        )
        + ("" if onset is None else "; the confirmatory questions', fixed before their runs, [onset.json](onset.json)")
        + ".",
        "",
        *onset_section(onset, family, family_runs),
        "**Question.** Is there a setting of the digits task in which training without any gradient control "
        "(`none`: every rule of the registry off, the filter only observing) is hurt by outlier utterances or "
        "by unstable training, while it still learns? Only there can the filter's guard be measured"
        + (
            ""
            if family is None
            else f": in the cell the pilot picks, the family measures what {_arms_against_baseline(family)}"
        )
        + ".",
        "",
        f"**Grid.** Training sets: {corruptions} of the training cuts corrupted by "
        "`local/make_corrupted_cuts.py --method mix` (in equal shares: another cut's transcript, audio truncated "
        "to a third, a silence of twice the cut's length, a 1 s noise burst 20 dB above the cut's loudest frame, "
        "other cuts appended up to 20 s with their transcripts). Settings: "
        f"{settings}. Corpus: `prepare.sh --corpus digits --size regime` (test-other "
        f"{DIGITS_SIZES['regime'].test_other_utts:,} utterances, {TEST_OTHER_WORDS:,} words: one word is "
        f"{100 / TEST_OTHER_WORDS:.3f} points). "
        f"Each run: {DESIGN['steps']} steps, decoded by greedy search with icefall's model average over the last "
        f"{DESIGN['decode']['avg'] * DESIGN['decode']['save_every_n']} steps; seeds {DESIGN['seeds']}.",
        "",
        *family_lines,
        "## The pilot's grid",
        "",
        *grid_table(summaries),
        "",
        "Diverged: test-other WER at least 50%, or more than 10% of the steps skipped. *max seq/median*: the "
        "largest ratio, over the steps and layers, of one sequence's gradient RMS to the batch median as the "
        "observing filter measured it; *steps > 25x*: steps in which it was above 25, where `--grad-filter-"
        "threshold 25` would have scaled that sequence's gradient by 1/2 or less (the filter is soft: by "
        "c / (c + n), c 25x the median, n the sequence's RMS).",
        "",
        f"## Where the corrupted utterances' gradients go (`none`, the filter observing, flagged above "
        f"{DESIGN['flag_at']}x the batch median)",
        "",
        "Counted over every step in which a cut was in a batch (a cut is counted once per step it is in): "
        "*recall*, the share of corrupted cuts' occurrences that some layer saw above the threshold (where "
        f"`--grad-filter-threshold {DESIGN['flag_at']}` would scale their gradient by 1/2 or less); "
        "*precision*, the share of the flagged occurrences that were corrupted cuts; *clean cuts flagged*, the "
        "same rate for the uncorrupted cuts.",
        "",
        *sequences_table([(f"`{c.name}`", cell_runs(summaries, c)) for c in CELLS]),
        "",
        "## The rule applied",
        "",
        *verdict_text(summaries),
        "",
        "## Provenance",
        "",
        f"- The pilot: {machines(summaries)}.",
    ]
    if family is not None:
        lines.append(f"- The family: {machines(family_runs)}.")
    if control is not None:
        lines.append(f"- The control: {machines(control_runs or {})}.")
    if example is not None:
        lines += ["", "The commands of one run (from the recipe folder; every run's are in its summary):", ""]
        lines += [f"    {c}" for c in example["commands"]]
    return "\n".join(lines) + "\n"


def current() -> str:
    """The report of the committed summaries: the pilot's, and the family's (with its control) once family.json
    is written."""
    family, control = family_stage(), control_stage()
    family_runs = family.load_summaries() if family is not None else {}
    control_runs = control.load_summaries() if control is not None else {}
    return render(load_summaries(), family, family_runs, control, control_runs, load_design())


def write_report() -> Path:
    """The report and the onset questions' plots."""
    write_text_atomic(REPORT, current())
    write_plots(load_design())
    return REPORT
