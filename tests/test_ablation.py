"""The gradient-control ablation: its statistics (spikes after warm-up, divergence, spread over seeds,
per-layer outliers, descriptive paired differences on one CPU model) against hand-worked series, the arms'
train.py flags, and lstm_transducer_stateless/ablation.py end to end on the tiny corpus (the report's table
checked against the averaged decodings' wer-summary files, checkpoints and raw TensorBoard events it came
from; the CPU model recorded; checkpoints pruned; the observing filter; plots; a rerun that skips finished
runs and resumes a cut-off one; a rerun with other settings refused; a replayed event whose five branches see
the same batches, branch (a) reproducing the run exactly)."""

import dataclasses
import hashlib
import json
import math
import re
import shlex
import shutil
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import matplotlib.image
import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

from conftest import RECIPE, REPO, TINY_MODEL, recipe_env
from icefall_lite.nn.scaling import ScaledLSTM
from icefall_lite.train.checkpoint import load_checkpoint_file
from icefall_lite.train.rules import DESTS
from icefall_lite.train.tb_tags import TB_TAGS
from studies.ablation import cli, execute, plan
from studies.ablation.arms import (
    CONDITIONS,
    CONTROLS,
    OBSERVE,
    STUDY,
    Arm,
    Plan,
    RunKey,
    Thresholds,
    flag_of,
    make_arms,
    same_controls,
    select,
)
from studies.ablation.arms import (
    arm as new_arm,
)
from studies.ablation.cli import STUDY_DIR
from studies.ablation.compare import format_comparisons, paired_comparisons
from studies.ablation.cpus import Reproduction, computes_as, first_difference, read_reproductions, write_reproduction
from studies.ablation.execute import (
    decode_command,
    kept_checkpoints,
    pilot_conditions,
    run_done,
    run_pilot,
    train_command,
    train_once,
)
from studies.ablation.family import Budget
from studies.ablation.metrics import (
    SPIKE_MIN_WINDOW,
    Spread,
    diverged,
    format_table,
    loss_spikes,
    outlier_rows,
    outlier_steps,
    plateau_exit,
    range_cell,
    steps_filtered,
)
from studies.ablation.pairing import cpu_name, cpu_of, pair_runs
from studies.ablation.plan import pairs_here, run_plan, runs_on_other_cpus
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
from studies.ablation.replay.result import ReplayResult, reproduction
from studies.ablation.replay.run import check_retrained, run_replay, train_segments
from studies.ablation.report.common import cpu_sentence
from studies.ablation.report.write import (
    REPORT,
    finished_results,
    gather_report,
    held_date_and_machine,
    render,
    write_report,
)
from studies.ablation.runs import (
    CPU_FILE,
    WALL_FILE,
    RunResult,
    cpu_time_recorded,
    read_summary,
    wall_time_kept,
    write_summary,
)
from studies.ablation.settings import CONFIG_FILE, TRAINED_MARKER, VERIFY_DIR, check_config
from studies.ablation.verify import verify_cpu
from studies.runner import StudyError, cpu_flags_digest, cpu_model, machine_record

ABLATION = RECIPE / "lstm_transducer_stateless" / "ablation.py"
ARMS = ["none", "grad-filter-threshold", "clip-grad-value"]  # the tiny run's arms, in table order
SEEDS = [42, 43]
STEPS = 6
WARM = 1  # --model-warm-step of the tiny runs: full loss weights from step 2
CUT_OFF = RunKey("digits", "grad-filter-threshold", 43)
SUMMARIES = cli.get_parser().get_default("summaries")  # the run summaries' folder in --results-dir
POINTS = (4, 6)  # a third of 6 steps (2) has fewer than --avg 2 checkpoints before it: dropped


# --------------------------------------------------------------------------
# Statistics, against hand-worked series
# --------------------------------------------------------------------------


# The primary set's arms, in table order (family.json's, under their flag names).
PRIMARY_ARMS = (
    "none",
    "clip-grad-norm",
    "clip-grad-norm-1000",
    "grad-filter-threshold",
    "grad-filter-threshold+clip-grad-norm",
    "clip-grad-norm-relative",
    "clip-grad-norm-relative-5",
)


def test_loss_spikes_count_after_warm_up_against_the_median_before():
    steady = [(i, 1.0 + 0.01 * (i % 3)) for i in range(1, 81)]
    assert loss_spikes(steady, start=20) == 0
    spiky = dict(steady)
    spiky[10] = 50.0  # before the end of warm-up: not counted, and not in any window
    spiky[25] = 9.0  # only 4 steps after warm-up before it (fewer than 10): not counted
    spiky[55] = 2.5  # median of the (up to 50) steps after warm-up before it is 1.01: 2.5 > 2.02
    spiky[57] = 2.0  # 2.0 < 2.02: not a spike
    spiky[58] = float("nan")
    assert loss_spikes(sorted(spiky.items()), start=20, window=50) == 2
    assert loss_spikes(sorted(spiky.items()), start=0, window=50) == 3, "from step 1: step 25 counts too"


def _spikes_oracle(loss, start, factor, window):
    """loss_spikes as it was: the median of each step's window sorted afresh (statistics.median)."""
    xs = [v for step, v in loss if step > start]
    count = 0
    for i in range(SPIKE_MIN_WINDOW, len(xs)):
        before = [x for x in xs[max(0, i - window) : i] if math.isfinite(x)]
        if not math.isfinite(xs[i]) or (before and xs[i] > factor * statistics.median(before)):
            count += 1
    return count


def test_loss_spikes_sliding_median_counts_as_a_fresh_median_per_step():
    gen = np.random.default_rng(5)
    for trial in range(40):
        n = int(gen.integers(5, 400))
        values = np.exp(gen.normal(0.0, 0.6, n))  # heavy-ish tail: spikes at factor 2 do occur
        values[gen.random(n) < 0.03] = np.nan
        values[gen.random(n) < 0.01] = np.inf
        values[gen.random(n) < 0.2] = 1.0  # ties in the window
        loss = [(i + 1, float(v)) for i, v in enumerate(values)]
        start, window, factor = int(gen.integers(0, 30)), int(gen.integers(1, 80)), float(gen.uniform(1.2, 3.0))
        assert loss_spikes(loss, start, factor, window) == _spikes_oracle(loss, start, factor, window), trial


def test_diverged_compares_the_last_window_with_the_lowest():
    falling = [(i, 3.0 - 0.02 * i) for i in range(100)]
    assert not diverged(falling, 0, window=20)
    # Falls to 1.0, then climbs back to 2.0: the last 20-step mean (2.0) is over 1.5 x the lowest (1.0).
    climbing = [(i, 1.0) for i in range(40)] + [(i, 2.0) for i in range(40, 60)]
    assert diverged(climbing, 0, window=20)
    assert not diverged([(i, 1.0) for i in range(40)] + [(i, 1.4) for i in range(40, 60)], 0, window=20)
    assert diverged(falling, 1, window=20), "a skipped step counts"
    assert diverged(falling[:10] + [(10, float("inf"))], 0, window=20)


def test_spread():
    s = Spread.of([1.0, 2.0, 4.0, float("nan")])
    assert (s.mean, s.low, s.high, s.n) == (statistics.mean([1, 2, 4]), 1.0, 4.0, 3)
    assert s.std == pytest.approx(statistics.stdev([1.0, 2.0, 4.0]), rel=1e-12)
    assert s.cell(2) == "2.33 ± 1.53"
    assert Spread.of([5.0]).cell(2) == "5.00" and Spread.of([]).cell(2) == "-"


def _run(
    arm: str, seed: int, wer_clean: float, ratios: Dict[int, List[float]], fractions=None, warm_end: int = 0
) -> RunResult:
    """A finished run made by hand: per-layer max/median ratios per step, optional fraction filtered."""
    filters = {}
    for layer, xs in ratios.items():
        filters[(layer, "max_over_median")] = list(enumerate(xs, 1))
        filters[(layer, "fraction_filtered")] = list(enumerate((fractions or {}).get(layer, [0.0] * len(xs)), 1))
    steps = len(next(iter(ratios.values())))
    scalars = {
        "grad_norm": [(i, 1.0) for i in range(1, steps + 1)],
        "simple_loss": [(i, 1.2) for i in range(1, steps + 1)],
        "pruned_loss": [(i, 0.4) for i in range(1, steps + 1)],
        "valid_loss": [(steps, 0.5 + wer_clean / 1000)],
    }
    wer = {("greedy_search", "test-clean"): wer_clean, ("greedy_search", "test-other"): wer_clean + 10}
    return RunResult(RunKey("stress", arm, seed), wer, scalars, filters, warm_end=warm_end)


def test_outlier_rows_per_layer_top_first():
    runs = [
        _run("none", 1, 50.0, {0: [1, 30, 2, 2], 1: [1, 6, 1, 1]}),
        _run("none", 2, 50.0, {0: [2, 2, 11, 2], 1: [12, 1, 1, 1]}),
    ]
    rows = outlier_rows(runs, [5, 10, 25])
    assert [r["layer"] for r in rows] == [1, 0]
    top, bottom = rows
    # layer 1 over 8 steps: 1 6 1 1 12 1 1 1 -> above 5: 2, above 10: 1, above 25: 0
    assert (top["over 5"], top["over 10"], top["over 25"]) == (25.0, 12.5, 0.0)
    assert top["max"] == 12 and top["median"] == 1
    # layer 0: 1 30 2 2 2 2 11 2 -> above 5: 2, above 10: 2, above 25: 1; nearest-rank 99th percentile: 30
    assert (bottom["over 5"], bottom["over 10"], bottom["over 25"]) == (25.0, 25.0, 12.5)
    assert bottom["p99"] == 30 and bottom["median"] == 2
    # From warm_end 3 on, layer 0 has 2, 2 (seed 1) and 11, 2 (seed 2): above 10: 1 of 4, max 11.
    late = [
        _run("none", 1, 50.0, {0: [1, 30, 2, 2], 1: [1, 6, 1, 1]}, warm_end=3),
        _run("none", 2, 50.0, {0: [2, 2, 11, 2], 1: [12, 1, 1, 1]}, warm_end=3),
    ]
    bottom_late = outlier_rows(late, [10])[1]
    assert (bottom_late["over 10"], bottom_late["max"]) == (25.0, 11)
    # Steps after warm-up with some layer over 25x: 30x at step 2 counts from warm_end 2 (1 of steps 2-4),
    # not from 3.
    assert outlier_steps(late[0]) == 0.0
    assert outlier_steps(_run("none", 1, 50.0, {0: [1, 30, 2, 2], 1: [1, 6, 1, 1]}, warm_end=2)) == 1 / 3


def test_steps_filtered_counts_steps_where_any_layer_filtered():
    r = _run(
        "grad-filter-threshold",
        1,
        50.0,
        {0: [1, 1, 1, 1], 1: [1, 1, 1, 1]},
        fractions={0: [0.0, 0.1, 0.0, 0.0], 1: [0.0, 0.2, 0.3, 0.0]},
    )
    assert steps_filtered(r) == 0.5


