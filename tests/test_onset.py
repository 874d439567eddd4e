"""The regime study's confirmatory stage (studies/regime/onset*.py, onset.json): the plateau exit by hand, the
survival and Fisher tests against formulas worked here, the gate, the one-machine and one-commit rules, and the
report's answers on made-up runs."""

import json
import math
import statistics
from fractions import Fraction
from pathlib import Path
from typing import Dict, List, Sequence

import pytest

from studies.regime import onset, onset_report, onset_stats
from studies.regime.onset_stats import Exit, plateau_exit
from studies.regime.stage import shown
from studies.runner import StudyError

RULE = {"level": 0.30, "from_step": 100, "window": 50}
MACHINE = {"cpu_model": "X", "cpu_flags": "abc", "threads": "2", "torch": "2.13.0"}


def test_plateau_exit_is_the_end_of_the_first_full_window_below_the_level_from_step_100():
    # Windows 0 and 1 (steps 0-99) are below the level before the pruned loss has its weight: not counted.
    windows = [0.23, 0.25, 0.45, 0.44, 0.31, 0.29, 0.10]
    assert plateau_exit(windows, RULE, 1200) == Exit(300, True)  # window 5: steps 250-299
    assert plateau_exit([0.2, 0.2, 0.28], RULE, 1200) == Exit(150, True)  # leaves as the ramp ends
    # Never below the level up to the budget: censored at it; a window past the budget does not count.
    assert plateau_exit([0.44] * 6 + [0.1], RULE, 300) == Exit(300, False)
    assert plateau_exit([0.44] * 6 + [0.1], RULE, 350) == Exit(350, True)
    # The budget's own step opens a partial window (step 1200 alone): it is not a full window.
    assert plateau_exit([0.44] * 24 + [0.1], RULE, 1200) == Exit(1200, False)
    assert plateau_exit([0.44, None, 0.44, None, 0.2], RULE, 1200) == Exit(250, True)
    with pytest.raises(ValueError, match="window"):
        plateau_exit([0.1], {**RULE, "window": 100}, 1200)


def _logrank_by_hand(a: Sequence[Exit], b: Sequence[Exit]) -> float:
    """Mantel's log-rank chi-square (1 df) worked out here: at each event time, group a's observed minus expected
    events and the hypergeometric variance; p from the chi-square's survival function via erfc."""
    times = sorted({e.step for e in [*a, *b] if e.observed})
    o_minus_e, var = 0.0, 0.0
    for t in times:
        n_a = sum(e.step >= t for e in a)
        n_b = sum(e.step >= t for e in b)
        d_a = sum(e.step == t and e.observed for e in a)
        d = d_a + sum(e.step == t and e.observed for e in b)
        n = n_a + n_b
        o_minus_e += d_a - d * n_a / n
        if n > 1:
            var += d * (n_a / n) * (n_b / n) * (n - d) / (n - 1)
    chi2 = o_minus_e**2 / var
    return math.erfc(math.sqrt(chi2 / 2))  # P(chi-square with 1 df > chi2)


def test_logrank_is_mantels_test_worked_by_hand_with_ties_and_censoring():
    a = [Exit(s, True) for s in (150, 350, 350, 400, 450, 500)] + [Exit(1200, False)]
    b = [Exit(s, True) for s in (400, 600, 700, 700, 750, 900)] + [Exit(1200, False)] * 2
    assert onset_stats.logrank(a, b) == pytest.approx(_logrank_by_hand(a, b), rel=1e-9)
    assert onset_stats.logrank(a, a) == pytest.approx(1.0)
    assert math.isnan(onset_stats.logrank([Exit(1200, False)], [Exit(1200, False)]))


