"""Replays with controls, without training: which events are replayed (the largest, windows inside the run and
not overlapping), the matched start of branch (d), branch (a)'s check against the run at every step, the
per-layer second moments over multi-element tensors, events of a seed averaged before the interval, and the
uniform filter of branch (e) (the library's GradientFilter in mode uniform) against hand-worked factors."""

import math
import statistics

import pytest
import torch
from scipy import stats

from icefall_lite.nn.clip import GradientFilter
from studies.ablation import cli
from studies.ablation.arms import RunKey
from studies.ablation.replay import run as replay_run
from studies.ablation.replay.events import (
    FILTER,
    MATCHED_REFERENCE,
    NO_CONTROL,
    Event,
    Matched,
    ReplayKey,
    choose_replays,
    matched_start,
    matched_starts,
)
from studies.ablation.replay.result import (
    Branch,
    ReplayResult,
    layer_of,
    layer_ratios,
    parameter_layout,
    read_replay_summaries,
    reproduction,
)
from studies.ablation.replay.run import replay_plan, run_checkpoint
from studies.ablation.replay.tables import control_measures, over_seeds
from studies.ablation.runs import RunResult
from studies.ablation.settings import CONFIG_FILE


def _run(ratios, steps, warm_end=10, loss=None):
    """A none run: per step the largest max/median (one layer), and an objective."""
    loss = loss or {s: 1.0 + 0.001 * s for s in range(1, steps + 1)}
    filters = {(0, "max_over_median"): [(s, ratios.get(s, 2.0)) for s in range(1, steps + 1)]}
    scalars = {
        "simple_loss": [(s, 0.0) for s in range(1, steps + 1)],
        "pruned_loss": sorted(loss.items()),
        "grad_norm": [(s, 1.0) for s in range(1, steps + 1)],
    }
    return RunResult(RunKey("digits", "none", 42), {}, scalars, filters, warm_end=warm_end)


def test_the_largest_events_with_windows_inside_the_run_and_apart():
    # Events over 25 in a 260-step run: 12 (30x), 40 (90x), 60 (50x), 150 (80x), 195 (99x); step 5 (500x) is
    # before warm-up. With 100-step windows 195's would end at 294, past the run; 60's (59, 159] and 12's
    # (11, 111] overlap 40's (39, 139].
    run = _run({12: 30.0, 40: 90.0, 60: 50.0, 150: 80.0, 195: 99.0, 5: 500.0}, 260)
    assert choose_replays(run, 25.0, 100, 5) == [(39, Event(40, 0, 90.0)), (149, Event(150, 0, 80.0))]
    assert choose_replays(run, 25.0, 100, 1) == [(39, Event(40, 0, 90.0))], "the largest first"
    # With 20-step windows none overlaps; four of them: the largest four, in step order.
    assert [e.step for _, e in choose_replays(run, 25.0, 20, 4)] == [40, 60, 150, 195]
    assert choose_replays(run, 100.0, 20, 5) == [], "the 500x step is before warm-up"


def test_the_matched_start_is_the_nearest_checkpoint_without_an_outlier():
    # Checkpoints every 50; event window (139, 239]. Candidates after warm-up (100) whose window (c, c + 100]
    # does not overlap it and fits in 400 steps: 100? no, |100 - 139| < 100; 50 is before warm-up; 250, 300.
    # Step 251 has 7x (over 5): 250 is out, 300 is next.
    run = _run({140: 80.0, 251: 7.0, 301: 3.0}, 400, warm_end=100)
    assert matched_start(run, 139, 100, 50, 5.0) == Matched(300, 3.0)
    assert matched_start(run, 139, 100, 50, 10.0) == Matched(250, 7.0)
    assert matched_start(_run({}, 150, warm_end=100), 100, 100, 50, 5.0) is None


