"""PNG plots of the ablation (matplotlib, Agg backend), one set per training
condition, every seed drawn:

- the pre-clip global gradient norm per step, one panel per arm, one line per seed;
- the per-layer largest per-sequence gradient over the batch median in the
  arm whose filter only observes, one panel per seed, with the thresholds;
- the percentage of steps above each threshold per layer (that arm, all seeds);
- the fraction of sequences filtered per layer, one panel per filter arm (mean over seeds);
- the training loss per step, one panel per arm, one line per seed, the
  observing arm's seeds in grey behind for reference;
- the WER of every arm, one line per seed across the arms (the pairing); the
  landscape's rules in a figure of their own, beside the observing arm;
- WER at every decoding point (a third, two thirds, the whole budget), one panel
  per arm, one line per seed;
- the replayed outlier events: each replay's loss over its window in every
  branch from the event, the event marked;
- once a condition has a landscape arm: the % of steps each arm's control
  acted on, a bar per arm and a dot per seed;
- once several conditions (depths) have runs of the observing arm: per layer
  and condition, how often and how far the largest sequence gradient rose
  above the batch median.
"""

from __future__ import annotations

import functools
import io
import math
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from PIL import Image  # noqa: E402

from icefall_lite.utils import atomic_output  # noqa: E402
from studies.ablation.arms import Arm  # noqa: E402
from studies.ablation.metrics import OUTLIER_RATIO, group_runs, outlier_rows, steps_acting  # noqa: E402
from studies.ablation.replay.events import EVENT_ONLY, FILTER, LABELS, NO_CONTROL, UNIFORM
from studies.ablation.replay.result import ReplayResult
from studies.ablation.runs import RunResult  # noqa: E402
from studies.tb_reader import Series, moving_average  # noqa: E402

# 20 colours, so that up to 20 consecutive seeds (the round has 17) never share one: tab10's, then tab20's light
# shades of them.
SEED_COLORS = tuple(matplotlib.colormaps["tab20"].colors[i] for i in [*range(0, 20, 2), *range(1, 20, 2)])


def plot_path(out_dir: Path, condition: str, kind: str) -> Path:
    """``<out_dir>/ablation-<condition>-<kind>.png``."""
    return out_dir / f"ablation-{condition}-{kind}.png"


def _xy(series: Series):
    return [s for s, _ in series], [v for _, v in series]


def _window(runs: Sequence[RunResult]) -> int:
    """Smoothing window: about 1/50 of the run, at least 1 step."""
    return max(1, max((r.steps for r in runs), default=0) // 50)


def _save(fig, path: Path) -> Path:
    """The figure as a PNG of a 256-colour palette: the plots are committed beside the report, and the
    palette makes them about a third of matplotlib's RGBA size with no visible change to lines and text."""
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=100, format="png")
    plt.close(fig)
    buffer.seek(0)
    with atomic_output(path) as tmp:
        Image.open(buffer).convert("RGB").quantize(256).save(tmp, "PNG", optimize=True)
    return path