def test_hazard_ratio_is_above_1_for_the_group_that_leaves_sooner_and_inverts_when_swapped():
    early = [Exit(s, True) for s in (150, 300, 350, 400, 450, 500, 550)]
    late = [Exit(s, True) for s in (400, 600, 700, 750, 800)] + [Exit(1200, False)] * 2
    hr, low, high = onset_stats.hazard_ratio(early, late)
    assert hr > 1 and low < hr < high
    back = onset_stats.hazard_ratio(late, early)
    assert back[0] == pytest.approx(1 / hr, rel=1e-6)
    assert (back[1], back[2]) == pytest.approx((1 / high, 1 / low), rel=1e-6)
    # No exit in one group, or every exit of one group before every exit of the other: the likelihood has no
    # maximum, the ratio is infinite (or 0) without an interval; no exit in either: no ratio.
    never = [Exit(1200, False)] * 3
    assert onset_stats.hazard_ratio(early, never)[0] == math.inf
    assert onset_stats.hazard_ratio(late, never)[0] == math.inf  # late has runs censored too
    assert onset_stats.hazard_ratio(never, late)[0] == 0.0
    assert all(math.isnan(x) for x in onset_stats.hazard_ratio(never, never))
    assert all(math.isnan(x) for x in onset_stats.hazard_ratio(early, []))
    apart = [Exit(s, True) for s in (700, 800, 900)]
    separated = onset_stats.hazard_ratio(early, apart)
    assert separated[0] == math.inf and math.isnan(separated[1]) and math.isnan(separated[2])
    assert onset_stats.hazard_ratio(apart, early)[0] == 0.0


def _km_median_by_hand(exits: Sequence[Exit]) -> float:
    """The product-limit curve worked here; the median by R survival's rule: the first step where the curve is
    below one half, or the midpoint of a stretch at exactly one half (to the next exit, or to the last step)."""
    steps = sorted({e.step for e in exits if e.observed})
    surv = Fraction(1)
    curve = []
    for t in steps:
        at_risk = sum(e.step >= t for e in exits)
        left = sum(e.step == t and e.observed for e in exits)
        surv *= 1 - Fraction(left, at_risk)
        curve.append((t, surv))
    for i, (t, s) in enumerate(curve):
        if s == Fraction(1, 2):
            return onset_stats.Median((t + curve[i + 1][0]) / 2) if i + 1 < len(curve) else onset_stats.Median(t, True)
        if s < Fraction(1, 2):
            return onset_stats.Median(t)
    return onset_stats.Median(None)


@pytest.mark.parametrize(
    "observed, censored, stated",
    [
        ([300, 350, 400, 450, 500, 550, 600, 650, 700, 750], 0, (525, False)),  # the sample median
        ([300, 400, 500, 500, 500, 550, 600, 650, 700, 750], 0, (525, False)),  # 500 three times, then 550
        ([300, 350, 400, 450, 500], 5, (500, True)),  # at one half from 500 to the budget: 500 or later
        ([300, 400, 500, 500, 500], 5, (500, True)),
        ([250, 300, 350, 400, 450, 500, 600], 3, (475, False)),  # one half from 450 to 500
        ([400, 450], 8, (None, False)),  # not reached
        ([450, 700, 900, 500, 650, 800, 550], 1, (675, False)),  # 4 of 8 left by 650: one half up to 700
    ],
)
def test_km_median_is_r_survivals_median_of_the_curve_worked_by_hand(observed, censored, stated):
    exits = [Exit(s, True) for s in observed] + [Exit(1200, False)] * censored
    got = onset_stats.km_median(exits)
    assert got == _km_median_by_hand(exits) == onset_stats.Median(*stated)
    if not censored:
        assert got.step == statistics.median(observed)


def _fisher_by_hand(a: int, n: int, b: int, m: int) -> float:
    """Two-sided Fisher: the sum of the hypergeometric probabilities of every table with the same margins that
    is no more likely than the observed one (exact fractions)."""
    k = a + b

    def prob(x: int) -> Fraction:
        return Fraction(math.comb(n, x) * math.comb(m, k - x), math.comb(n + m, k))

    observed = prob(a)
    return float(sum(prob(x) for x in range(max(0, k - m), min(k, n) + 1) if prob(x) <= observed))


@pytest.mark.parametrize("a, b", [(4, 10), (2, 9), (1, 8), (0, 6), (3, 3)])
def test_fisher_is_the_hypergeometric_sum_worked_by_hand(a, b):
    assert onset_stats.fisher((a, 10), (b, 10)) == pytest.approx(_fisher_by_hand(a, 10, b, 10), rel=1e-9)


def test_fisher_without_variation_is_1_and_without_runs_is_not_a_test():
    # Collapses in every run of both groups, or in none: the observed table is the only one with its margins.
    assert onset_stats.fisher((10, 10), (10, 10)) == onset_stats.fisher((0, 10), (0, 10)) == 1.0
    assert math.isnan(onset_stats.fisher((0, 0), (3, 10)))


