"""The figures the ablation report's prose states, each checked against a hand-worked example."""

from __future__ import annotations

import math
import statistics

import pytest
from scipy import stats

from studies.stats.power import effect_for_power, minimum_detectable_effect, paired_t_power


def test_minimum_detectable_effect_is_the_spread_times_the_standardised_effect():
    # Differences 1, 2, 3: sd 1. With 3 pairs at alpha 0.05 the effect reaching power 0.8 is d; the minimum
    # detectable effect at sd 1 is d points, at sd 2 twice that.
    sd = statistics.stdev([1.0, 2.0, 3.0])
    assert sd == 1.0
    d = effect_for_power(3, 0.05, 0.8)
    assert paired_t_power(d, 3, 0.05) == pytest.approx(0.8, abs=1e-9)
    assert minimum_detectable_effect(sd, 3, 0.05, 0.8) == pytest.approx(d)
    assert minimum_detectable_effect(2.0, 3, 0.05, 0.8) == pytest.approx(2 * d)


def test_minimum_detectable_effect_by_hand_at_many_pairs():
    # With many pairs the noncentral t is nearly normal: effect ~ (z_{1-a/2} + z_{power}) / sqrt(n).
    n, sd = 400, 1.5
    by_hand = sd * (stats.norm.ppf(0.975) + stats.norm.ppf(0.8)) / math.sqrt(n)
    assert minimum_detectable_effect(sd, n, 0.05, 0.8) == pytest.approx(by_hand, rel=0.01)


def test_icefall_gain_as_a_share_of_its_baseline_scaled_to_the_baseline_here():
    from studies.ablation.report.answer import relative_gain_here

    # -0.2 of 10 is -2%; -2% of 5 is -0.1.
    relative, here = relative_gain_here(-0.2, 10.0, 5.0)
    assert relative == pytest.approx(-0.02) and here == pytest.approx(-0.1)


def test_pairs_needed_at_a_textbook_effect():
    from studies.stats.power import pairs_for_power

    # The paired t at d = 0.5, alpha 0.05 two-sided, power 0.8 needs 34 pairs (Cohen's tables; G*Power).
    assert pairs_for_power(0.5, 0.05, 0.8) == 34


def _run(arm: str, seed: int, wer: float, flags: str, computes_as=None):
    from studies.ablation.records import RunKey, RunResult

    machine = {"cpu_model": "EPYC", "cpu_flags": flags, "threads": "2"}
    return RunResult(RunKey("digits", arm, seed), {("g", "o"): wer}, {}, machine=machine, computes_as=computes_as)


def test_pairs_joining_two_flag_digests_linked_by_the_check_are_kept_and_counted():
    from studies.ablation.pairing import pair_runs

    linked_as = "EPYC (flags aaa, 2 threads)"
    arm = [_run("f", 1, 10.0, "aaa"), _run("f", 2, 11.0, "bbb", linked_as), _run("f", 3, 12.0, "ccc")]
    base = [_run("n", 1, 9.0, "aaa"), _run("n", 2, 9.5, "aaa"), _run("n", 3, 10.0, "aaa")]
    pairing = pair_runs(arm, base, lambda r: r.wer[("g", "o")])
    # Seed 1: one digest; seed 2: two digests the check links (kept, counted); seed 3: two digests unlinked (out).
    assert pairing.differences == {1: 1.0, 2: 1.5}
    assert pairing.linked == [2] and pairing.straddling == [3]


def test_a_difference_without_the_linked_seeds():
    from studies.ablation.family import FamilyComparison, FamilyRow
    from studies.ablation.pairing import Pairing
    from studies.ablation.report.landscape import without_seeds
    from studies.stats.paired import SignedRank

    # Differences 1, 2, 3 and (seed 4, linked) 10: without seed 4, mean 2, sd 1, half-width t(0.975, 2) / sqrt(3).
    pairing = Pairing({1: 1.0, 2: 2.0, 3: 3.0, 4: 10.0}, {1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0}, linked=[4])
    row = FamilyRow(FamilyComparison("f", "n"), pairing, None, SignedRank(0, 0.0, math.nan))
    d = without_seeds(row, [4], 0.95)
    half = 4.302652729911275 / math.sqrt(3)
    assert d.n == 3 and d.mean == pytest.approx(2.0)
    assert (d.low, d.high) == (pytest.approx(2.0 - half), pytest.approx(2.0 + half))