def _grid(n: int, width: float = 4.2, height: float = 3.0):
    ncols = min(3, max(1, n))
    nrows = (n + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _per_arm(
    groups: Dict[str, List[RunResult]],
    arms: Dict[str, Arm],
    title: str,
    path: Path,
    draw: Callable[[object, List[RunResult]], None],
) -> Path:
    fig, axes = _grid(len(groups))
    for ax, (arm, runs) in zip(axes, groups.items()):
        ax.set_title(arms[arm].label, fontsize=8)
        draw(ax, runs)
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def _seed_color(seed: int) -> str:
    """The same colour for a seed in every panel (seeds are consecutive: 42, 43, ...)."""
    return SEED_COLORS[seed % len(SEED_COLORS)]


def _seed_lines(ax, runs: Sequence[RunResult], series_of: Callable[[RunResult], Series], **kw) -> None:
    for r in runs:
        ax.plot(*_xy(series_of(r)), color=_seed_color(r.key.seed), lw=0.7, label=f"seed {r.key.seed}", **kw)


def plot_grad_norm(groups: Dict[str, List[RunResult]], arms: Dict[str, Arm], path: Path) -> Path:
    def draw(ax, runs: List[RunResult]) -> None:
        _seed_lines(ax, runs, lambda r: r.series("grad_norm"), alpha=0.8)
        ax.set_yscale("log")
        ax.set_xlabel("step", fontsize=8)
        ax.legend(fontsize=6)

    return _per_arm(groups, arms, "Pre-clip global gradient L2 norm per step", path, draw)


def plot_max_over_median(runs: Sequence[RunResult], thresholds: Sequence[float], path: Path) -> Path:
    fig, axes = _grid(len(runs), width=5.0, height=3.4)
    for ax, r in zip(axes, runs):
        ax.set_title(f"seed {r.key.seed}", fontsize=9)
        for layer in sorted(r.layers(), reverse=True):
            ax.plot(*_xy(r.filter_series(layer, "max_over_median")), lw=0.6, label=f"layer {layer}")
        for i, t in enumerate(thresholds):
            ax.axhline(
                t,
                color="k",
                ls="--",
                lw=0.7,
                label="thresholds " + ", ".join(f"{x:g}" for x in thresholds) if i == 0 else None,
            )
        ax.set_yscale("log")
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("max / median seq grad RMS", fontsize=8)
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle("Largest sequence gradient / batch median per layer\n(the filter observing)", fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def plot_over_threshold(runs: Sequence[RunResult], thresholds: Sequence[float], path: Path) -> Path:
    rows = outlier_rows(runs, thresholds)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / max(1, len(thresholds))
    for j, t in enumerate(thresholds):
        xs = [row["layer"] + (j - (len(thresholds) - 1) / 2) * width for row in rows]
        ax.bar(xs, [row[f"over {t:g}"] for row in rows], width=width, label=f"above {t:g}")
    ax.set_xticks([row["layer"] for row in rows])
    ax.set_xlabel("encoder layer (0 = lowest)")
    ax.set_ylabel("% of steps")
    ax.set_title(
        f"Steps whose largest sequence gradient is above a threshold x the median ({len(runs)} seeds)", fontsize=9
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def _mean_over_seeds(runs: Sequence[RunResult], layer: int, stat: str) -> Series:
    by_step: Dict[int, List[float]] = {}
    for r in runs:
        for step, v in r.filter_series(layer, stat):
            by_step.setdefault(step, []).append(v)
    return [(s, sum(v) / len(v)) for s, v in sorted(by_step.items())]


def plot_filter_fraction(groups: Dict[str, List[RunResult]], arms: Dict[str, Arm], path: Path) -> Path:
    filtering = {a: runs for a, runs in groups.items() if arms[a].filter_on}

    def draw(ax, runs: List[RunResult]) -> None:
        for layer in sorted({layer for r in runs for layer in r.layers()}, reverse=True):
            series = moving_average(_mean_over_seeds(runs, layer, "fraction_filtered"), _window(runs))
            ax.plot(*_xy(series), lw=0.8, label=f"layer {layer}")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("fraction of sequences filtered", fontsize=8)
        ax.legend(fontsize=6, ncol=2)

    if not filtering:
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.text(0.5, 0.5, "no arm with the filter on", ha="center", va="center", transform=ax.transAxes)
        return _save(fig, path)
    return _per_arm(
        filtering,
        arms,
        "GradientFilter: fraction of sequences filtered per layer (mean over seeds, moving average)",
        path,
        draw,
    )


def plot_train_loss(
    groups: Dict[str, List[RunResult]], arms: Dict[str, Arm], path: Path, reference: str = "none"
) -> Path:
    def draw(ax, runs: List[RunResult]) -> None:
        window = _window(runs)
        if runs[0].key.arm != reference:
            for r in groups.get(reference, []):
                ax.plot(*_xy(moving_average(r.objective(), window)), color="0.75", lw=0.7)
        _seed_lines(ax, runs, lambda r: moving_average(r.objective(), window))
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("0.5 simple + pruned per frame", fontsize=8)
        ax.legend(fontsize=6)

    return _per_arm(groups, arms, f"Training loss (moving average; grey: the seeds of arm '{reference}')", path, draw)


def split_landscape(
    groups: Dict[str, List[RunResult]], rules: Sequence[str], observing_arm: str, reference: str
) -> Tuple[Dict[str, List[RunResult]], Dict[str, List[RunResult]]]:
    """A condition's runs by arm for two WER-per-seed figures: the arms that are not landscape ``rules``, and
    (empty when no rule ran) the observing arm, the ``reference`` arm (the filter at its default, where it ran)
    then the rules that ran, each over the seeds the rules ran (the landscape's pairs, not every seed of the
    observing arm)."""
    ran = [arm for arm in rules if arm in groups]
    others = {arm: runs for arm, runs in groups.items() if arm not in ran}
    if not ran:
        return others, {}
    seeds = {r.key.seed for arm in ran for r in groups[arm]}
    shown = [observing_arm, *([reference] if reference in groups else []), *ran]
    versus = {arm: [r for r in groups.get(arm, []) if r.key.seed in seeds] for arm in shown}
    return others, versus


def seed_line(groups: Dict[str, List[RunResult]], seed: int, key: Tuple[str, str]) -> List[float]:
    """The seed's WER ``key`` in each arm of ``groups`` in order, nan where it has none (a run not made yet):
    the line breaks there rather than joining the arms on either side."""
    line = []
    for runs in groups.values():
        found = [r.wer[key] for r in runs if r.key.seed == seed and key in r.wer]
        line.append(found[0] if found else math.nan)
    return line


def plot_wer_per_seed(
    groups: Dict[str, List[RunResult]],
    keys: Sequence[Tuple[str, str]],
    path: Path,
    title: str = "WER per arm, one line per seed (same initialisation and batches across arms)",
) -> Path:
    """One panel per (method, test set): the arms on x, one line per seed through its WER in every arm; one
    legend for the figure, beside the panels (inside them it hid the last arms' points)."""
    fig, axes = _grid(len(keys), width=5.5, height=3.6)
    names = list(groups)
    for ax, (method, test_set) in zip(axes, keys):
        seeds = sorted({r.key.seed for runs in groups.values() for r in runs})
        for seed in seeds:
            ys = seed_line(groups, seed, (method, test_set))
            ax.plot(range(len(names)), ys, marker="o", ms=3, lw=0.8, color=_seed_color(seed), label=f"seed {seed}")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=30, fontsize=7, ha="right")
        ax.set_ylabel("WER (%)", fontsize=8)
        ax.set_title(f"{method.replace('_search', '')} {test_set}", fontsize=9)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="center right", fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.9, 1))
    return _save(fig, path)