def test_the_designs_fisher_power_sentences_hold():
    # onset.json's rescue power: from 10 of 10, at most 4 of 10; from 9, 2; from 8, 1; from 6 or 7, only 0.
    alpha = 0.05 / 3
    assert [onset_stats.fisher_largest_rate(k, 10, alpha) for k in (10, 9, 8, 7, 6)] == [4, 2, 1, 0, 0]
    assert onset_stats.fisher_largest_rate(5, 10, alpha) is None


def test_loss_digest_covers_exactly_the_steps_below_its_bound():
    from studies.regime.stage import loss_digest

    series = [(s, 0.5 - s / 1000) for s in range(400)]
    d = loss_digest(series, 300)
    assert d == loss_digest(series[:300], 300)  # later steps do not count
    changed = list(series)
    changed[299] = (299, changed[299][1] + 1e-7)
    assert loss_digest(changed, 300) != d and len(d) == 16


DESIGN = json.loads((Path(onset.__file__).parent / "onset.json").read_text())


def _summary(stage, arm: str, seed: int, windows: List[float], wer: Dict[int, float], machine=MACHINE) -> Dict:
    return {
        "key": {"cell": stage.cells[0].name, "arm": arm, "seed": seed},
        "steps": stage.steps,
        "wer": {"test-clean": 1.0, "test-other": wer[stage.points[-1]]},
        "wer_at": {str(p): {"test-clean": 1.0, "test-other": w} for p, w in wer.items()},
        "skipped_steps": 0,
        "loss_per_50_steps": windows,
        "machine": dict(machine),
        "commit": "c0ffee",
        "loss_digest": {"steps": 300, "sha256": "0" * 16},
    }


def _curve(exit_window: int) -> List[float]:
    """Windows on the plateau (0.44) until ``exit_window``, then learned (0.1); 25 windows."""
    return [0.23, 0.25] + [0.44 if i < exit_window else 0.1 for i in range(2, 25)]


def test_the_gate_needs_every_none_run_and_most_of_them_collapsed():
    rescue = onset.question_stage("rescue", DESIGN)
    assert [r.arm for r in onset.gate_runs(rescue)] == ["none"] * 10
    runs = {}
    for i, seed in enumerate(rescue.seeds):
        wer = 100.0 if i < 6 else 20.0
        runs[(rescue.cells[0].name, "none", seed)] = _summary(rescue, "none", seed, _curve(30), {1200: wer})
    assert onset.gate_passed(rescue, runs) is True
    runs[(rescue.cells[0].name, "none", 101)]["wer"]["test-other"] = 20.0  # now 5 of 10 collapsed
    assert onset.gate_passed(rescue, runs) is False
    del runs[(rescue.cells[0].name, "none", 110)]
    assert onset.gate_passed(rescue, runs) is None
    text = " ".join(onset_report.rescue_section(rescue, runs))
    assert "**The gate**: 9 of 10 `none` runs in, 5 collapsed" in text
    runs[(rescue.cells[0].name, "none", 110)] = _summary(rescue, "none", 110, _curve(30), {1200: 20.0})
    text = " ".join(onset_report.rescue_section(rescue, runs))
    assert "`none` collapsed in 5 of 10 runs at 1,200 steps, fewer than the 6 onset.json asked for" in text


def test_a_run_with_a_tenth_of_its_steps_skipped_collapses_and_the_report_states_the_amended_rule():
    rescue = onset.question_stage("rescue", DESIGN)
    cell = rescue.cells[0].name
    runs = {(cell, "none", s): _summary(rescue, "none", s, _curve(5), {1200: 20.0}) for s in rescue.seeds}
    for seed in rescue.seeds[:6]:
        runs[(cell, "none", seed)]["skipped_steps"] = 121  # of 1,200: more than 10%, at 20% WER
    assert onset.gate_passed(rescue, runs) is True
    runs[(cell, "none", 101)]["skipped_steps"] = 120  # exactly 10% is not more than 10%
    assert onset.gate_passed(rescue, runs) is False
    text = " ".join(onset_report.rescue_section(rescue, runs))
    assert "or more than 10% of the steps skipped (train.py's skipped steps: a step whose gradient norm is" in text
    assert "(Wording amended 2026-12-03 before any run of this question: The fixed text named one of" in text