def test_matched_windows_of_one_run_are_apart_from_every_event_and_from_each_other():
    # Checkpoints every 50, 100-step windows, a 1,000-step run; the first step after every candidate start has
    # an outlier (7x) but after 200 and 400 (2x). A window (c, c + 100] overlaps another (o, o + 100] when
    # |c - o| < 100.
    clean = {201: 2.0, 401: 2.0}
    run = _run({s: clean.get(s, 7.0) for s in range(101, 1000, 50)}, 1000, warm_end=100)
    # Alone, the events from 699 and from 799 both take 400, the nearest clean start clear of their own window.
    assert matched_start(run, 699, 100, 50, 5.0) == matched_start(run, 799, 100, 50, 5.0) == Matched(400, 2.0)
    # Together they may not share a window: the larger event chooses first and keeps 400, the other gets 200.
    small, large = (699, Event(700, 0, 30.0)), (799, Event(800, 0, 90.0))
    assert matched_starts(run, [small, large], 100, 50, 5.0) == [Matched(200, 2.0), Matched(400, 2.0)]
    small, large = (699, Event(700, 0, 90.0)), (799, Event(800, 0, 30.0))
    assert matched_starts(run, [small, large], 100, 50, 5.0) == [Matched(400, 2.0), Matched(200, 2.0)]
    assert matched_start(run, 799, 100, 50, 5.0, taken=[350]) == Matched(200, 2.0), "(350, 450] overlaps 400's"
    # Every replayed event's window is taken too: from 449, 400 overlaps its own window, so it takes 200; then
    # 699 finds 400 inside 449's window and 200 taken, and has no branch (d).
    replays = [(449, Event(450, 0, 90.0)), (699, Event(700, 0, 30.0))]
    assert matched_starts(run, replays, 100, 50, 5.0) == [Matched(200, 2.0), None]


def test_branch_a_is_checked_at_every_step_of_the_window():
    run = _run({}, 200)
    objective = run.objective()

    def replay(series, start=100, steps=50):
        branches = {NO_CONTROL: Branch(series, [], {}, 0.0, 1.0)}
        return ReplayResult(ReplayKey("digits", 42, start), Event(start + 1, 0, 30.0), steps, branches)

    window = [(s, v) for s, v in objective if 100 < s <= 150]
    assert reproduction(replay(window), run).every_step
    changed = [(s, v * (1.001 if s == 120 else 1.0)) for s, v in window]
    assert reproduction(replay(changed), run).describe() == "NO: differs at 1 of 50 steps"
    past = [(s, v) for s, v in objective if 180 < s] + [(s, 1.0) for s in range(201, 231)]
    r = reproduction(replay(past, start=180), run)
    assert not r.every_step and r.describe() == "not checked at every step: the run has 20 of the 50 (all equal)"


def test_layer_ratios_leave_out_one_element_tensors():
    tensors = [
        ("encoder.encoder.layers.0.lstm.weight_ih_l0", 1024),
        ("encoder.encoder.layers.0.lstm.weight_ih_l0_scale", 1),
        ("encoder.encoder.layers.0.feed_forward.0.weight", 512),
        ("encoder.encoder.layers.1.lstm.weight_ih_l0", 1024),
        ("encoder.encoder_embed.out.weight", 100),
        ("joiner.output_linear.weight", 300),
    ]
    none = [4.0, 1000.0, 2.0, 3.0, 1.0, 5.0]
    filt = [2.0, 1.0, 1.0, 3.0, 2.0, float("nan")]
    assert layer_ratios(tensors, none, filt) == {
        "encoder layer 0": (4.0 + 2.0) / (2.0 + 1.0),  # the 1000x log-scale left out
        "encoder layer 1": 1.0,
        "encoder embedding": 0.5,
    }
    assert layer_ratios(tensors, none[:-1], filt) == {}, "lists that do not match the tensors"
    assert [layer_of(n) for n, _ in tensors[-3:]] == ["encoder layer 1", "encoder embedding", "joiner"]


def test_the_default_models_layout_has_the_one_element_log_scales():
    layout = parameter_layout([])
    assert len(layout) == 108
    singles = [name for name, n in layout if n == 1]
    # 8 in the embedding, 9 per encoder layer (8 log-scales and BasicNorm's eps) x 4, 2 in the decoder, 6 in
    # the joiner, 4 in the simple projections.
    assert len(singles) == 8 + 9 * 4 + 2 + 6 + 4 and all(
        name.endswith(("_scale", ".scale", ".eps")) for name in singles
    )


def _replay(seed, start, none_loss, filter_loss, none_wer, filter_wer):
    steps = 20
    window = range(start + 1, start + steps + 1)
    key = ("greedy_search", "test-other")
    branches = {
        NO_CONTROL: Branch([(s, none_loss) for s in window], [], {key: none_wer}, 0.0, 1.0),
        FILTER: Branch([(s, filter_loss) for s in window], [], {key: filter_wer}, 0.1, 1.0),
    }
    return ReplayResult(ReplayKey("digits", seed, start), Event(start + 1, 0, 30.0), steps, branches)