def test_paired_comparisons_are_per_seed_and_on_one_cpu_model():
    arms = {a.name: a for a in make_arms(Thresholds())}
    flat = {0: [1.0] * 4}
    runs = (
        [_run("none", s, w, flat) for s, w in ((1, 60.0), (2, 62.0), (3, 61.0))]
        + [_run("grad-filter-threshold", s, w, flat) for s, w in ((1, 50.0), (2, 52.0), (3, 51.5))]
        + [_run("clip-grad-norm", s, w, flat) for s, w in ((1, 59.0), (2, 63.0), (3, 61.5))]
    )
    for r in runs:
        r.machine = {"cpu_model": "Intel Xeon", "torch": "2.13.0"}
    runs[-1].machine = {"cpu_model": "AMD EPYC", "torch": "2.13.0"}  # clip / seed 3: not paired with none's
    cs = {(c.arm, c.metric.header): c for c in paired_comparisons(runs, ["greedy_search"])}
    f = cs[("grad-filter-threshold", "greedy test-clean")]
    assert f.per_seed == {1: -10.0, 2: -10.0, 3: -9.5}
    diffs = [-10.0, -10.0, -9.5]
    sem = statistics.stdev(diffs) / math.sqrt(3)
    assert f.difference.mean == pytest.approx(statistics.mean(diffs), abs=1e-12)
    # t(0.975, df 2) = 4.302652729696 (tables)
    assert f.difference.high - f.difference.mean == pytest.approx(4.302652729696 * sem, rel=1e-9)
    c = cs[("clip-grad-norm", "greedy test-other")]
    assert c.per_seed == {1: -1.0, 2: 1.0} and c.pairing.straddling == [3]
    table = format_comparisons(list(cs.values()), arms)
    assert "| stress | clip_grad_norm 5 | greedy test-other | 2 | -1.00, +1.00 | +0.00 |" in table
    assert "Holm" not in table, "descriptions only: the tests are the family's"


def test_pairs_need_one_instruction_set_and_one_thread_count():
    # A virtual machine may name two CPU generations "AMD EPYC"; their flags (and a run's threads) tell them apart.
    none = [_run("none", s, 60.0 + s, {0: [1.0] * 4}) for s in (1, 2, 3)]
    guard = [_run("clip-grad-norm-1000", s, 59.0 + s, {0: [1.0] * 4}) for s in (1, 2, 3)]
    same = {"cpu_model": "AMD EPYC", "cpu_flags": "0123456789ab", "threads": "2", "torch": "2.13.0"}
    for r in none + guard:
        r.machine = dict(same)
    guard[1].machine["cpu_flags"] = "ba9876543210"
    guard[2].machine["threads"] = "1"
    pairing = pair_runs(guard, none, lambda r: r.wer[("greedy_search", "test-clean")])
    assert pairing.differences == {1: -1.0} and pairing.straddling == [2, 3]
    assert cpu_of(none[0]) == "AMD EPYC (flags 0123456789ab, 2 threads)"


def test_machine_record_digests_the_flags_order_free(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("model name\t: AMD EPYC\nflags\t\t: fpu sse avx512_bf16\n")
    b.write_text("model name\t: AMD EPYC\nflags\t\t: avx512_bf16 fpu  sse\n")
    expected = hashlib.sha256(b"avx512_bf16 fpu sse").hexdigest()[:12]
    assert cpu_flags_digest(a) == cpu_flags_digest(b) == expected
    assert cpu_flags_digest(tmp_path / "absent") == "unknown"
    assert set(machine_record()) == {"cpu_model", "cpu_flags", "threads", "torch"}


def test_runs_survive_their_summaries(tmp_path):
    r = _run("none", 7, 12.3456789, {0: [1.0, 30.0, 2.0, float("inf")], 1: [1.0, 2.0, 3.0, 4.0]}, warm_end=2)
    r.scalars["exp_avg_sq_jump"] = [(3, 55.76123456)]
    r.scalars["batch_digest"] = [(1, 16777215.0), (2, 12345678.0)]  # 24-bit digests: kept exactly
    r.machine = {"cpu_model": "AMD EPYC 7B13", "torch": "2.13.0+cpu"}
    r.wer_at = {2: {("greedy_search", "test-clean"): 40.0}, 4: dict(r.wer)}
    r.decoding = {"avg": 2, "use_averaged_model": True}
    r.commands = ["python train.py", "python decode.py"]
    r.cpu_s = {"train": 23.5}
    write_summary(tmp_path, r)
    back = read_summary(tmp_path, r.key)
    assert back.key == r.key and back.warm_end == 2 and back.wer == r.wer
    assert (back.machine, back.wer_at, back.decoding, back.commands) == (r.machine, r.wer_at, r.decoding, r.commands)
    assert back.cpu_s == {"train": 23.5}
    assert back.filter_series(0, "max_over_median")[1] == (2, 30.0)
    assert math.isinf(back.filter_series(0, "max_over_median")[3][1])
    assert back.series("exp_avg_sq_jump") == [(3, pytest.approx(55.76123, rel=1e-7))]
    assert back.series("batch_digest") == [(1, 16777215.0), (2, 12345678.0)]
    assert read_summary(tmp_path, RunKey("stress", "none", 8)) is None
    # A summary written before the machine and the decoding points were recorded reads back without them.
    old = json.loads((tmp_path / "stress/none/seed-7.json").read_text())
    for k in ("machine", "wer_at", "decoding", "commands", "cpu_s"):
        del old[k]
    (tmp_path / "stress/none/seed-7.json").write_text(json.dumps(old))
    back = read_summary(tmp_path, r.key)
    assert back.machine == {} and back.wer_at == {} and back.wer == r.wer and back.cpu_s == {}


def test_wall_time_is_kept_while_a_run_goes_and_survives_a_kill(tmp_path):
    # A study killed mid-run (SIGKILL: no finally runs) keeps the wall time flushed so far, not nothing.
    code = (
        "import sys, time; from pathlib import Path; from studies.ablation.runs import wall_time_kept\n"
        "with wall_time_kept(Path(sys.argv[1]), 'train', every_s=0.1):\n    time.sleep(60)\n"
    )
    start = time.time()
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO)
    wall_file = tmp_path / WALL_FILE
    try:
        while not (wall_file.exists() and json.loads(wall_file.read_text())["train"] >= 0.5):
            assert proc.poll() is None and time.time() - start < 30, "no wall time written while the block ran"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    kept = json.loads(wall_file.read_text())["train"]
    assert 0.5 <= kept <= time.time() - start
    # Finished normally: the rest is added at the end, to what earlier segments kept.
    before = time.time()
    with wall_time_kept(tmp_path, "train", every_s=0.1):
        time.sleep(0.35)
    assert kept + 0.35 <= json.loads(wall_file.read_text())["train"] <= kept + (time.time() - before)
    # The killed segment never counted its CPU time, so the phase's CPU time is incomplete and left out.
    assert json.loads((tmp_path / CPU_FILE).read_text())["train"]["started"] == 2
    assert json.loads((tmp_path / CPU_FILE).read_text())["train"]["ended"] == 1
    assert cpu_time_recorded(tmp_path) == {}


# A child that spins until its own CPU clock passes 0.3 s and prints that clock at its end.
_SPIN = "import time\nwhile time.process_time() < 0.3: pass\nprint(time.process_time())"


def test_cpu_time_of_the_blocks_children_is_recorded_when_every_segment_ends(tmp_path):
    reported = []
    for _ in range(2):  # two segments of one phase, both ending: their CPU times add up
        with wall_time_kept(tmp_path, "train", every_s=10):
            out = subprocess.run([sys.executable, "-c", _SPIN], capture_output=True, text=True, check=True)
        reported.append(float(out.stdout))
    recorded = cpu_time_recorded(tmp_path)["train"]
    # The OS's count for the child covers what its own clock saw, plus its exit (well under 0.5 s here).
    assert sum(reported) <= recorded <= sum(reported) + 0.5
    assert json.loads((tmp_path / CPU_FILE).read_text())["train"] == {"started": 2, "ended": 2, "s": recorded}
    # A phase with wall time from before CPU time was recorded stays incomplete after a full segment.
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / WALL_FILE).write_text(json.dumps({"train": 100.0}))
    with wall_time_kept(tmp_path / "old", "train", every_s=10):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert cpu_time_recorded(tmp_path / "old") == {}
    # A command that failed was waited for: its segment ends. Ctrl-C kills the child without waiting for it
    # (its CPU time is not counted yet): that segment stays open and the phase incomplete.
    with pytest.raises(StudyError):
        with wall_time_kept(tmp_path / "failed", "train", every_s=10):
            raise StudyError("training failed")
    assert json.loads((tmp_path / "failed" / CPU_FILE).read_text())["train"]["ended"] == 1
    with pytest.raises(KeyboardInterrupt):
        with wall_time_kept(tmp_path / "failed", "decode/greedy_search", every_s=10):
            raise KeyboardInterrupt
    assert set(cpu_time_recorded(tmp_path / "failed")) == {"train"}


def test_cpu_time_is_reported_only_for_runs_recorded_in_full():
    full = _run("none", 1, 0.0, {0: [1.0] * 4})
    full.wall_s = {"train": 1800.0, "decode/greedy_search": 36.0}
    full.cpu_s = {"train": 3492.0, "decode/greedy_search": 36.0}
    partial = _run("none", 2, 0.0, {0: [1.0] * 4})  # its decoding's CPU time was cut off
    partial.wall_s = {"train": 1800.0, "decode/greedy_search": 36.0}
    partial.cpu_s = {"train": 3492.0}
    old = _run("none", 3, 0.0, {0: [1.0] * 4})
    old.wall_s = {"train": 900.0}
    assert full.cpu_total_s == 3528.0 and partial.cpu_total_s is None and old.cpu_total_s is None
    # 3528 s = 0.98 h of CPU over 1836 s = 0.51 h of wall.
    assert cpu_sentence([full, partial, old]) == (
        "CPU time of the runs (user + system of their training and decoding processes), recorded in full for 1 "
        "of 3 runs (2 ran before it was recorded, or had a segment cut off): 0.98 h in the 0.51 h of wall time "
        "those runs recorded. "
    )
    assert cpu_sentence([full]).startswith(
        "CPU time of the runs (user + system of their training and decoding "
        "processes), recorded in full for 1 of 1 run: 0.98 h"
    )
    assert cpu_sentence([partial, old]) == ""