def test_welch_difference_by_hand():
    from studies.stats.paired import welch_difference

    # a = 1, 2, 3 (var 1), b = 4, 5, 6, 7 (var 5/3): difference -3.5, standard error sqrt(1/3 + 5/12) = sqrt(0.75),
    # Welch's df 0.75^2 / ((1/3)^2 / 2 + (5/12)^2 / 3).
    se = math.sqrt(0.75)
    df = 0.75**2 / ((1 / 3) ** 2 / 2 + (5 / 12) ** 2 / 3)
    half = stats.t.ppf(0.975, df) * se
    d = welch_difference([1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0])
    assert d.mean == pytest.approx(-3.5) and d.n == 3
    assert (d.low, d.high) == (pytest.approx(-3.5 - half), pytest.approx(-3.5 + half))
    assert d.p == pytest.approx(2 * stats.t.cdf(-3.5 / se, df))


def test_spread_and_pairing_by_hand():
    from studies.ablation.family import FamilyComparison, FamilyRow
    from studies.ablation.pairing import Pairing
    from studies.ablation.report.landscape import spread_and_pairing
    from studies.stats.paired import SignedRank

    # arm 1, 2, 3 against baseline 0, 0, 1: differences 1, 2, 2 (sd sqrt(1/3)); Pearson: the cross-deviation sum
    # 1 over sqrt(2/3) x sqrt(2) = sqrt(3) / 2.
    row = FamilyRow(
        FamilyComparison("f", "n"),
        Pairing({1: 1.0, 2: 2.0, 3: 3.0}, {1: 0.0, 2: 0.0, 3: 1.0}),
        None,
        SignedRank(0, 0, 0),
    )
    sd, r, n = spread_and_pairing(row)
    assert n == 3 and sd == pytest.approx(math.sqrt(1 / 3)) and r == pytest.approx(math.sqrt(3) / 2)


def test_acting_percent_is_the_mean_over_runs_of_the_steps_it_acted_on():
    from studies.ablation.arms import Thresholds, make_arms
    from studies.ablation.report.landscape import acting_percent

    zclip = {a.name: a for a in make_arms(Thresholds())}["zclip-z-threshold"]
    # Clip scale below 1 at 1 of 2 steps (50%) and at 2 of 2 (100%): 75%.
    a, b = _run("zclip-z-threshold", 1, 0.0, "x"), _run("zclip-z-threshold", 2, 0.0, "x")
    a.scalars = {"clip_scale": [(1, 1.0), (2, 0.5)]}
    b.scalars = {"clip_scale": [(1, 0.5), (2, 0.5)]}
    assert acting_percent([a, b], zclip) == pytest.approx(75.0)


def test_still_improving_counts_by_hand():
    from studies.ablation.report.depth import still_improving

    m = ("g", "o")
    a, b, c = _run("n", 1, 0.0, "x"), _run("n", 2, 0.0, "x"), _run("n", 3, 0.0, "x")
    # a: WER 10 -> 9 (improved), loss 0.5 (step 1000) -> 0.4 (1800): fell. b: WER 9 -> 9.5, loss 0.3 -> 0.35.
    # c: decoded at 1800 only, left out.
    a.wer_at = {1200: {m: 10.0}, 1800: {m: 9.0}}
    b.wer_at = {1200: {m: 9.0}, 1800: {m: 9.5}}
    c.wer_at = {1800: {m: 5.0}}
    a.scalars = {"valid_loss": [(1000, 0.5), (1500, 0.45), (1800, 0.4)]}
    b.scalars = {"valid_loss": [(1000, 0.3), (1800, 0.35)]}
    assert still_improving([a, b, c], m, 1200, 1800) == (2, 1, 1)