def test_events_of_a_seed_are_averaged_before_the_interval():
    # Seed 42: two events, loss differences -0.3 and -0.1 (mean -0.2); seed 43: -0.4; seed 44: -0.3.
    replays = [
        _replay(42, 20, 1.0, 0.7, 10.0, 9.0),
        _replay(42, 60, 1.0, 0.9, 10.0, 11.0),
        _replay(43, 20, 1.0, 0.6, 10.0, 8.0),
        _replay(44, 20, 1.0, 0.7, 10.0, 10.0),
    ]
    originals = {("digits", seed): _run({}, 200, loss={s: 1.0 for s in range(1, 201)}) for seed in (42, 43, 44)}
    measures = control_measures(replays, originals, ["greedy_search"])[FILTER]
    assert len(measures.window_loss) == 4
    d = over_seeds(measures.window_loss)
    means = [-0.2, -0.4, -0.3]
    assert d.n == 3 and d.mean == pytest.approx(statistics.mean(means))
    half = stats.t.ppf(0.975, 2) * statistics.stdev(means) / math.sqrt(3)
    assert d.high == pytest.approx(d.mean + half)
    wer = over_seeds(measures.wer[("greedy_search", "test-other")])
    assert wer.mean == pytest.approx(statistics.mean([0.0, -2.0, 0.0]))
    # A replay whose branch (a) does not reproduce its run is left out.
    originals[("digits", 43)] = _run({}, 200, loss={s: 2.0 for s in range(1, 201)})
    assert over_seeds(control_measures(replays, originals, ["greedy_search"])[FILTER].window_loss).n == 2


def test_the_references_levels_and_branch_ds_distance_from_its_event():
    from studies.ablation.arms import STUDY, Thresholds
    from studies.ablation.report.answer import reference_sentence
    from studies.ablation.report.common import ReportSetup

    def replay(seed, start, loss, wers, matched_start):
        window = range(start + 1, start + 21)
        end_wers = {("greedy_search", "test-clean"): wers[0], ("greedy_search", "test-other"): wers[1]}
        reference = {("greedy_search", "test-clean"): 4.0, ("greedy_search", "test-other"): 20.0}
        branches = {
            NO_CONTROL: Branch([(s, loss) for s in window], [], end_wers, 0.0, 1.0),
            MATCHED_REFERENCE: Branch([(s, 2.0) for s in window], [], reference, math.nan, math.nan),
        }
        key = ReplayKey("digits", seed, start)
        return ReplayResult(key, Event(start + 1, 0, 30.0), 20, branches, matched=Matched(matched_start, 2.0))

    # Seed 42: (a) at loss 1.0 and 0.8 (mean 0.9), seed 43: 0.6; over seeds 0.75. Test-other 10 and 12 (11), 8:
    # 9.5; test-clean 1 and 2 (1.5), 3: 2.25. Branch (d) starts 100, 340 and 50 steps from its event's.
    replays = [
        replay(42, 20, 1.0, (1.0, 10.0), 120),
        replay(42, 60, 0.8, (2.0, 12.0), 400),
        replay(43, 20, 0.6, (3.0, 8.0), 70),
    ]
    loss_42 = {s: 0.8 if 60 < s <= 80 else 1.0 for s in range(1, 201)}
    originals = {
        ("digits", 42): _run({}, 200, loss=loss_42),
        ("digits", 43): _run({}, 200, loss={s: 0.6 for s in range(1, 201)}),
    }
    setup = ReportSetup("cmd", STUDY, "s", {"round": STUDY.round}, Thresholds(), ["greedy_search"], 10, "d", "m")
    assert reference_sentence(replays, originals, setup) == (
        "The references, each the mean over seeds of its events' mean: (a) over the events' windows, loss 0.7500, "
        "greedy test-clean/test-other 2.25 / 9.50; the run over (d)'s windows, loss 2.0000, greedy "
        "test-clean/test-other 4.00 / 20.00. (d)'s window starts 50 to 340 steps from its event's (the nearest "
        "checkpoint step whose next step has every layer under 5x the batch median, its window overlapping no other "
        "replay's), at another point of training than (c). A window's end is decoded from its last checkpoint alone "
        "(`--avg 1`, no averaged model), unlike the runs (`--avg 2 --use-averaged-model true`)."
    )
    # A replay whose (a) does not reproduce its run is left out of the levels (seed 43's run at 0.7 now).
    originals[("digits", 43)] = _run({}, 200, loss={s: 0.7 for s in range(1, 201)})
    assert (
        "(a) over the events' windows, loss 0.9000, greedy test-clean/test-other 1.50 / 11.00;"
        in reference_sentence(replays, originals, setup)
    )