def test_format_table_cells():
    arms = {a.name: a for a in make_arms(Thresholds())}
    runs = [_run("none", s, w, {0: [1.0] * 4, 1: [3.0, 40.0, 2.0, 1.0]}) for s, w in ((1, 60.0), (2, 62.0), (3, 61.0))]
    # Seed 3's objective (0.5 simple + pruned) falls to 1.0 and climbs back to 2.0: diverged.
    runs[2].scalars["simple_loss"] = [(i, 1.0) for i in range(1, 41)] + [(i, 2.0) for i in range(41, 61)]
    runs[2].scalars["pruned_loss"] = [(i, 0.5) for i in range(1, 41)] + [(i, 1.0) for i in range(41, 61)]
    runs[1].scalars["valid_loss"] = [(4, float("inf"))]
    runs[2].scalars["valid_loss"] = [(4, 0.570)]
    header, sep, row = format_table(runs, arms, ["greedy_search"]).splitlines()
    cell = dict(zip((c.strip() for c in header.strip("|").split("|")), (c.strip() for c in row.strip("|").split("|"))))
    assert cell["condition"] == "stress" and cell["seeds"] == "1-3" and cell["steps"] == "4"
    assert cell["greedy test-clean"] == "61.00 ± 1.00" and cell["greedy test-other"] == "71.00 ± 1.00"
    assert cell["diverged runs"] == "1/3"
    assert cell["max seq grad / median"] == "40.0 [40.0, 40.0]", "heavy-tailed: median [smallest, largest]"
    # One seed far out moves the median not at all, where a mean would follow it.
    assert range_cell([3.0, float("nan"), 1.0, 1000.0], 1) == "3.0 [1.0, 1000.0] (n=3)"
    assert range_cell([2.0, 4.0], 0) == "3 [2, 4]" and range_cell([float("nan")], 1) == "-"
    assert cell["% steps filtered"] == "0.0 ± 0.0"
    assert cell["final train loss"] == "1.333 ± 0.577"  # 1.0 (0.5 x 1.2 + 0.4), 1.0, and 2.0 over the last 10 steps
    assert cell["valid loss"] == "0.565 ± 0.007 (n=2)"  # 0.560 and 0.570; seed 2's is not finite
    # Plateau exit: the objective is 1.0 throughout for seeds 1, 2 (never below 0.3) and seed 3.
    assert cell["plateau exit step (loss < 0.3)"] == "-"
    runs[0].scalars["pruned_loss"] = [(i, 0.4 if i < 3 else 0.0) for i in range(1, 5)]
    runs[0].scalars["simple_loss"] = [(i, 1.2 if i < 3 else 0.2) for i in range(1, 5)]
    # objective 1.0, 1.0, 0.1, 0.1: trailing 5-step means 1.0, 1.0, 0.7, 0.55 -> never below 0.3; window 2: 0.55,
    # then 0.1 at step 4.
    assert math.isnan(plateau_exit(runs[0])) and plateau_exit(runs[0], 0.3, 2) == 4.0


# --------------------------------------------------------------------------
# Arms
# --------------------------------------------------------------------------


def test_the_committed_report_is_the_committed_summaries_rendered():
    """studies/ablation/README.md is what the renderer makes of the committed run summaries, byte for byte: the
    same figures from the same runs, as `python -m studies.ablation --report-only` writes it (its date and
    machine kept; the default --results-dir and --summaries, which it names). The plots are not drawn here
    (matplotlib: slow); every plot it links is a committed file."""
    held = (STUDY_DIR / REPORT).read_text(encoding="utf-8")
    parser = cli.get_parser()
    s = cli.resolve_settings(parser, parser.parse_args([]), need_data=False)
    assert s.results_dir == STUDY_DIR and f"the runs' summaries are in `{SUMMARIES}/`" in held
    report = gather_report(s, cli.report_command(s, []), *held_date_and_machine(STUDY_DIR / REPORT))
    assert render(s, report) == held
    images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", held)
    assert len(images) >= 7 and all(name.startswith("plots/") and (STUDY_DIR / name).is_file() for name in images)


def test_a_sets_report_covers_the_whole_round_and_names_every_sets_command(tmp_path):
    """Run as --set depth, the report keeps the round's runs beside the deep condition's (not instead of them),
    and its commands are the primary one and each set with runs (the running one included), whichever set
    writes it, so re-rendering from the default invocation gives the same section."""
    parser = cli.get_parser()
    summaries = tmp_path / SUMMARIES
    for condition, arm in (("digits", "none"), ("digits-12", "none")):
        run = _run(arm, 42, 1.0, {0: [1.0, 2.0]})
        run.key = RunKey(condition, arm, 42)
        write_summary(summaries, run)
    bpe = {"bpe_model": "data/lang_bpe_30/bpe.model"}
    (summaries / CONFIG_FILE).write_text(json.dumps({"conditions": {"digits": bpe, "digits-12": bpe}}))
    deep = cli.resolve_settings(
        parser, parser.parse_args(["--results-dir", str(tmp_path), "--set", "depth"]), need_data=False
    )
    assert list(deep.conditions) == ["digits-12"]
    assert [r.key.condition for r in finished_results(deep)] == ["digits", "digits-12"], "table order"
    primary = cli.resolve_settings(parser, parser.parse_args(["--results-dir", str(tmp_path)]), need_data=False)
    # The budget is checked on the round's condition and on the deep one (the pilot of each set that has one).
    assert pilot_conditions(deep) == ["digits-12"] and pilot_conditions(primary) == ["digits"]
    expected = (
        "./lstm_transducer_stateless/ablation.py --num-seeds 2\n"
        "./lstm_transducer_stateless/ablation.py --num-seeds 2 --set depth"
    )
    assert cli.report_command(deep, ["--set", "depth", "--num-seeds", "2"]) == expected
    assert cli.report_command(primary, ["--num-seeds", "2"]) == expected
    # The deep condition has its own budget and decoding points (family.json's depth.budget); a run made before
    # the budget grew is not done (it trains on), and the stored settings accept the grown budget, not a shrunk one.
    assert deep.conditions["digits-12"].steps == 2700 and deep.points_of("digits-12") == [600, 1200, 1800, 2700]
    assert primary.points_of("digits") == [600, 1200, 1800]
    assert not run_done(deep, RunKey("digits-12", "none", 42))
    assert run_done(deep, RunKey("digits-12", "none", 42), steps=2)
    deep.exp_root = primary.exp_root = tmp_path / "exp"

    def stored_as(steps, flags=None):
        stored = deep.stored_config()
        stored["conditions"]["digits-12"]["steps"] = steps
        stored["conditions"]["digits-12"]["flags"] = flags or stored["conditions"]["digits-12"]["flags"]
        (summaries / CONFIG_FILE).write_text(json.dumps(stored))

    # digits-12 / none / 42 was decoded at 600, 1,200 and 1,800 (the 1,800-step budget's points).
    made = _run("none", 42, 1.0, {0: [1.0] * 1800})
    made.key = RunKey("digits-12", "none", 42)
    made.wer_at = {p: made.wer for p in (600, 1200, 1800)}
    write_summary(summaries, made)
    stored_as(1800)
    check_config(deep)
    assert json.loads((summaries / CONFIG_FILE).read_text()) == deep.stored_config()
    moved = {"digits-12": dataclasses.replace(deep.conditions["digits-12"], steps=3000)}
    refused = {
        "a shrunk budget": (3600, None, deep),
        "a grown budget with other flags": (1800, ["--base-lr", "0.01"], deep),
        # --steps 3000: its points (1,000 / 2,000 / 3,000) do not begin with the run's 600 / 1,200 / 1,800.
        "a grown budget that moves the decoding points": (1800, None, dataclasses.replace(deep, conditions=moved)),
    }
    for what, (steps, flags, s) in refused.items():
        stored_as(steps, flags)
        with pytest.raises(StudyError, match="condition digits-12: was "):
            check_config(s)
            pytest.fail(what)
    # The budget grows again (2,700 -> 4,100 with the earlier points kept): accepted, beside a replay's summary
    # (seed-<seed>-from-<step>.json, not a run's).
    (summaries / "digits-12" / "replays").mkdir()
    (summaries / "digits-12" / "replays" / "seed-42-from-1397.json").write_text("{}")
    later = dataclasses.replace(
        deep,
        config=dataclasses.replace(STUDY, depth_budget=Budget(4100, (600, 1200, 1800, 2700, 4100), STUDY.pilot)),
        conditions={"digits-12": dataclasses.replace(deep.conditions["digits-12"], steps=4100)},
    )
    stored_as(2700)
    check_config(later)
    assert json.loads((summaries / CONFIG_FILE).read_text())["conditions"]["digits-12"]["steps"] == 4100
    (summaries / "digits-12" / "none" / "seed-42.json").unlink()
    shutil.rmtree(summaries / "digits-12" / "replays")
    # The report pairs runs at their condition's budget (stored with the summaries) only: digits-12 / none at
    # 1,800 waits, named, left out.
    (summaries / CONFIG_FILE).write_text(json.dumps(deep.stored_config()))
    for condition in ("digits", "digits-12"):
        run = _run("none", 42, 1.0, {0: [1.0] * 1800})
        run.key = RunKey(condition, "none", 42)
        write_summary(summaries, run)
    assert write_report(primary, "cmd", "2026-11-27", "m") == tmp_path / "README.md"
    section = (tmp_path / "README.md").read_text()
    assert (
        "left out of every table until they train on (their set's command resumes them from their last checkpoint): "
        "digits-12/none/seed-42 (1800 of 2700)." in section
    )
    assert "Waiting to train on (above): 1 run of `digits-12`." in section
    assert "- **digits**: 1800 steps" in section and "- **digits-12**" not in section
    # --report-only writes it again from the summaries, no run, keeping its date and machine.
    write_report(deep, "cmd", "2026-11-27", "m")
    section = (tmp_path / "README.md").read_text()
    (tmp_path / "README.md").write_text(section.replace("```bash\ncmd\n```", "```bash\nan older command\n```"))
    assert cli.main(["--results-dir", str(tmp_path), "--set", "depth", "--report-only"]) == 0
    again = (tmp_path / "README.md").read_text()
    primary_command = shlex.join(["./lstm_transducer_stateless/ablation.py", "--results-dir", str(tmp_path)])
    commands = f"{primary_command}\n{primary_command} --set depth"  # the flags it was given, no --report-only
    assert again == section.replace("```bash\ncmd\n```", f"```bash\n{commands}\n```")
    assert held_date_and_machine(tmp_path / "README.md") == ("2026-11-27", "m")
    (summaries / "digits-12").rename(tmp_path / "elsewhere")
    assert cli.report_command(primary, ["--set=primary"]) == "./lstm_transducer_stateless/ablation.py"
    assert cli.report_command(deep, []).endswith("--set depth"), "the set running now"