def test_interaction_caveats_by_hand():
    from types import SimpleNamespace

    from studies.ablation.family import FamilyComparison
    from studies.ablation.report.depth import interaction_caveats

    m = ("g", "o")
    config = SimpleNamespace(
        confidence=0.95,
        family=[FamilyComparison("f", "n")],
        condition="d4",
        steps=1800,
        depth_condition="d12",
        depth_budget=SimpleNamespace(steps=2700),
        metric=m,
    )
    # Deep effects -1, -3 (seeds 1, 2); shallow effects 0, 1, 2 (seeds 1-3): all three shallow pairs have mean
    # 1 [1 -/+ t(0.975, 2) / sqrt(3)]; unpaired, -2 - 1 = -3.
    deep, shallow = {1: -1.0, 2: -3.0}, {1: 0.0, 2: 1.0, 3: 2.0}
    # At 1,800 the deep runs: filter - none +1 at seed 1, +3 at seed 2: minus shallow 0, 1 -> 1, 2: mean 1.5.
    runs = []
    for seed, (f, n) in {1: (11.0, 10.0), 2: (13.0, 10.0)}.items():
        for arm, wer in (("f", f), ("n", n)):
            r = _run(arm, seed, 0.0, "x")
            r.key = type(r.key)("d12", arm, seed)
            r.wer_at = {1800: {m: wer}}
            runs.append(r)
    text = interaction_caveats(runs, config, deep, shallow, [1, 2])
    half = stats.t.ppf(0.975, 2) / math.sqrt(3)
    assert f"over all its 3 pairs `f` − `n` is +1.00 [{1 - half:+.2f}, {1 + half:+.2f}]" in text
    assert "Welch's t): -3.00 95% interval" in text
    half2 = stats.t.ppf(0.975, 1) * statistics.stdev([1.0, 2.0]) / math.sqrt(2)
    assert f"over the 2 seeds both have: +1.50 95% interval [{1.5 - half2:+.2f}, {1.5 + half2:+.2f}]" in text


def test_the_headline_without_its_linked_pairs_by_hand():
    from types import SimpleNamespace

    from studies.ablation.family import FamilyComparison, FamilyRow
    from studies.ablation.pairing import Pairing
    from studies.ablation.report.answer import without_linked
    from studies.stats.paired import SignedRank

    # Differences 1, 2, 3 and (seed 4, linked) 10: without it mean 2, half-width t(0.975, 2) / sqrt(3).
    pairing = Pairing({1: 1.0, 2: 2.0, 3: 3.0, 4: 10.0}, {1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0}, linked=[4])
    row = FamilyRow(FamilyComparison("f", "n"), pairing, None, SignedRank(0, 0.0, math.nan))
    half = stats.t.ppf(0.975, 2) / math.sqrt(3)
    assert without_linked(row, SimpleNamespace(confidence=0.95)) == (
        f"; without the 1 pair joining two CPU flag digests (seed 4, the family section), +2.00 "
        f"[{2 - half:+.2f}, {2 + half:+.2f}], 3 pairs"
    )


def test_depth_budget_check_says_how_many_deep_runs_still_improved():
    # Counted here from the committed summaries' own WER tables (not through the report's code).
    import json
    from pathlib import Path

    study = Path(__file__).resolve().parents[1] / "studies" / "ablation"
    root = study / "summaries" / "round-2" / "digits-12"
    improved = n = 0
    for path in root.glob("*/seed-*.json"):
        at = {(s, t): w for s, _, t, w in json.loads(path.read_text())["wer_at"]}
        if (1800, "test-other") in at and (2700, "test-other") in at:
            n += 1
            improved += at[(2700, "test-other")] < at[(1800, "test-other")]
    assert n == 20
    text = (study / "README.md").read_text()
    assert f"Of the {n} runs of `digits-12` decoded at 1800 and 2700 steps, {improved} still improved" in text
    assert "The budget was kept on one seed's +2.01 (the pilot, 2700 to 4100 steps)" in text