# --------------------------------------------------------------------------
# Branch (e): the uniform filter
# --------------------------------------------------------------------------


def _grads(module, x, w, upstream_x, upstream_w):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    y, v = module(x, w)
    ((y * upstream_x).sum() + (v * upstream_w).sum()).backward()
    return x.grad, w.grad, module.stats.as_dict()


def test_the_uniform_filter_applies_the_filters_mean_factor_to_every_sequence():
    torch.manual_seed(0)
    x, w = torch.randn(7, 5, 3), torch.randn(4, 3)
    upstream = torch.randn(7, 5, 3)
    upstream[:, 2] *= 300.0  # an outlier sequence
    upstream_w = torch.randn(4, 3)
    threshold = 4.0
    filt_x, filt_w, filt_stats = _grads(GradientFilter(1, threshold), x, w, upstream, upstream_w)
    uni_x, uni_w, uni_stats = _grads(GradientFilter(1, threshold, mode="uniform"), x, w, upstream, upstream_w)
    # By hand: n_b, c = threshold x median(n), factors c / (c + n_b).
    n = upstream.square().mean(dim=(0, 2)).sqrt()
    c = threshold * n.median()
    factors = c / (c + n)
    assert torch.allclose(uni_x, upstream * factors.mean(), rtol=1e-6)
    assert torch.allclose(uni_w, upstream_w / (1 + n.mean() / c), rtol=1e-6)
    # Against the library's filter: per sequence it scales by the factors (capping the outlier), its mean is
    # the uniform scale; the parameter gradients are scaled alike.
    per_sequence = (filt_x / upstream).mean(dim=(0, 2))
    assert torch.allclose(per_sequence, factors, rtol=1e-5)
    assert per_sequence[2] < 0.05 and per_sequence.mean() == pytest.approx(float(factors.mean()), rel=1e-5)
    assert torch.allclose(uni_w, filt_w, rtol=1e-6)
    assert uni_stats == pytest.approx(filt_stats)
    assert uni_stats["fraction_filtered"] == pytest.approx(0.2), (
        "one sequence of five above the cutoff (not capped here)"
    )


def test_replays_are_planned_seed_by_seed_up_to_the_total(tmp_path):
    """At most --replays-per-seed events per seed, in seed order, until --replay-events are planned; each with
    its matched start."""
    from studies.ablation.runs import write_summary
    from studies.runner import write_json_atomic

    summaries = tmp_path / "summaries"
    write_json_atomic(summaries / CONFIG_FILE, {"conditions": {"digits": {"bpe_model": "bpe.model"}}})
    events = {42: {150: 40.0, 400: 30.0, 700: 50.0}, 43: {300: 80.0}, 44: {500: 60.0}}
    for seed, ratios in events.items():
        run = _run(ratios, 1200, warm_end=100)
        run.key = RunKey("digits", "none", seed)
        write_summary(summaries, run)
    parser = cli.get_parser()
    args = [
        "--results-dir",
        str(tmp_path),
        "--summaries",
        "summaries",
        "--replay-events",
        "3",
        "--work-dir",
        str(tmp_path),
    ]
    s = cli.resolve_settings(parser, parser.parse_args(args), need_data=False)
    plan = {seed: replay_plan(s, "digits", seed) for seed in (42, 43, 44)}
    # Seed 42: its two largest (700: 50x, 150: 40x); seed 43: the one left; seed 44: none (3 planned).
    assert [(k.start, e.step) for k, e, _ in plan[42]] == [(149, 150), (699, 700)]
    assert [(k.start, e.step) for k, e, _ in plan[43]] == [(299, 300)] and plan[44] == []
    # Branch (d): the nearest checkpoint (every 50) whose window does not overlap the event's and whose first
    # step has no outlier: for the event window (149, 249], 250.
    assert plan[42][0][2] == Matched(250, 2.0)