def test_a_summary_of_one_decoding_at_the_budget_is_read_from_its_endpoint():
    # stage.summarise writes no wer_at where a question decodes once (rescue: at its budget, 1,200 steps).
    rescue = onset.question_stage("rescue", DESIGN)
    assert rescue.points == [rescue.steps] == [1200]
    summary = _summary(rescue, "none", 101, _curve(30), {1200: 97.97})
    del summary["wer_at"]
    assert onset_report.wer_at(summary, 1200) == 97.97
    with pytest.raises(ValueError, match=r"lr-x10.clean/none/seed-101 has no decoding at step 900 \(decoded at"):
        onset_report.wer_at(summary, 900)
    runs = {(rescue.cells[0].name, "none", 101): summary}
    assert "**The gate**: 1 of 10 `none` runs in, 1 collapsed" in " ".join(onset_report.rescue_section(rescue, runs))


def test_the_study_runs_rescues_other_arms_only_when_the_gate_passes_on_the_runs_the_report_counts(monkeypatch):
    slow, rescue = (onset.question_stage(q, DESIGN) for q in onset.QUESTIONS)
    cell = rescue.cells[0].name
    gate = {(cell, "none", seed): _summary(rescue, "none", seed, _curve(30), {1200: 100.0}) for seed in rescue.seeds}
    calls = []

    def fake_run_all(self, after_each=None, only=None):
        calls.append((self.name, None if only is None else len(only)))

    monkeypatch.setattr(onset, "check_here", lambda stage: None)
    monkeypatch.setattr(onset.Stage, "run_all", fake_run_all)
    monkeypatch.setattr(onset.Stage, "load_summaries", lambda self: gate if self.name == "rescue" else {})
    monkeypatch.setattr(onset, "alike", lambda stage: [])
    onset.run_all(DESIGN, lambda: None)
    assert calls == [("slow-start", None), ("rescue", 10), ("rescue", None)]  # 10 of 10 collapsed: the rest run
    # One gate run made on a machine not shown alike: the gate is undecided, and the other arms wait.
    gate[(cell, "none", 110)]["machine"] = {**MACHINE, "cpu_flags": "def"}
    calls.clear()
    onset.run_all(DESIGN, lambda: None)
    assert calls == [("slow-start", None), ("rescue", 10)]


def test_rescue_answer_on_made_up_runs():
    # none collapses in 10 of 10; guard in 1 (by skipped steps, not WER: the divergence rule's second clause is
    # counted too), zclip in 5, filter-25 in 10. Fisher by hand (hypergeometric, 20 runs, 10 an arm):
    # guard 1 against 10: (C(11,1) + C(11,10)) / C(20,10) = 22 / 184756; zclip 5 against 10: (C(15,5) + C(15,10))
    # / C(20,10) = 6006 / 184756 = 0.0325; filter-25: 1. Holm over three: guard 3 x 22/184756 = 3.6e-4,
    # zclip 2 x 0.0325 = 0.065, filter-25 1.
    rescue = onset.question_stage("rescue", DESIGN)
    cell = rescue.cells[0].name
    collapsed_seeds = {"none": 10, "filter-25": 10, "guard": 0, "zclip": 5}
    runs = {}
    for arm, k in collapsed_seeds.items():
        for i, seed in enumerate(rescue.seeds):
            runs[(cell, arm, seed)] = _summary(rescue, arm, seed, _curve(30), {1200: 100.0 if i < k else 15.0})
    runs[(cell, "guard", 110)]["skipped_steps"] = 121  # more than 10% of 1,200 steps; WER 15%
    text = " ".join(onset_report.rescue_section(rescue, runs))
    guard, zclip_holm = 22 / 184756, 2 * 6006 / 184756
    assert f"`guard`: confirmed, collapsed 1 of 10 against 10 (Fisher p {guard:.1e}, Holm p {3 * guard:.1e})" in text
    assert f"`zclip`: not resolved, collapsed 5 of 10 against 10 (Fisher p 0.033, Holm p {zclip_holm:.3f})" in text
    assert "`filter-25`: not resolved, collapsed 10 of 10 against 10 (Fisher p 1.000, Holm p 1.000)" in text
    assert "**The answer** (40 runs, 1,200 steps;" in text
    # The secondary signed-rank test over seeds: guard 15 against 100 in every seed (ten differences of -85, all of
    # one sign: exact p 2 / 2^10); zclip -85 in seeds 106-110, 0 (dropped from the test) in the rest: median
    # -42.5, p 2 / 2^5.
    assert f"| -85.00 (10 seeds, 10 non-zero; p {2 / 2**10:.3f}) |" in text
    assert f"| -42.50 (10 seeds, 5 non-zero; p {2 / 2**5:.3f}) |" in text
    del runs[(cell, "zclip", 101)]["wer_at"]["1200"]
    with pytest.raises(ValueError, match=r"lr-x10.clean/zclip/seed-101 has no decoding at step 1200"):
        onset_report.rescue_section(rescue, runs)