def acting_by_arm(groups: Dict[str, List[RunResult]], arms: Dict[str, Arm]) -> Dict[str, List[Tuple[int, float]]]:
    """Per arm with a control, ``[(seed, % of steps its control acted on)]`` (:func:`metrics.steps_acting`),
    the runs that logged no statistic left out; arms in ``groups``'s order."""
    out = {}
    for arm, runs in groups.items():
        if not arms[arm].settings:
            continue
        points = [(r.key.seed, 100 * steps_acting(r, arms[arm])) for r in runs]
        out[arm] = [(seed, x) for seed, x in points if math.isfinite(x)]
    return out


def plot_steps_acting(groups: Dict[str, List[RunResult]], arms: Dict[str, Arm], path: Path) -> Path:
    """A bar per arm with a control: the mean over seeds of the % of steps it acted on, a dot per seed."""
    acting = acting_by_arm(groups, arms)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(acting) + 2), 3.8))
    for i, (arm, points) in enumerate(acting.items()):
        if points:
            ax.bar(i, sum(x for _, x in points) / len(points), color="0.8", width=0.7)
        for seed, x in points:
            ax.plot(i, x, "o", ms=3, color=_seed_color(seed))
    ax.set_xticks(range(len(acting)))
    ax.set_xticklabels([arms[a].label for a in acting], rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("% of steps acting", fontsize=8)
    ax.set_ylim(0, 100)
    ax.set_title("How often each control changed a gradient (its own statistic; bar: mean, dot: a seed)", fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def plot_outliers_by_depth(
    labelled: Sequence[Tuple[str, Sequence[RunResult]]], threshold: float, path: Path, observing: str = "none"
) -> Path:
    """Per model (a line each, its seeds pooled), per layer (x: 0 = lowest): the % of steps after warm-up with
    the layer's largest sequence gradient over ``threshold`` x the batch median; and the 99th percentile and
    the maximum of that ratio."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for i, (label, runs) in enumerate(labelled):
        rows = sorted(outlier_rows(runs, [threshold]), key=lambda row: row["layer"])
        layers = [row["layer"] for row in rows]
        color = SEED_COLORS[i % len(SEED_COLORS)]
        left.plot(layers, [row[f"over {threshold:g}"] for row in rows], marker="o", ms=3, color=color, label=label)
        right.plot(layers, [row["p99"] for row in rows], marker="o", ms=3, color=color, label=f"{label}: 99th pct")
        right.plot(layers, [row["max"] for row in rows], ls=":", marker="^", ms=3, color=color, label=f"{label}: max")
    left.set_ylabel(f"% of steps over {threshold:g}x", fontsize=8)
    right.set_ylabel("max / median sequence gradient RMS", fontsize=8)
    right.set_yscale("log")
    right.axhline(threshold, color="k", ls="--", lw=0.7)
    for ax in (left, right):
        ax.set_xlabel("encoder layer (0 = lowest)", fontsize=8)
        ax.legend(fontsize=6)
    fig.suptitle(f"Where the gradient outliers arise, by depth (arm '{observing}', after warm-up)", fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


BRANCH_COLORS = {NO_CONTROL: "tab:red", EVENT_ONLY: "tab:orange", FILTER: "tab:blue", UNIFORM: "tab:green"}


def plot_wer_curves(groups: Dict[str, List[RunResult]], arms: Dict[str, Arm], key: Tuple[str, str], path: Path) -> Path:
    """One panel per arm: the WER of ``key`` at every step the runs were decoded at, one line per seed."""

    def draw(ax, runs: List[RunResult]) -> None:
        for r in runs:
            points = sorted(s for s, wers in r.wer_at.items() if key in wers)
            ax.plot(
                points,
                [r.wer_at[s][key] for s in points],
                marker="o",
                ms=3,
                lw=0.8,
                color=_seed_color(r.key.seed),
                label=f"seed {r.key.seed}",
            )
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("WER (%)", fontsize=8)
        ax.legend(fontsize=5, ncol=2)

    title = f"{key[0].replace('_search', '')} {key[1]} WER at each decoding point (averaged model), one line per seed"
    return _per_arm(groups, arms, title, path, draw)


def plot_replays(replays: Sequence[ReplayResult], path: Path) -> Path:
    """One panel per replay: the loss per step over the window in every branch from the event (moving
    average over 5 steps), the event marked."""
    fig, axes = _grid(len(replays), width=4.2, height=2.8)
    for ax, r in zip(axes, replays):
        for branch, color in BRANCH_COLORS.items():
            if branch in r.branches:
                series = moving_average(r.branches[branch].objective, 5)
                ax.plot(*_xy(series), color=color, lw=0.8, label=LABELS[branch])
        ax.axvline(r.event.step, color="k", ls=":", lw=0.8, label=f"event {r.event.ratio:.0f}x")
        ax.set_title(f"seed {r.key.seed}, from step {r.key.start}", fontsize=8)
        ax.set_xlabel("step", fontsize=7)
        ax.legend(fontsize=5)
    fig.suptitle("Replayed outlier events: training loss per branch (moving average over 5 steps)", fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def _planned(plot: Callable[..., Path], *args, **kwargs) -> Tuple[Path, Callable[[], Path]]:
    """``(the plot's path, a call that draws it)``: the path is the plot function's first argument that is one."""
    path = next(a for a in args if isinstance(a, Path))
    return path, functools.partial(plot, *args, **kwargs)


def planned_plots(
    results: Sequence[RunResult],
    arms: Dict[str, Arm],
    out_dir: Path,
    thresholds: Sequence[float],
    replays: Sequence[ReplayResult] = (),
    observing_arm: str = "none",
    landscape: Sequence[str] = (),
    landscape_condition: str = "",
    landscape_reference: str = "",
    depths: Sequence[str] = (),
    outlier_threshold: float = OUTLIER_RATIO,
) -> Dict[str, Tuple[Path, Callable[[], Path]]]:
    """Every plot of every condition, not drawn yet: ``{"<condition> <kind>": (path in out_dir, draw)}``, where
    ``draw()`` draws it and returns its path (the report names the plots without drawing them). ``landscape``: the
    arms whose runs bring the plot of steps acting, and at ``landscape_condition`` a WER-per-seed plot of their
    own beside the observing arm and ``landscape_reference`` (the condition's plot keeps the other arms);
    ``depths``: the conditions that differ only in depth, whose observing-arm runs, once two of them have
    some, bring the outliers by depth (over ``outlier_threshold``) as ``"depth outliers"``."""
    out: Dict[str, Tuple[Path, Callable[[], Path]]] = {}
    for condition in dict.fromkeys(r.key.condition for r in results):
        groups = {arm: runs for (c, arm), runs in group_runs(results).items() if c == condition}
        observed = groups.get(observing_arm, [])
        out[f"{condition} grad-norm"] = _planned(
            plot_grad_norm, groups, arms, plot_path(out_dir, condition, "grad-norm")
        )
        if observed:
            out[f"{condition} max-over-median"] = _planned(
                plot_max_over_median, observed, thresholds, plot_path(out_dir, condition, "max-over-median")
            )
            out[f"{condition} over-threshold"] = _planned(
                plot_over_threshold, observed, thresholds, plot_path(out_dir, condition, "over-threshold")
            )
        out[f"{condition} filter-fraction"] = _planned(
            plot_filter_fraction, groups, arms, plot_path(out_dir, condition, "filter-fraction")
        )
        out[f"{condition} train-loss"] = _planned(
            plot_train_loss, groups, arms, plot_path(out_dir, condition, "train-loss"), observing_arm
        )
        wer_keys = list(dict.fromkeys(k for runs in groups.values() for r in runs for k in r.wer))
        rules = landscape if condition == landscape_condition else ()
        others, versus = split_landscape(groups, rules, observing_arm, landscape_reference)
        if wer_keys:
            out[f"{condition} wer-per-seed"] = _planned(
                plot_wer_per_seed, others, wer_keys, plot_path(out_dir, condition, "wer-per-seed")
            )
        if wer_keys and versus:
            out[f"{condition} landscape-wer-per-seed"] = _planned(
                plot_wer_per_seed,
                versus,
                wer_keys,
                plot_path(out_dir, condition, "landscape-wer-per-seed"),
                f"The landscape: WER per rule beside {' and '.join(repr(a) for a in versus if a not in rules)}, one "
                "line per seed (its seeds only)",
            )
        curves = [k for k in wer_keys if any(len(r.wer_at) > 1 for runs in groups.values() for r in runs)]
        for k in curves:
            name = f"wer-curve-{k[1]}"
            out[f"{condition} {name}"] = _planned(plot_wer_curves, groups, arms, k, plot_path(out_dir, condition, name))
        if any(arm in groups for arm in landscape):
            out[f"{condition} steps-acting"] = _planned(
                plot_steps_acting, groups, arms, plot_path(out_dir, condition, "steps-acting")
            )
        mine = [r for r in replays if r.key.condition == condition]
        if mine:
            out[f"{condition} replays"] = _planned(plot_replays, mine, plot_path(out_dir, condition, "replays"))
    observed = group_runs([r for r in results if r.key.arm == observing_arm and r.key.condition in depths])
    if len(observed) > 1:
        labelled = [
            (f"{condition}, {1 + max((layer for r in runs for layer in r.layers()), default=-1)} layers", runs)
            for (condition, _), runs in observed.items()
        ]
        out["depth outliers"] = _planned(
            plot_outliers_by_depth, labelled, outlier_threshold, plot_path(out_dir, "depth", "outliers"), observing_arm
        )
    return out


def write_plots(
    results: Sequence[RunResult], arms: Dict[str, Arm], out_dir: Path, thresholds: Sequence[float], **options: object
) -> Dict[str, Path]:
    """Every plot of :func:`planned_plots` (the same arguments) drawn into ``out_dir``; ``{"<condition> <kind>":
    path}``."""
    planned = planned_plots(results, arms, out_dir, thresholds, **options)
    return {kind: draw() for kind, (_, draw) in planned.items()}