def test_a_finished_replay_keeps_its_summary_and_drops_its_checkpoints_only_when_the_batches_agree(tmp_path):
    """finish_replay: same batches in every branch -> summary written, checkpoints gone; a branch that saw
    another batch -> summary still written (the report shows it), StudyError naming it, checkpoints kept."""
    from types import SimpleNamespace

    from studies.ablation.replay.run import finish_replay
    from studies.ablation.runs import WALL_FILE
    from studies.runner import StudyError, write_json_atomic

    key = ReplayKey("digits", 42, 10)
    s = SimpleNamespace(summaries=tmp_path / "runs", run_dir=lambda k: tmp_path / "exp" / k.relpath)

    def result(filter_digests):
        window = [(11, 1.0), (12, 1.0)]
        branches = {
            NO_CONTROL: Branch(window, [(11, 1.5), (12, 2.5)], {}, 0.0, 1.0),
            FILTER: Branch(window, filter_digests, {}, 0.1, 1.0),
        }
        checkpoint = tmp_path / "exp" / key.relpath / FILTER / "checkpoint-12.pt"
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        checkpoint.write_bytes(b"x")
        return ReplayResult(key, Event(11, 0, 30.0), 2, branches), checkpoint

    done, checkpoint = result([(11, 1.5), (12, 2.5)])
    for branch, wall in ((NO_CONTROL, {"train": 60.0, "decode/greedy_search": 10.0}), (FILTER, {"train": 70.5})):
        write_json_atomic(tmp_path / "exp" / key.relpath / branch / WALL_FILE, wall)
    finished = finish_replay(s, done)
    assert not checkpoint.exists()
    assert finished.wall_s == {"train": 130.5, "decode/greedy_search": 10.0}
    read = read_replay_summaries(s.summaries, "digits")[0]
    assert read.identical_batches and read.wall_s == finished.wall_s

    differs, checkpoint = result([(11, 1.5), (12, 3.5)])
    with pytest.raises(StudyError, match=r"digits/replays/seed-42-from-10: the branches saw other batches"):
        finish_replay(s, differs)
    assert checkpoint.exists() and not read_replay_summaries(s.summaries, "digits")[0].identical_batches


def test_a_retrained_checkpoint_lists_the_command_that_retrains_it_once(tmp_path, monkeypatch):
    """run_checkpoint: the run's own checkpoint adds no command; one gone from the run comes from
    ``none/seed-<s>-retrained`` with train.py to that step listed (once, also when an earlier replay made it),
    and is checked against the run every time it is used (a study stopped by a failed check leaves it)."""
    from studies.runner import write_json_atomic

    summaries = tmp_path / "summaries"
    write_json_atomic(summaries / CONFIG_FILE, {"conditions": {"digits": {"bpe_model": "bpe.model"}}})
    parser = cli.get_parser()
    args = ["--results-dir", str(tmp_path), "--summaries", "summaries", "--work-dir", str(tmp_path)]
    args += ["--exp-root", str(tmp_path / "exp")]
    s = cli.resolve_settings(parser, parser.parse_args(args), need_data=False)
    own = s.run_dir(RunKey("digits", "none", 42)) / "checkpoint-500.pt"
    own.parent.mkdir(parents=True)
    own.write_bytes(b"x")
    redo = s.exp_root / "digits" / "none" / "seed-42-retrained" / "checkpoint-600.pt"
    redo.parent.mkdir(parents=True)
    redo.write_bytes(b"x")

    checked = []
    monkeypatch.setattr(replay_run, "check_retrained", lambda s, key, folder, step: checked.append((folder, step)))
    commands = []
    assert run_checkpoint(s, "digits", 42, 500, commands) == own and commands == [] and checked == []
    assert run_checkpoint(s, "digits", 42, 600, commands) == redo
    assert run_checkpoint(s, "digits", 42, 600, commands) == redo
    assert len(commands) == 1 and checked == [(redo.parent, 600)] * 2
    words = commands[0].split()
    assert words[words.index("--exp-dir") + 1].endswith("digits/none/seed-42-retrained")
    assert words[words.index("--max-batches") + 1] == "600" and words[words.index("--seed") + 1] == "42"
    assert "--start-batch" not in words