def test_a_baseline_that_never_leaves_the_plateau_confirms_an_arm_that_does():
    slow = onset.question_stage("slow-start", DESIGN)
    cell = slow.cells[0].name
    runs = {}
    for i, seed in enumerate(slow.seeds):
        for arm, w in (("none", 30), ("filter-25", 30), ("guard", 4 + i % 3), ("zclip", 30 if i else 5)):
            runs[(cell, arm, seed)] = _summary(slow, arm, seed, _curve(w), {900: 60.0, 1200: 10.0})
    text = "\n".join(onset_report.slow_start_section(slow, runs, None, {}))
    assert (
        "`guard`: confirmed, hazard ratio of leaving the plateau ∞ (no baseline run left the plateau while a run of "
        "the arm was still on it)"
    ) in text
    assert "`filter-25`: not resolved, hazard ratio of leaving the plateau -" in text
    assert "`zclip`: not resolved" in text  # one exit against none: log-rank p 0.32


def test_slow_start_answer_on_made_up_runs():
    slow = onset.question_stage("slow-start", DESIGN)
    cell = slow.cells[0].name
    runs = {}
    for i, seed in enumerate(slow.seeds):
        # none leaves late (window 14-16), filter-25 with none, guard early (window 4-6), zclip as none;
        # one none run never leaves (censored).
        late, early = 14 + i % 3, 4 + i % 3 + (12 if i == 9 else 0)  # one guard run as late as none's
        for arm, w in (("none", 30 if i == 0 else late), ("filter-25", late), ("guard", early), ("zclip", late)):
            runs[(cell, arm, seed)] = _summary(slow, arm, seed, _curve(w), {900: 60.0 - i, 1200: 10.0 + i / 10})
    rows = onset_report.exit_rows(slow, runs)
    assert [r.arm for r in rows] == ["none", "filter-25", "guard", "zclip"]
    assert rows[0].exits[101] == Exit(1200, False) and rows[2].exits[101] == Exit(250, True)
    text = "\n".join(onset_report.slow_start_section(slow, runs, None, {}))
    assert "`guard`: confirmed, hazard ratio of leaving the plateau" in text
    assert "`filter-25`: not resolved" in text and "`zclip`: not resolved" in text
    assert "Runs: 40 on X (flags abc), 2 threads, torch 2.13.0; left out of the tests for another machine: 0." in text
    # A run made on another machine is left out (and the answer waits for it), unless shown alike.
    other = {**MACHINE, "cpu_flags": "def"}
    runs[(cell, "zclip", 110)]["machine"] = other
    kept, left_out = onset.comparable(slow, runs)
    assert left_out == 1 and (cell, "zclip", 110) not in kept
    assert "once all 40 runs are in (39 in)" in "\n".join(onset_report.slow_start_section(slow, runs, None, {}))