def test_arms_set_every_control_and_switch_the_others_off():
    t = Thresholds(
        grad_filter_threshold=25,
        filter_sweep=(10, 5),
        clip_grad_norm=5,
        agc_clipping=0.08,
        clip_grad_value=0.1,
        error_clip=1e-4,
        clip_grad_norm_relative=2,
        relative_sweep=(5,),
        guard=1000,
    )
    arms = {a.name: a for a in make_arms(t)}
    assert list(arms) == [
        *PRIMARY_ARMS,
        "grad-filter-threshold-10",
        "grad-filter-threshold-5",
        "agc-clipping",
        "clip-grad-value",
        "error-clip",
        "grad-filter-mode-hard-mask",
        "zclip-z-threshold",
        "autoclip-percentile",
        "scaled-adam-clipping-scale",
        "recurrent-grad-clip",
    ]

    def flags(name):
        f = arms[name].train_flags()
        return dict(zip(f[::2], f[1::2]))

    # Every control train.py has, the filter observing and every other off (0), whatever controls are added.
    off = {flag_of(c): ("inf" if c == "grad_filter_threshold" else "0") for c in CONTROLS}
    assert len(off) == len(DESTS) >= 6
    assert flags("none") == off
    assert flags("grad-filter-threshold+clip-grad-norm") == {
        **off,
        "--grad-filter-threshold": "25",
        "--clip-grad-norm": "5",
    }
    # Each single-rule arm: its rule's flag at the arm's threshold, every other control off.
    single = {
        "clip-grad-norm-1000": {"--clip-grad-norm": "1000"},
        "grad-filter-threshold-5": {"--grad-filter-threshold": "5"},
        "clip-grad-norm-relative": {"--clip-grad-norm-relative": "2"},
        "clip-grad-norm-relative-5": {"--clip-grad-norm-relative": "5"},
        "agc-clipping": {"--agc-clipping": "0.08"},
        "clip-grad-value": {"--clip-grad-value": "0.1"},
        "error-clip": {"--error-clip": "0.0001"},
        "grad-filter-mode-hard-mask": {"--grad-filter-threshold": "25", "--grad-filter-mode": "hard-mask"},
        "zclip-z-threshold": {"--zclip-z-threshold": "2.5"},
        "autoclip-percentile": {"--autoclip-percentile": "10"},
        "scaled-adam-clipping-scale": {"--scaled-adam-clipping-scale": "2"},
        "recurrent-grad-clip": {"--recurrent-grad-clip": "30"},
    }
    assert {name: flags(name) for name in single} == {name: {**off, **on} for name, on in single.items()}
    filtering = [
        "grad-filter-threshold",
        "grad-filter-threshold+clip-grad-norm",
        "grad-filter-threshold-10",
        "grad-filter-threshold-5",
        "grad-filter-mode-hard-mask",
    ]
    assert [a.name for a in arms.values() if a.filter_on] == filtering
    with pytest.raises(ValueError, match="unknown control"):
        Arm("x", "x", (("clip_norm", 1.0),))
    # Flags recorded before a control existed mean it off; a different value is a different arm.
    old = ["--grad-filter-threshold", "inf", "--clip-grad-norm", "5"]
    assert same_controls(old, arms["clip-grad-norm"].train_flags())
    assert not same_controls(old, arms["clip-grad-norm-1000"].train_flags())
    plan = Plan(
        ["stress", "default"],
        [arms["none"], arms["grad-filter-threshold"]],
        {"none": [42, 43], "grad-filter-threshold": [42]},
    )
    assert [k.relpath for k in plan.runs] == [
        "stress/none/seed-42",
        "stress/grad-filter-threshold/seed-42",
        "default/none/seed-42",
        "default/grad-filter-threshold/seed-42",
        "stress/none/seed-43",
        "default/none/seed-43",
    ], "seed-major; an arm with fewer seeds drops out after its last"
    assert plan.all_seeds == [42, 43]
    with pytest.raises(ValueError, match="unknown arm.s. nope; known: none, clip"):
        select(["nope"], list(arms), "arm(s)")


def test_one_name_per_gradient_control():
    """Every gradient control has train.py's name everywhere: the arms set every flag of train.py's gradient
    control group (its --help lists them in one section, icefall's --grad-norm-threshold alias included), and
    ablation.py's threshold flags for the controls its arms use have train.py's names, with the Thresholds'
    defaults."""
    assert CONTROLS == DESTS and DESTS[0] == "grad_filter_threshold"
    t = Thresholds()
    parser = cli.get_parser()
    args = parser.parse_args([])
    assert set(cli.THRESHOLD_FLAGS) == set(CONTROLS) - {"clip_grad_norm_relative"}, "every control has its flag"
    assert {c: getattr(args, c) for c in cli.THRESHOLD_FLAGS} == {c: getattr(t, c) for c in cli.THRESHOLD_FLAGS}
    assert args.clip_grad_norm_relative == [t.clip_grad_norm_relative, *t.relative_sweep] == [2.0, 5.0]
    assert args.guard_clip_grad_norm == t.guard == STUDY.guard_clip_grad_norm
    assert args.filter_sweep == list(t.filter_sweep)
    study_flags = set(re.findall(r"(--[\w-]+)", parser.format_help()))  # --help lists every flag
    assert {flag_of(c) for c in CONTROLS} <= study_flags
    assert not study_flags & {"--relative-clip", "--agc-lambda", "--clip-value"}
    help_text = subprocess.run(
        [sys.executable, str(RECIPE / "lstm_transducer_stateless" / "train.py"), "--help"],
        capture_output=True,
        text=True,
        env={**recipe_env(), "COLUMNS": "200"},
        timeout=300,
    ).stdout
    sections = re.split(r"\n(?=\S[^\n]*:\n)", help_text)
    (gradient,) = [s for s in sections if s.startswith("gradient control:")]
    listed = set(re.findall(r"^  (--[\w-]+)", gradient, re.M))
    assert {flag_of(c) for c in CONTROLS} <= listed, "every control an arm sets is a train.py flag"
    assert "--grad-filter-threshold GRAD_FILTER_THRESHOLD, --grad-norm-threshold" in gradient
    (model,) = [s for s in sections if s.startswith("model:")]
    assert "--grad-filter-threshold" not in model and "--model-preset" in model


def test_observing_filter_leaves_every_gradient_unchanged():
    """threshold inf (the arms without the filter) must train exactly as no filter at all."""
    torch.manual_seed(3)
    observing = ScaledLSTM(6, 8, proj_size=4, grad_filter_threshold=OBSERVE)
    plain = ScaledLSTM(6, 8, proj_size=4, grad_filter_threshold=0)
    plain.load_state_dict(observing.state_dict())
    assert plain.grad_filter is None and observing.grad_filter is not None
    x = torch.randn(7, 5, 6)
    upstream = torch.randn(7, 5, 4)
    upstream[:, 2] *= 1e6  # an exploded sequence the observer must not touch
    for lstm in (observing, plain):
        out, _ = lstm(x)
        (out * upstream).sum().backward()
    for (name, p), q in zip(observing.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert observing.grad_filter.stats.as_dict()["fraction_filtered"] == 0.0
    assert observing.grad_filter.stats.as_dict()["max_over_median"] > 1.0


# --------------------------------------------------------------------------
# The tiny ablation, run twice
# --------------------------------------------------------------------------


def raw_scalars(tb_dir: Path, tag: str) -> Dict[int, float]:
    """{step: value} of ``tag`` from the raw event files, oldest first; a newer file (a resumed run)
    replaces the points from its own first point of ``tag`` on."""
    out: Dict[int, float] = {}
    for path in sorted(tb_dir.glob("events.out.tfevents.*"), key=lambda p: int(p.name.split(".")[3])):
        points = [
            (e.step, v.simple_value)
            for e in LegacyEventFileLoader(str(path)).Load()
            for v in e.summary.value
            if v.tag == tag
        ]
        if points:
            out = {step: value for step, value in out.items() if step < points[0][0]}
            out.update(points)
    return out


def parse_table(results_md: Path) -> Tuple[List[str], List[List[str]]]:
    """Header and rows of the per-arm table in the ablation's report."""
    section = results_md.read_text()
    start = "| condition | arm | seeds | steps |"
    table = section.split("\n\n" + start, 1)[1].split("\n\n", 1)[0]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in (start + table).splitlines()]
    return cells[0], cells[2:]


def wer_from_summary(res_dir: Path, test_set: str, iteration: int = STEPS) -> float:
    """The WER of decode.py's averaged decoding at ``iteration`` (``--avg 2 --use-averaged-model true``)."""
    (path,) = res_dir.glob(f"wer-summary-{test_set}-iter-{iteration}-avg-2-*-use-averaged-model.txt")
    header, row = path.read_text().splitlines()
    assert header == "settings\tWER"
    return float(row.split("\t")[1])


def train_log(run_dir: Path) -> str:
    return "\n".join(p.read_text() for p in sorted((run_dir / "log").glob("log-train-*")))


def png_size(path: Path) -> Tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def ablation_args(work: Path, out: Path, *extra: str) -> List[str]:
    return [
        sys.executable,
        str(ABLATION),
        "--work-dir",
        str(work),
        "--exp-root",
        str(out / "exp"),
        "--results-dir",
        str(out / "results"),
        "--conditions",
        "digits",
        "--arms",
        *ARMS,
        "--num-seeds",
        "2",
        "--steps",
        str(STEPS),
        "--max-duration",
        "30",
        "--model-warm-step",
        str(WARM),
        "--replay-events",
        "0",
        "--pilot",
        "skip",
        "--save-every-n",
        "1",
        "--avg",
        "2",
        "--average-period",
        "1",
        "--clip-grad-value",
        "0.01",
        "--model-args",
        shlex.join(TINY_MODEL),
        *extra,
    ]