def test_runs_from_another_machine_count_once_verified_alike(tmp_path, monkeypatch):
    slow = onset.question_stage("slow-start", DESIGN)
    monkeypatch.setattr(type(slow), "summaries", property(lambda self: tmp_path / self.name))
    cell = slow.cells[0].name
    other = {**MACHINE, "cpu_flags": "def"}
    runs = {(cell, "none", 101): _summary(slow, "none", 101, _curve(10), {900: 1, 1200: 1})}
    runs[(cell, "guard", 101)] = _summary(slow, "guard", 101, _curve(10), {900: 1, 1200: 1}, machine=other)
    assert onset.comparable(slow, runs)[1] == 1
    record = {"machine": onset.machine_name(other), "of": onset.machine_name(MACHINE), "alike": True}
    record.update(date="2026-12-03", steps=300, run="12-layers.clean/none/seed-101")
    (tmp_path / "slow-start").mkdir()
    (tmp_path / "slow-start" / onset.MACHINES_FILE).write_text(json.dumps({"verified": [record]}))
    assert onset.comparable(slow, runs) == (runs, 0)
    # The report says which machine was shown alike, how and when.
    assert (
        "left out of the tests for another machine: 0. X (flags def), 2 threads, torch 2.13.0 was shown to compute "
        "as X (flags abc), 2 threads, torch 2.13.0 on 2026-12-03: 300 steps of 12-layers.clean/none/seed-101 "
        "retrained there, their training losses' digest equal to the run's (summaries/slow-start/machines.json). "
        "Code commit:"
    ) in onset_report.provenance_line(slow, runs, 0)
    # Shown alike the other way round (the home retrained on the other machine's first run), or through a third
    # machine: the same.
    back = {**record, "machine": record["of"], "of": record["machine"]}
    (tmp_path / "slow-start" / onset.MACHINES_FILE).write_text(json.dumps({"verified": [back]}))
    assert onset.comparable(slow, runs) == (runs, 0)
    third = onset.machine_name({**MACHINE, "cpu_flags": "ghi"})
    chain = [{**record, "machine": third}, {**record, "machine": third, "of": record["machine"]}]
    (tmp_path / "slow-start" / onset.MACHINES_FILE).write_text(json.dumps({"verified": chain}))
    assert onset.comparable(slow, runs) == (runs, 0)
    (tmp_path / "slow-start" / onset.MACHINES_FILE).write_text(json.dumps({"verified": [{**record, "alike": False}]}))
    assert onset.comparable(slow, runs)[1] == 1
    assert "torch 2.13.0 was not shown to compute as X (flags abc)" in onset_report.provenance_line(slow, runs, 1)


def test_the_study_refuses_another_commit_or_an_unverified_machine(tmp_path, monkeypatch):
    slow = onset.question_stage("slow-start", DESIGN)
    monkeypatch.setattr(type(slow), "summaries", property(lambda self: tmp_path / self.name))
    first = _summary(slow, "none", 101, _curve(10), {900: 1, 1200: 1})
    path = tmp_path / "slow-start" / slow.relpath(slow.runs()[0])
    path.parent.mkdir(parents=True)
    path.with_suffix(".json").write_text(json.dumps(first))
    monkeypatch.setattr(onset, "machine_record", lambda: dict(MACHINE))
    monkeypatch.setattr(onset, "code_commit", lambda: "c0ffee")
    onset.check_here(slow)  # the runs' machine and commit: nothing to say
    monkeypatch.setattr(onset, "code_commit", lambda: "beef")
    with pytest.raises(StudyError, match="commit c0ffee; this checkout is beef.*git worktree add"):
        onset.check_here(slow)
    monkeypatch.setattr(onset, "code_commit", lambda: "c0ffee")
    monkeypatch.setattr(onset, "machine_record", lambda: {**MACHINE, "cpu_model": "Y"})
    with pytest.raises(StudyError, match="not shown to compute alike.*--verify-machine"):
        onset.check_here(slow)
    # Shown alike through a third machine: the machine the report counts is the machine the study accepts.
    here, home, third = (
        onset.machine_name(m) for m in ({**MACHINE, "cpu_model": "Y"}, MACHINE, {**MACHINE, "cpu_model": "Z"})
    )
    chain = [{"machine": third, "of": home, "alike": True}, {"machine": third, "of": here, "alike": True}]
    (tmp_path / "slow-start" / onset.MACHINES_FILE).write_text(json.dumps({"verified": chain}))
    onset.check_here(slow)
    assert onset.alike_machines(slow, home) == {home, here, third}


def test_every_committed_onset_run_was_made_with_the_commands_onset_json_gives_it():
    for name in onset.QUESTIONS:
        stage = onset.question_stage(name, DESIGN)
        runs = {(r.cell.name, r.arm, r.seed): r for r in stage.runs()}
        for key, s in stage.load_summaries().items():
            run = runs[key]
            expected = [stage.train_command(run), *(stage.decode_command(run, p) for p in stage.points)]
            assert s["commands"] == [shown(c) for c in expected], key
            assert s["steps"] == stage.steps and s["loss_digest"]["steps"] == DESIGN["verify_steps"]
            assert not s["commit"].endswith("-dirty"), key