def run_ablation(args: List[str]) -> subprocess.CompletedProcess:
    env = {**recipe_env(), "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)


def file_state(root: Path) -> Dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def ablation(tiny_data, tmp_path_factory):
    """First run; then one run is cut off (as if killed after its checkpoint at step 3) and the script rerun."""
    out = tmp_path_factory.mktemp("ablation")
    start = time.time()
    first = run_ablation(ablation_args(tiny_data, out))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    first_md = (out / "results" / "README.md").read_text()
    cut_off = out / "exp" / CUT_OFF.relpath
    finished_model = load_checkpoint_file(cut_off / f"checkpoint-{STEPS}.pt")["model"]
    kept = sorted(p.name for p in cut_off.glob("*.pt"))
    assert kept == ["checkpoint-4.pt", "checkpoint-6.pt"], "pruned to the pair of the last averaged decoding"
    # The state of the run killed after its checkpoint at step 3: that checkpoint (made again by the same
    # command, stopped at step 3), its logs and TensorBoard events, nothing from later.
    partial = subprocess.run(
        [
            sys.executable,
            str(RECIPE / "lstm_transducer_stateless" / "train.py"),
            "--exp-dir",
            str(out / "partial"),
            "--bpe-model",
            "data/lang_bpe_100/bpe.model",
            "--num-epochs",
            "100",
            "--max-batches",
            "3",
            "--seed",
            "43",
            "--max-duration",
            "30",
            "--num-workers",
            "0",
            "--save-every-n",
            "1",
            "--keep-last-k",
            "0",
            "--average-period",
            "1",
            *new_arm("GradientFilter 25", Thresholds(), grad_filter_threshold=25).train_flags(),
            *("--model-warm-step", str(WARM), *CONDITIONS["digits"].train_flags),
            *TINY_MODEL,
        ],
        cwd=tiny_data,
        capture_output=True,
        text=True,
        env={**recipe_env(), "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert partial.returncode == 0, partial.stderr[-3000:]
    for name in ("checkpoint-4.pt", f"checkpoint-{STEPS}.pt", "ablation-trained.json"):
        (cut_off / name).unlink()
    (out / "results" / SUMMARIES / f"{CUT_OFF.relpath}.json").unlink()
    shutil.rmtree(cut_off / "greedy_search")
    for name in ("checkpoint-2.pt", "checkpoint-3.pt"):  # the killed run had them (and 1, pruned at its end)
        shutil.copy(out / "partial" / name, cut_off / name)
    before = file_state(out / "exp")
    second = run_ablation(ablation_args(tiny_data, out))
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    return {
        "out": out,
        "first": first,
        "second": second,
        "first_md": first_md,
        "before": before,
        "finished_model": finished_model,
        "elapsed": time.time() - start,
    }


def test_table_rows_are_mean_and_spread_of_their_sources(ablation):
    out = ablation["out"]
    header, rows = parse_table(out / "results" / "README.md")
    assert header[:6] == ["condition", "arm", "seeds", "steps", "greedy test-clean", "greedy test-other"]
    assert [r[1] for r in rows] == ["no control (filter observing)", "GradientFilter 25", "clip by value 0.01"]
    for row, arm in zip(rows, ARMS):
        cell = dict(zip(header, row))
        assert cell["condition"] == "digits" and cell["seeds"] == "42-43" and cell["steps"] == str(STEPS)
        dirs = [out / "exp" / "digits" / arm / f"seed-{s}" for s in SEEDS]
        for test_set in ("test-clean", "test-other"):
            wers = [wer_from_summary(d / "greedy_search", test_set) for d in dirs]
            assert cell[f"greedy {test_set}"] == f"{statistics.mean(wers):.2f} ± {statistics.stdev(wers):.2f}"
            for seed, d in zip(SEEDS, dirs):
                summary = read_summary(out / "results" / SUMMARIES, RunKey("digits", arm, seed))
                assert sorted(summary.wer_at) == list(POINTS)
                for point in POINTS:
                    key = ("greedy_search", test_set)
                    assert summary.wer_at[point][key] == wer_from_summary(d / "greedy_search", test_set, point)
                assert summary.decoding == {"avg": 2, "use_averaged_model": True, "save_every_n": 1}
                assert summary.machine == machine_record()
                # Every segment ran to its end: the CPU time of training and decoding is in, phase by phase.
                assert set(summary.cpu_s) == set(summary.wall_s) and summary.cpu_s["train"] > 0
                assert sorted(p.name for p in d.glob("*.pt")) == ["checkpoint-4.pt", "checkpoint-6.pt"]
        valid = []
        for d in dirs:
            assert load_checkpoint_file(d / f"checkpoint-{STEPS}.pt")["batch_idx_train"] == STEPS
            valid.append(float(re.findall(r"Stopped by --max-batches .* validation: loss=([0-9.]+)", train_log(d))[-1]))
        mean, std = (float(x) for x in cell["valid loss"].split(" ± "))
        assert mean == pytest.approx(statistics.mean(valid), abs=2e-3)
        # Final train loss: 0.5 simple + pruned over the last tenth of the steps, at least 10 -> all 6 steps here.
        finals = []
        for d in dirs:
            simple, pruned = (raw_scalars(d / "tensorboard", f"train/{k}_loss") for k in ("simple", "pruned"))
            assert sorted(simple) == sorted(pruned) == list(range(1, STEPS + 1))
            finals.append(np.mean([0.5 * simple[i] + pruned[i] for i in simple]))
        assert cell["final train loss"] == f"{statistics.mean(finals):.3f} ± {statistics.stdev(finals):.3f}"


def test_arms_train_what_they_say_and_the_observer_never_filters(ablation):
    out = ablation["out"]
    expected = {
        "none": ("inf", "0.0", "0.0"),
        "grad-filter-threshold": ("25.0", "0.0", "0.0"),
        "clip-grad-value": ("inf", "0.01", "0.0"),
    }
    for arm, (threshold, value, clip) in expected.items():
        for seed in SEEDS:
            run_dir = out / "exp" / "digits" / arm / f"seed-{seed}"
            log = train_log(run_dir)
            assert re.search(rf"^\s+grad_filter_threshold: {threshold}$", log, re.M), (arm, log[:2000])
            assert re.search(rf"^\s+clip_grad_value: {value}$", log, re.M)
            assert re.search(rf"^\s+clip_grad_norm: {clip}$", log, re.M)
            assert re.search(rf"^\s+seed: {seed}$", log, re.M)
            wall = json.loads((run_dir / WALL_FILE).read_text())
            assert wall["train"] > 0 and all(wall[f"decode/{m}"] > 0 for m in ("greedy_search",)), wall
            fractions = raw_scalars(run_dir / "tensorboard", "grad_filter/layer0/fraction_filtered")
            ratios = raw_scalars(run_dir / "tensorboard", "grad_filter/layer0/max_over_median")
            assert sorted(fractions) == sorted(ratios) == list(range(1, STEPS + 1)), "every arm has the statistics"
            if threshold == "inf":
                assert set(fractions.values()) == {0.0}
                scales = raw_scalars(run_dir / "tensorboard", "grad_filter/layer0/param_scale")
                assert set(scales.values()) == {1.0}
    # Seeds differ; arms with the same seed start from the same weights and the same first batch.
    first_loss = {
        (arm, s): raw_scalars(out / "exp" / "digits" / arm / f"seed-{s}" / "tensorboard", "train/loss")[1]
        for arm in ARMS
        for s in SEEDS
    }
    assert first_loss[("none", 42)] == first_loss[("grad-filter-threshold", 42)] == first_loss[("clip-grad-value", 42)]
    assert first_loss[("none", 42)] != first_loss[("none", 43)]


def test_the_reports_sections_commands_and_plots(ablation):
    results = ablation["out"] / "results"
    text = (results / "README.md").read_text()
    assert re.search(r"Date: \d{4}-\d{2}-\d{2}\.", text)
    cpu = f"{cpu_model()} (flags {cpu_flags_digest()}, {machine_record()['threads']} threads)"
    assert f"CPU models of the summaries: {cpu}: {len(ARMS) * len(SEEDS)} run(s)/replay(s)." in text
    assert "./lstm_transducer_stateless/ablation.py --work-dir" in text
    assert "## Where the outliers arise (digits, arm `none`" in text
    assert (
        "| layer | max/median: median | 99th percentile | max | % steps over 5 | % steps over 10 | % steps over 25 |"
        in text
    )
    # icefall's published table beside the answer: 3.66 - 3.79 and 9.51 - 9.71.
    assert "| no filter | 3.79 | 9.71 |" in text and "| GradientFilter 25 − no filter | -0.13 | -0.20 |" in text
    assert "pull/558" in text
    # The family: filter - none has its 2 pairs, the arms that did not run none.
    assert re.search(r"^\| `grad-filter-threshold` − `none` \| 2 \| [+-]\d", text, re.M)
    assert "| `clip-grad-norm-1000` − `none` | 0 | - | - | - | - | - | not tested: 0 pair(s) |" in text
    assert "## WER at each decoding point" in text
    assert "greedy test-other at 4 | greedy test-clean at 6" in text
    commands = text.split("<summary>Every command")[1]
    runs = len(ARMS) * len(SEEDS)
    assert commands.count("lstm_transducer_stateless/train.py") == runs
    assert "--save-every-n 1 --keep-last-k 0 --average-period 1" in commands
    for point in POINTS:
        assert commands.count(f"--iter {point} --avg 2 --use-averaged-model true") == runs
    assert commands.count("(cd ") == (1 + len(POINTS)) * runs, "run in the data folder, shown from the recipe"
    images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", text)
    assert images == [
        f"plots/ablation-digits-{k}.png"
        for k in (
            "grad-norm",
            "max-over-median",
            "over-threshold",
            "filter-fraction",
            "train-loss",
            "wer-per-seed",
            "landscape-wer-per-seed",  # clip-grad-value's own figure, beside none
            "wer-curve-test-clean",
            "wer-curve-test-other",
            "steps-acting",  # clip-grad-value is a landscape arm
        )
    ]
    for name in images:
        width, height = png_size(results / name)
        assert width >= 400 and height >= 250, name
        pixels = matplotlib.image.imread(results / name)
        assert len(np.unique((pixels * 255).astype(np.uint8))) > 10, f"{name} looks blank"
    # Every table of the section has rows as wide as its header.
    from test_ablation_tables import assert_tables_well_formed

    # The family, the arms in the answer, icefall's table, WER at the decoding points, the arms, where the
    # outliers arise (per layer, per seed), the paired differences.
    assert assert_tables_well_formed(text) == 9 and "## The clipping landscape" in text  # value: a landscape arm


def test_outlier_table_from_the_observing_runs_raw_events(ablation):
    out = ablation["out"]
    text = (out / "results" / "README.md").read_text()
    table = text.split("| layer | max/median: median |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    rows = {int(r.strip("|").split("|")[0]): [c.strip() for c in r.strip("|").split("|")] for r in table}
    assert sorted(rows, reverse=True) == [int(r.strip("|").split("|")[0]) for r in table] == [1, 0], "top layer first"
    for layer, cells in rows.items():
        ratios = [
            v
            for s in SEEDS
            for step, v in raw_scalars(
                out / "exp" / "digits" / "none" / f"seed-{s}" / "tensorboard",
                f"grad_filter/layer{layer}/max_over_median",
            ).items()
            if step >= 2 * WARM
        ]
        assert len(ratios) == (STEPS - 2 * WARM + 1) * len(SEEDS)
        assert float(cells[3]) == pytest.approx(max(ratios), abs=0.051)
        for threshold, cell in zip((5, 10, 25), cells[4:]):
            assert cell == f"{100 * sum(r > threshold for r in ratios) / len(ratios):.2f}"


def test_commands_carry_the_condition_and_arm_flags(tiny_data, tmp_path):
    parser = cli.get_parser()
    args = parser.parse_args(
        [
            *("--work-dir", str(tiny_data), "--exp-root", str(tmp_path), "--set", "secondary"),
            *("--conditions", "stress", "--agc-clipping", "0.05"),
        ]
    )
    s = cli.resolve_settings(parser, args)
    assert [k.relpath for k in s.plan.runs[:2]] == ["stress/none/seed-42", "stress/clip-grad-norm/seed-42"]
    assert len(s.plan.runs) == 9 * 2
    key = RunKey("stress", "agc-clipping", 43)
    train = train_command(s, key)
    # A third of 300 steps (100) has 2 checkpoints before it (50, 100), fewer than --avg 2 + 1: dropped.
    assert s.decode_points(300) == [200, 300]
    decode = decode_command(s, "stress", s.run_dir(key), "greedy_search", s.decoding_of(300))
    stress = [
        "--num-encoder-layers",
        "8",
        "--encoder-dim",
        "128",
        "--rnn-hidden-size",
        "384",
        "--dim-feedforward",
        "512",
    ]
    joined_train, joined_decode = shlex.join(train), shlex.join(decode)
    assert shlex.join(stress) in joined_train and shlex.join(stress) in joined_decode
    assert "--base-lr 0.02" in joined_train and "--base-lr" not in joined_decode
    assert all(f in joined_train for f in ("--clip-grad-norm 0 ", "--clip-grad-value 0 ", "--agc-clipping 0.05 "))
    assert "--seed 43" in joined_train
    assert "--max-batches 300" in joined_train and "--iter 300 --avg 2 --use-averaged-model true" in joined_decode
    assert "--model-warm-step 100" in joined_train and "--keep-last-k 0" in joined_train
    # The primary set: family.json's arms, seeds per arm and replays.
    primary = cli.resolve_settings(parser, parser.parse_args(["--work-dir", str(tiny_data)]))
    names = list(PRIMARY_ARMS)
    assert [a.name for a in primary.plan.arms] == names
    assert {a: len(primary.plan.seeds[a]) for a in names} == STUDY.seeds_per_arm
    assert primary.plan.all_seeds == list(range(42, 59)) and len(primary.plan.runs) == 59
    assert [k.arm for k in primary.plan.runs if k.seed == 47] == ["none", "grad-filter-threshold"]
    assert (primary.replay_events, primary.replays_per_seed, primary.args.replay_steps) == (10, 2, 100)
    assert primary.decode_points(1800) == [600, 1200, 1800]
    none = shlex.join(train_command(primary, RunKey("digits", "none", 42)))
    assert "--keep-last-k 0" in none and "--save-every-n 50" in none and "--average-period 20" in none
    assert "--max-batches 1800" in none and "--max-duration 60" in none and "--model-warm-step 50" in none
    assert "--iter 600 --avg 2 --use-averaged-model true" in shlex.join(
        decode_command(primary, "digits", primary.run_dir(key), "greedy_search", primary.decoding_of(600))
    )
    assert "--clip-grad-norm 1000" in shlex.join(train_command(primary, RunKey("digits", "clip-grad-norm-1000", 42)))
    assert kept_checkpoints(primary, 1800) == [1700, 1800]
    # Averaging between checkpoints needs the budget and the window on multiples of the average period.
    with pytest.raises(SystemExit):
        cli.resolve_settings(parser, parser.parse_args(["--work-dir", str(tiny_data), "--steps", "1250"]))


def test_rerun_skips_finished_runs_and_resumes_the_cut_off_one(ablation):
    out, first, second = ablation["out"], ablation["first"], ablation["second"]
    n = len(ARMS) * len(SEEDS)
    assert first.stderr.count(": starting") == n
    assert "min left for" in first.stderr
    assert second.stderr.count("done earlier - skipped") == n - 1
    assert f"{CUT_OFF.relpath} (GradientFilter 25): starting" in second.stderr
    after = file_state(out / "exp")
    for path, mtime in ablation["before"].items():
        if not path.startswith(CUT_OFF.relpath):
            assert after.get(path) == mtime, f"{path} changed in the rerun"
    run_dir = out / "exp" / CUT_OFF.relpath
    assert re.search(r"Loading checkpoint \S*checkpoint-3\.pt", train_log(run_dir))
    resumed = load_checkpoint_file(run_dir / f"checkpoint-{STEPS}.pt")["model"]
    for name, value in ablation["finished_model"].items():
        assert torch.equal(value, resumed[name]), f"resumed run differs from the uninterrupted one in {name}"
    # The same table, but for the wall time of the resumed run.
    header, rows = parse_table(out / "results" / "README.md")
    first_md = out / "first-README.md"
    first_md.write_text(ablation["first_md"])
    _, first_rows = parse_table(first_md)
    wall = header.index("wall min")
    assert [r[:wall] for r in rows] == [r[:wall] for r in first_rows]


def test_rerun_with_other_settings_is_refused_and_list_shows_the_plan(ablation, tiny_data, isolated_logging, capsys):
    out = ablation["out"]
    args = ablation_args(tiny_data, out)[2:]
    args[args.index("--steps") + 1] = "8"
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert "was made with other settings (condition digits: was" in err and "'steps': 8" in err
    assert "use another --summaries or --results-dir" in err
    assert not list((out / "exp").rglob("checkpoint-8.pt"))
    args = ablation_args(tiny_data, out)[2:]
    args[args.index("--clip-grad-value") + 1] = "0.5"
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert re.search(
        r"clip-grad-value/seed-42 was trained with --grad-filter-threshold inf [^,]*--clip-grad-value 0\.01 ", err
    )
    assert re.search(r"but arm clip-grad-value is now --grad-filter-threshold inf [^;]*--clip-grad-value 0\.5 ", err)
    assert len(list((out / "exp").rglob("checkpoint-6.pt"))) == len(ARMS) * len(SEEDS)
    listing = subprocess.run(
        ablation_args(tiny_data, out, "--num-seeds", "3", "--list"),
        capture_output=True,
        text=True,
        env=recipe_env(),
        timeout=300,
    )
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert len(lines) == 3 * len(ARMS)
    assert sum("done" in line.split()[1] for line in lines) == 2 * len(ARMS)
    assert lines[-1].split()[:2] == ["digits/clip-grad-value/seed-44", "to"]


def test_bad_thresholds_and_arms_are_refused(tiny_data, tmp_path, capsys):
    """ablation.py's main (in this process: the script is its launcher) exits 2 naming the flag."""
    for extra, message in (
        (["--error-clip", "0"], "--error-clip: thresholds must be positive and finite"),
        (["--filter-sweep", "inf"], "--filter-sweep inf: thresholds must be positive"),
        (["--autoclip-percentile", "150"], "--autoclip-percentile 150: a percentile is at most 100"),
        (["--zclip-z-threshold", "-1"], "--zclip-z-threshold: thresholds must be positive"),
        (["--arms", "nope"], "unknown arm(s) nope"),
    ):
        args = ablation_args(tiny_data, tmp_path)[2:]
        args = args[: args.index("--arms")] + args[args.index("--num-seeds") :] + extra
        with pytest.raises(SystemExit) as exit_:
            cli.main(args)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err, err[-2000:]
    assert not (tmp_path / "exp").exists()
    assert math.isinf(OBSERVE)


def test_train_py_tensorboard_tags_round_trip_the_filter_statistics():
    """The reports read train.py's tags through its TB_TAGS table, filter tags included."""
    assert TB_TAGS.loss == "train/loss" and TB_TAGS.simple_loss == "train/simple_loss"
    tag = TB_TAGS.filter_tag(12, "max_over_median")
    assert tag == "grad_filter/layer12/max_over_median"
    assert TB_TAGS.parse_filter_tag(tag) == (12, "max_over_median")
    assert TB_TAGS.parse_filter_tag("grad_filter/layerx/fraction_filtered") is None
    assert TB_TAGS.parse_filter_tag(TB_TAGS.grad_norm) is None


def test_a_replay_trains_its_five_branches_on_the_same_batches(ablation, tiny_data, isolated_logging, monkeypatch):
    """A replay of an event at step 3 of the none run of seed 42 over a 2-step window (steps 3-4): the run kept
    only checkpoints 4 and 6 (no replays in the tiny set), so it is retrained to step 2; the branches from the
    event train steps 3 and 4 in two segments each; branch (d) starts at the run's checkpoint 4 (a matched
    step) and its reference is the run's checkpoint 6. The batch digests agree step by step; branch (a) ends
    bit-identical to the run; the filter (threshold 1.0001: any sequence above the median) acts; (b) and (c)
    share the event step and part after it; (e) scales without capping."""
    out = ablation["out"]
    # The branches' train.py runs inherit this environment; the original runs had one thread (run_ablation),
    # and bit-identical results need the same thread count.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    parser = cli.get_parser()
    args = ablation_args(tiny_data, out)[2:] + ["--grad-filter-threshold", "1.0001", "--replay-steps", "2"]
    s = cli.resolve_settings(parser, parser.parse_args(args))
    key = ReplayKey("digits", 42, 2)
    result = run_replay(s, key, Event(3, 0, 99.0), Matched(4, 1.5))
    assert (out / "exp" / "digits" / "none" / "seed-42-retrained" / "checkpoint-2.pt").is_file()
    assert not list((out / "exp" / key.relpath).rglob("*.pt")), "the replay's checkpoints go once it is summarised"
    b = result.branches
    assert set(b) == {NO_CONTROL, EVENT_ONLY, FILTER, UNIFORM, MATCHED, MATCHED_REFERENCE}
    for name in (NO_CONTROL, EVENT_ONLY, FILTER, UNIFORM):
        assert [step for step, _ in b[name].digests] == [3, 4], name
        assert b[name].digests == b[NO_CONTROL].digests
    assert len({d for _, d in b[NO_CONTROL].digests}) == 2
    assert [step for step, _ in b[MATCHED].digests] == [5, 6] == [step for step, _ in b[MATCHED_REFERENCE].digests]
    assert b[MATCHED].digests == b[MATCHED_REFERENCE].digests and result.identical_batches
    original = read_summary(out / "results" / SUMMARIES, RunKey("digits", "none", 42))
    assert reproduction(result, original).every_step
    assert b[MATCHED_REFERENCE].objective == [(st, v) for st, v in original.objective() if st in (5, 6)]
    # The filter acts on every step it is on; (b) only on the event step.
    assert b[FILTER].filtered == 1.0 and b[EVENT_ONLY].filtered == 0.5 and b[NO_CONTROL].filtered == 0.0
    assert b[MATCHED].filtered == 1.0
    # (b) and (c) are one branch up to the event step: the same loss there and the same second moments after it.
    assert b[EVENT_ONLY].objective[0] == b[FILTER].objective[0]
    assert b[EVENT_ONLY].second_moment_event == b[FILTER].second_moment_event
    assert b[EVENT_ONLY].second_moment != b[FILTER].second_moment
    # (e) scales uniformly: not the filter's update, not the unfiltered one.
    assert b[UNIFORM].second_moment_event != b[FILTER].second_moment_event
    assert b[UNIFORM].second_moment_event != b[NO_CONTROL].second_moment_event
    assert len(result.tensors) == len(b[NO_CONTROL].second_moment) == len(b[NO_CONTROL].second_moment_event)
    assert result.machine == machine_record()
    uniform_commands = [c for c in result.commands if "--grad-filter-mode uniform" in c]
    assert len(uniform_commands) == 2 and all("--grad-filter-threshold 1.0001" in c for c in uniform_commands)
    assert all("lstm_transducer_stateless/train.py" in c for c in uniform_commands), "plain train.py"
    # The summary reads back the same, and the report's replay tables come from it.
    path = out / "results" / SUMMARIES / f"{key.relpath}.json"
    back = ReplayResult.from_json(json.loads(path.read_text()))
    assert back.identical_batches and back.matched == Matched(4, 1.5) and back.tensors == result.tensors
    assert back.branches[UNIFORM].second_moment_event == b[UNIFORM].second_moment_event


def test_branch_a_ends_bit_identical_to_the_run(ablation, tiny_data, isolated_logging, monkeypatch):
    """Branch (a) of a replay from the run's own checkpoint 4 (kept), trained to step 6 in two segments: its
    weights at 6 equal the run's checkpoint 6 exactly (train.py's exact resume, the stop's validation
    included)."""
    out = ablation["out"]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    parser = cli.get_parser()
    s = cli.resolve_settings(parser, parser.parse_args(ablation_args(tiny_data, out)[2:] + ["--replay-steps", "2"]))
    key = ReplayKey("digits", 43, 4)
    branch = out / "exp" / key.relpath / NO_CONTROL
    run_dir = out / "exp" / "digits" / "none" / "seed-43"
    commands: List[str] = []
    train_segments(s, key, branch, run_dir / "checkpoint-4.pt", [("none", 5), ("none", 6)], "(a)", commands)
    original = load_checkpoint_file(run_dir / f"checkpoint-{STEPS}.pt")["model"]
    replayed = load_checkpoint_file(branch / f"checkpoint-{STEPS}.pt")["model"]
    assert all(torch.equal(original[k], replayed[k]) for k in original), "exact resume"
    assert len(commands) == 3 and commands[0].startswith("mkdir -p ")


def test_the_pilot_trains_decodes_and_judges_the_budget(ablation, tiny_data, isolated_logging, monkeypatch):
    """The pilot (family.json's budget.pilot, here scaled to the tiny runs: the budget 4 steps, the pilot 6):
    the none run of its seed in <exp-root>/pilot/, decoded at its points the way every run is, its summary in
    <summaries>/pilot/, and the rule applied to its WERs."""
    from studies.ablation.family import Pilot
    from studies.ablation.report.depth import pilot_section, pilot_verdict

    out = ablation["out"]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    parser = cli.get_parser()
    s = cli.resolve_settings(parser, parser.parse_args(ablation_args(tiny_data, out)[2:]))
    s.config = dataclasses.replace(s.config, steps=4, pilot=Pilot(42, STEPS, (4, STEPS), 100.0, 0.0))
    pilot = run_pilot(s, "digits")
    run_dir = out / "exp" / "pilot" / "digits" / "none" / "seed-42"
    assert sorted(pilot.wer_at) == [4, STEPS] and pilot.steps == STEPS
    for point in (4, STEPS):
        for test_set in ("test-clean", "test-other"):
            assert pilot.wer_at[point][("greedy_search", test_set)] == wer_from_summary(
                run_dir / "greedy_search", test_set, point
            )
    # The same seed and flags as the study's none / seed-42 run: the same weights, the same WER at its end.
    run = read_summary(out / "results" / SUMMARIES, RunKey("digits", "none", 42))
    assert pilot.wer_at[STEPS] == run.wer
    assert read_summary(out / "results" / SUMMARIES / "pilot", RunKey("digits", "none", 42)) is not None
    stands, text = pilot_verdict(pilot, s.config)
    assert stands is True and text.endswith("the budget of 4 steps stands.")
    strict = dataclasses.replace(s.config, pilot=Pilot(42, STEPS, (4, STEPS), 100.0, 101.0))
    stands, text = pilot_verdict(pilot, strict)
    assert stands is False and "does not stand: change budget.steps in studies/ablation/family.json" in text
    assert pilot_section(pilot, s.config)[0] == "## Pilot: the budget"
    assert run_pilot(s, "digits").wer_at == pilot.wer_at, "done earlier: read back"


def test_the_plan_replays_each_seeds_events_then_prunes_its_none_run(ablation, tiny_data, tmp_path, monkeypatch):
    """run_plan with replays on (a copy of the tiny study; every step after warm-up counts as an event at
    threshold 1.0001): the runs are done earlier and skipped, seed 42's replay follows its runs and is summarised,
    seed 43 has none (the total, 1, is reached: the order seed by seed is
    test_ablation_replay.test_replays_are_planned_seed_by_seed_up_to_the_total's); the none runs end pruned to
    their last averaging pair."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = ablation["out"]
    shutil.copytree(out / "exp", tmp_path / "exp")
    shutil.copytree(out / "results", tmp_path / "results")
    for retrained in (tmp_path / "exp").rglob("seed-*-retrained"):
        shutil.rmtree(retrained)
    for replays in [*(tmp_path / "exp").rglob("replays"), *(tmp_path / "results").rglob("replays")]:
        shutil.rmtree(replays)
    parser = cli.get_parser()
    args = ablation_args(tiny_data, tmp_path)[2:]
    args[args.index("--replay-events") + 1] = "1"
    # One step a branch (the two-segment branches are test_a_replay_trains_its_five_branches_on_the_same_batches'):
    # this test is about the plan, and each train.py run of a branch costs seconds.
    args += ["--replays-per-seed", "1", "--replay-steps", "1", "--grad-filter-threshold", "1.0001"]
    s = cli.resolve_settings(parser, parser.parse_args(args))
    made = run_plan(s, "test")
    assert made == 1, "every run done earlier; one replay, seed 42's"
    summaries = tmp_path / "results" / SUMMARIES / "digits" / "replays"
    replays = sorted(p.name for p in summaries.glob("*.json"))
    assert len(replays) == 1 and replays[0].startswith("seed-42-from-")
    for seed in SEEDS:
        none_dir = tmp_path / "exp" / "digits" / "none" / f"seed-{seed}"
        assert sorted(p.name for p in none_dir.glob("*.pt")) == ["checkpoint-4.pt", "checkpoint-6.pt"]
        assert not list((none_dir.parent / f"seed-{seed}-retrained").glob("*.pt"))
    text = (tmp_path / "results" / "README.md").read_text()
    assert "## Replayed outlier events, with controls" in text and "1 replays of 1 planned" in text
    # A replay whose branch (d) came from another start (an earlier rule's), with that start's commands: (d) and
    # its reference are made again where the plan puts them (from the none run retrained, its checkpoints being
    # pruned), the branches from the event kept, not trained again; the summary ends as the plan made it.
    before = {p.name: json.loads(p.read_text()) for p in summaries.glob("*.json")}
    name = next(name for name, r in before.items() if r["matched"] is not None)
    stale = json.loads((summaries / name).read_text())
    stale["matched"]["start"] += 2
    stale["branches"]["matched"]["objective"] = [[1, 9.0]]
    stale["commands"] = [c.replace("/matched", "/matched/old") for c in stale["commands"]]
    (summaries / name).write_text(json.dumps(stale))
    made_at = {p: p.stat().st_mtime_ns for p in (tmp_path / "exp").rglob("replays/*/none/ablation-trained.json")}
    assert len(made_at) == 1 and run_plan(s, "test") == 1
    after = {p.name: json.loads(p.read_text()) for p in summaries.glob("*.json")}
    # Made again: (d)'s time is added afresh, and a checkpoint it copies from the retrained run (the none run's
    # being pruned) follows the command that retrains to it.
    assert after[name]["wall_s"]["train"] > 0 and after[name]["wall_s"] != before[name]["wall_s"]
    commands = after[name]["commands"]
    copies = [re.search(r"-retrained/checkpoint-(\d+)\.pt", c) for c in commands]
    assert any(copies)
    for i, copy in enumerate(copies):
        if copy:
            assert any("-retrained --" in c and f"--max-batches {copy[1]} " in c for c in commands[:i])
    for d in (before, after):
        d[name].pop("wall_s")
        d[name]["commands"] = [c for c in d[name]["commands"] if "-retrained" not in c]
    assert after == before
    assert {p: p.stat().st_mtime_ns for p in made_at} == made_at, "branches from the event not trained again"
    assert not list((tmp_path / "exp").rglob("seed-*-retrained/*.pt"))


def test_a_budget_that_grew_trains_on_and_is_not_done(tmp_path, monkeypatch):
    """A run (the pilot) trained to 1,800 steps, then asked for 2,700: train.py runs again (it resumes from its
    newest checkpoint) and the summary of 1,800 steps does not count as done."""
    calls = []
    monkeypatch.setattr(execute, "run", lambda s, condition, cmd, what, log_dir: calls.append(cmd))
    exp_dir = tmp_path / "exp"
    exp_dir.mkdir()
    (exp_dir / TRAINED_MARKER).write_text('{"steps": 1800}')
    assert train_once(None, "digits", ["python", "train.py"], exp_dir, 1800, "pilot") is False and not calls
    assert train_once(None, "digits", ["python", "train.py"], exp_dir, 2700, "pilot") is True and len(calls) == 1
    assert json.loads((exp_dir / TRAINED_MARKER).read_text()) == {"steps": 2700}

    run = _run("none", 42, 1.0, {0: [1.0] * 1800})
    run.key = RunKey("digits", "none", 42)
    write_summary(tmp_path / "runs", run)
    s = dataclasses.make_dataclass("S", ["methods", "summaries"])(["greedy_search"], tmp_path / "runs")
    assert run_done(s, run.key, steps=1800) and not run_done(s, run.key, steps=2700)


def test_a_run_whose_seed_ran_on_another_cpu_is_skipped(ablation, tiny_data, tmp_path, monkeypatch):
    """Runs on two CPUs pair with none of each other's: run_plan makes a missing run only where no run of its
    condition and seed was made on another CPU (model, flags digest or threads), and skips the others with a
    warning rather than spend hours on runs that count for nothing; seeds with no runs yet are made here."""
    out = ablation["out"]
    shutil.copytree(out / "results", tmp_path / "results")
    summaries = tmp_path / "results" / SUMMARIES
    parser = cli.get_parser()
    args = ablation_args(tiny_data, tmp_path)[2:]
    s = cli.resolve_settings(parser, parser.parse_args(args))
    assert runs_on_other_cpus(s, RunKey("digits", "grad-filter-threshold", 43)) == []  # every run made here
    other = {**machine_record(), "threads": "64"}
    none_43 = summaries / "digits" / "none" / "seed-43.json"
    data = json.loads(none_43.read_text())
    none_43.write_text(json.dumps({**data, "machine": other}))
    for arm in ("grad-filter-threshold", "clip-grad-value"):
        (summaries / "digits" / arm / "seed-43.json").unlink()
    (summaries / "digits" / "grad-filter-threshold" / "seed-42.json").unlink()
    assert runs_on_other_cpus(s, RunKey("digits", "grad-filter-threshold", 43)) == [
        f"none / seed-43 ({cpu_name(other)})"
    ]
    assert runs_on_other_cpus(s, RunKey("digits", "grad-filter-threshold", 42)) == []
    assert runs_on_other_cpus(s, RunKey("digits", "grad-filter-threshold", 44)) == []  # no run of seed 44 yet
    made = []
    monkeypatch.setattr(plan, "run_one", lambda s, key: made.append(key))
    monkeypatch.setattr(plan, "write_report", lambda s, command: None)
    assert run_plan(s, "test") == 1
    assert made == [RunKey("digits", "grad-filter-threshold", 42)], (
        "grad-filter-threshold and clip-grad-value of seed 43 would pair with none of its runs"
    )


def _series_run(**series) -> RunResult:
    run = RunResult(RunKey("digits", "none", 42), {}, {name: list(values) for name, values in series.items()})
    run.machine = {"cpu_model": "AMD EPYC", "cpu_flags": "aaa", "threads": "2"}
    return run


def test_first_difference_compares_every_step_to_the_summarys_seven_digits():
    summary = {
        "batch_digest": [(1, 11.0), (2, 22.0), (3, 33.0)],
        "simple_loss": [(1, 1.234568), (2, 0.9876543), (3, 0.5)],
        "pruned_loss": [(1, 2.0), (2, 1.5), (3, 1.25)],
        "grad_norm": [(1, 812.3457), (2, 400.0), (3, 300.0)],
    }
    original = _series_run(**summary)
    # The retraining's float32 values, before the summary's rounding to 7 significant digits.
    same = {**summary, "simple_loss": [(1, 1.2345678), (2, 0.98765432), (3, 0.5)], "grad_norm": [(1, 812.34567)]}
    same["grad_norm"] += summary["grad_norm"][1:]
    assert first_difference(original, same, 3) is None
    assert first_difference(original, same, 2) is None, "only the steps asked for"
    assert first_difference(original, {**same, "pruned_loss": [(1, 2.0), (2, 1.5), (3, 1.250001)]}, 3) == 3
    assert first_difference(original, {**same, "batch_digest": [(1, 11.0), (2, 23.0), (3, 33.0)]}, 3) == 2
    assert first_difference(original, {**same, "grad_norm": [(1, 812.3457), (3, 300.0)]}, 3) == 2, "missing step"
    assert first_difference(original, same, 4) == 4, "past the run's end"
    with pytest.raises(ValueError, match="digits/none/seed-42: its summary has no grad_norm"):
        first_difference(_series_run(**{k: v for k, v in summary.items() if k != "grad_norm"}), same, 3)


def _cpu(flags: str) -> Dict[str, str]:
    return {"cpu_model": "AMD EPYC", "cpu_flags": flags, "threads": "2", "torch": "2.13.0+cpu"}


def _record(cpu: str, of: str, parted=None, condition="digits", torch="2.13.0+cpu") -> Reproduction:
    runs = {f"{condition}/none/seed-42": parted, f"{condition}/grad-filter-threshold/seed-42": None}
    return Reproduction(cpu_name(_cpu(cpu)), cpu_name(_cpu(of)), 200, runs, "d", ["cmd"], torch)


def test_a_cpu_recorded_as_reproducing_anothers_runs_pairs_with_them(tmp_path):
    """cpus.json: a reproduction that matched every step joins its two CPUs when summaries are read (runs of
    the two then pair), for its condition and torch only; one that parted joins nothing; a newer record of the
    same two CPUs replaces the older; records join transitively whichever way they point."""
    none = _series_run(grad_norm=[(1, 1.0)])
    none.machine, none.wer = _cpu("aaa"), {("greedy_search", "test-other"): 8.0}
    filt = _series_run(grad_norm=[(1, 1.0)])
    filt.key, filt.machine = RunKey("digits", "grad-filter-threshold", 42), _cpu("bbb")
    filt.wer = {("greedy_search", "test-other"): 7.0}
    for run in (none, filt):
        write_summary(tmp_path, run)

    def pairing():
        runs = [read_summary(tmp_path, RunKey("digits", arm, 42)) for arm in ("grad-filter-threshold", "none")]
        return pair_runs([runs[0]], [runs[1]], lambda r: r.wer[("greedy_search", "test-other")])

    assert pairing().straddling == [42] and not pairing().differences
    write_reproduction(tmp_path, _record("bbb", "aaa", parted=17))
    assert computes_as(tmp_path, "digits", "2.13.0+cpu") == {} and pairing().straddling == [42]
    write_reproduction(tmp_path, _record("bbb", "aaa", condition="stress"))
    write_reproduction(tmp_path, _record("bbb", "aaa", torch="2.14.1"))
    assert computes_as(tmp_path, "digits", "2.13.0+cpu") == {}, "another condition, another torch"
    assert pairing().straddling == [42]
    write_reproduction(tmp_path, _record("bbb", "aaa"))
    assert len(read_reproductions(tmp_path)) == 3, "the newer record of the two CPUs replaces the older"
    a, b, c = (cpu_name(_cpu(f)) for f in ("aaa", "bbb", "ccc"))
    assert computes_as(tmp_path, "digits", "2.13.0+cpu") == {a: a, b: a}
    assert read_summary(tmp_path, filt.key).computes_as == a and read_summary(tmp_path, none.key).computes_as == a
    assert pairing().differences == {42: -1.0} and not pairing().straddling
    assert "computes_as" not in json.loads((tmp_path / "digits" / "grad-filter-threshold" / "seed-42.json").read_text())
    # ccc reproduced bbb, and aaa reproduced bbb too (the other way round): all three count as one.
    write_reproduction(tmp_path, _record("ccc", "bbb"))
    write_reproduction(tmp_path, _record("aaa", "bbb"))
    assert computes_as(tmp_path, "digits", "2.13.0+cpu") == {a: a, b: a, c: a}


def test_verify_cpu_retrains_another_cpus_runs_and_records_whether_they_reproduce(
    ablation, tiny_data, tmp_path, monkeypatch
):
    """--verify-cpu on the tiny study, its `none` runs relabelled as made on another CPU (so every pair
    straddles two): retrained here, the newest `none` run matches every step, so this CPU is recorded as
    computing as that one and the pairs are kept (no run or replay is skipped any more); with the summary's
    loss changed at step 2, the check records the run parting there and the pairs are left out again."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    shutil.copytree(ablation["out"] / "results", tmp_path / "results")
    summaries = tmp_path / "results" / SUMMARIES
    other = {**machine_record(), "cpu_flags": "another"}
    for path in (summaries / "digits" / "none").glob("seed-*.json"):
        data = json.loads(path.read_text())
        path.write_text(json.dumps({**data, "machine": other}))
    parser = cli.get_parser()
    s = cli.resolve_settings(parser, parser.parse_args(ablation_args(tiny_data, tmp_path)[2:]))
    none_42 = read_summary(summaries, RunKey("digits", "none", 42))
    assert runs_on_other_cpus(s, RunKey("digits", "grad-filter-threshold", 42)) == [
        f"none / seed-42 ({cpu_name(other)})"
    ]
    assert not pairs_here(s, none_42), "its replays would be skipped"
    results_md = tmp_path / "results" / "README.md"
    write_report(s, "test")
    left_out = re.compile(r"Pairs left out because their two runs ran on different CPU models: (\d+)\.")
    assert int(left_out.search(results_md.read_text())[1]) > 0

    assert cli.main([*ablation_args(tiny_data, tmp_path)[2:], "--verify-cpu", "3"]) == 0
    (reproduction,) = read_reproductions(summaries)
    assert (reproduction.cpu, reproduction.of, reproduction.steps) == (cpu_name(machine_record()), cpu_name(other), 3)
    assert reproduction.runs == {"digits/none/seed-43": None} and reproduction.reproduced
    assert reproduction.torch == torch.__version__
    assert len(reproduction.commands) == 1 and "--max-batches 3 " in reproduction.commands[0]
    assert not (tmp_path / "exp" / VERIFY_DIR).exists(), "the retrainings are removed"
    assert runs_on_other_cpus(s, RunKey("digits", "grad-filter-threshold", 42)) == []
    assert pairs_here(s, read_summary(summaries, RunKey("digits", "none", 42)))
    write_report(s, "test")
    text = results_md.read_text()
    assert int(left_out.search(text)[1]) == 0
    assert f"{cpu_name(machine_record())} with torch {torch.__version__} reproduced every one of the first 3" in text

    changed = read_summary(summaries, RunKey("digits", "none", 43))
    step, loss = changed.scalars["simple_loss"][1]
    changed.scalars["simple_loss"][1] = (step, loss * 1.001)  # the summary's loss at step 2 no longer the run's
    write_summary(summaries, changed)
    (reproduction,) = verify_cpu(s, 3)
    assert reproduction.runs == {"digits/none/seed-43": 2} and not reproduction.reproduced
    assert read_reproductions(summaries) == [reproduction]
    assert runs_on_other_cpus(s, RunKey("digits", "grad-filter-threshold", 42)) != []
    write_report(s, "test")
    assert int(left_out.search(results_md.read_text())[1]) > 0


def test_a_retrained_none_run_must_reproduce_the_run(tmp_path):
    """Branches that start from a retrained none run start from the run's own weights only if the retraining
    took the run's path: at every step it trained, its batch digest, losses and gradient norm must be the
    run's (to the summary's 7 digits)."""
    from torch.utils.tensorboard import SummaryWriter

    s = dataclasses.make_dataclass("S", ["summaries"])(tmp_path / "runs")
    summary = {
        "batch_digest": [(1, 11.0), (2, 22.0), (3, 33.0), (4, 44.0)],
        "simple_loss": [(1, 1.2), (2, 1.1), (3, 1.0), (4, 0.9)],
        "pruned_loss": [(1, 0.4), (2, 0.3), (3, 0.25), (4, 0.2)],
        "grad_norm": [(1, 812.3457), (2, 400.0), (3, 300.0), (4, 200.0)],
    }
    run = _series_run(**summary)
    write_summary(s.summaries, run)

    def retrained(name: str, **changed: Dict[int, float]) -> Path:
        redo = tmp_path / name
        with SummaryWriter(str(redo / "tensorboard")) as writer:
            for field, series in summary.items():
                for step, value in {**dict(series[:3]), **changed.get(field, {})}.items():  # to step 3 of 4
                    writer.add_scalar(getattr(TB_TAGS, field), value, step)
        return redo

    check_retrained(s, run.key, retrained("same"), 3)  # float32 in TensorBoard, 7 digits in the summary
    with pytest.raises(StudyError, match=r"parts from the run at step 2 of 3"):
        check_retrained(s, run.key, retrained("loss", pruned_loss={2: 0.3001}), 3)
    with pytest.raises(StudyError, match=r"parts from the run at step 3 of 3"):
        check_retrained(s, run.key, retrained("batches", batch_digest={3: 34.0}), 3)
    with pytest.raises(StudyError, match=r"at step 4 of 4"):
        check_retrained(s, run.key, retrained("short"), 4)