def test_the_design_states_the_exploratory_medians_and_rescues_guard_from_the_pilot():
    # onset.json's prompted_by: none 700, filter-25 550, guard 475, zclip 525 (medians of the family's exits).
    exits = onset_stats.exploratory_exits(DESIGN["slow-start"]["plateau"], DESIGN["slow-start"]["steps"])
    medians = {arm: sorted(x)[4:6] for arm, x in exits.items()}
    stated = {"none": 700, "filter-25": 550, "guard": 475, "zclip": 525}
    assert {arm: sum(m) / 2 for arm, m in medians.items()} == stated
    # The report's "what prompted it" table, rendered from the family's summaries, gives the same medians.
    from studies.regime.family import family_stage

    family = family_stage()
    slow = DESIGN["slow-start"]
    rows = onset_report.prompted_by(family, family.load_summaries(), slow["plateau"], slow["steps"])
    medians_shown = {row.split(" | ")[0].strip("| `"): row.split(" | ")[-1].strip(" |") for row in rows[4:8]}
    assert medians_shown == {arm: f"{m:,}" for arm, m in stated.items()}
    pilot = Path(onset.__file__).parent / "summaries" / "pilot" / "lr-x10.clean"
    norms = [json.loads((pilot / f"seed-{s}.json").read_text())["grad_norm"]["median"] for s in (42, 43)]
    assert float(f"{4 * sum(norms) / 2:.2g}") == 540 and DESIGN["rescue"]["arms"]["guard"] == "clip-grad-norm=540"


def test_verify_machine_retrains_the_first_run_and_records_whether_its_loss_digest_agrees(tmp_path, monkeypatch):
    from studies.regime.stage import loss_digest

    monkeypatch.setattr(onset.Stage, "summaries", property(lambda self: tmp_path / self.name))
    series = [(s, 0.44 - s / 1e4) for s in range(1, 400)]
    slow = onset.question_stage("slow-start", DESIGN)
    first = _summary(slow, "none", 101, _curve(10), {900: 1, 1200: 1})
    first["loss_digest"]["sha256"] = loss_digest(series, DESIGN["verify_steps"])
    path = tmp_path / "slow-start" / f"{slow.relpath(slow.runs()[0])}.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(first))
    here = {**MACHINE, "cpu_flags": "def"}
    ran: List[List[str]] = []
    monkeypatch.setattr(onset, "machine_record", lambda: dict(here))
    monkeypatch.setattr(onset, "code_commit", lambda: "c0ffee")
    monkeypatch.setattr(onset, "run_command", lambda cmd, cwd, what, shown: ran.append(cmd))
    monkeypatch.setattr(onset, "read_scalars", lambda folder: {onset.TB_TAGS.loss: series})
    (record,) = onset.verify_machine(DESIGN)  # rescue has no run: nothing to verify there
    flags = dict(zip(ran[0][2::2], ran[0][3::2]))
    assert flags["--max-batches"] == "300" and flags["--seed"] == "101" and "verify-machine" in flags["--exp-dir"]
    assert (
        record["alike"]
        and record["machine"] == onset.machine_name(here)
        and record["of"] == "X (flags abc), 2 threads, torch 2.13.0"
    )
    saved = json.loads((tmp_path / "slow-start" / onset.MACHINES_FILE).read_text())["verified"]
    assert saved == [record]
    assert onset.verify_machine(DESIGN) == []  # shown alike already: nothing retrained
    assert len(ran) == 1
    # Another machine whose loss differs at one step is recorded as not alike.
    here["cpu_flags"] = "ghi"
    series[5] = (series[5][0], series[5][1] + 1e-7)
    (other,) = onset.verify_machine(DESIGN)
    assert not other["alike"]
    monkeypatch.setattr(onset, "code_commit", lambda: "beef")
    here["cpu_flags"] = "jkl"
    with pytest.raises(StudyError, match="commit c0ffee, this checkout is beef"):
        onset.verify_machine(DESIGN)
