"""What the gradient-control ablation compares: its arms (which control is
on, with which threshold), its training conditions (corpus, model shape,
learning rate, warm-up and budget) and the sets of runs ``make ablation``
makes.

Every arm without the GradientFilter still carries one that only observes
(threshold ``inf``: statistics logged, gradients unchanged), so that every
run shows, per layer, how far the largest per-sequence gradient rose above
the batch median: where outliers arise and how often they would cross a
threshold.

Arms (thresholds from :class:`Thresholds`):

  none         no control (the filter observes)
  clip         clip_grad_norm
  filter       GradientFilter at the recipe's threshold
  filter-clip  both (the recipe's design)
  clip-relative  clip_grad_norm at a multiple of the running median gradient norm (as ScaledAdam's
               clipping_scale): catches the rare outlier, leaves ordinary steps alone
  filter-<t>   GradientFilter at each other threshold of the sweep
  agc          adaptive gradient clipping (Brock et al. 2021) with lambda
  value        clipping every gradient element to [-v, v]
  error-clip   Paddle's ErrorClipByValue on every encoder layer's output gradient
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

from icefall_lite.nn.model import DEFAULT_GRAD_FILTER_THRESHOLD

OBSERVE = math.inf  # --grad-filter-threshold inf: the filter observes only


# Every gradient control of train.py, by its flag's argparse dest (``--grad-filter-threshold`` and
# icefall_lite.train.grad_control.FLAGS), in the order an arm's train.py flags give them. The arms' fields
# and ablation.py's threshold flags have these names too.
CONTROLS = (
    "grad_filter_threshold",
    "clip_grad_norm",
    "clip_grad_value",
    "agc_clipping",
    "error_clip",
    "clip_grad_norm_relative",
)


def flag_of(control: str) -> str:
    """train.py's flag of a control: ``clip_grad_norm`` -> ``--clip-grad-norm``."""
    return "--" + control.replace("_", "-")


def flag_value(x: float) -> str:
    """A threshold as train.py reads it, exactly (``inf``, ``25``, ``0.08``)."""
    return "inf" if math.isinf(x) else (str(int(x)) if x == int(x) else repr(float(x)))


@dataclass(frozen=True)
class Arm:
    """One gradient-control setting: train.py's value of every control in :data:`CONTROLS`.

    ``grad_filter_threshold``: ``OBSERVE`` (no filtering) or the GradientFilter threshold; the others are
    train.py's clipping flags of the same names (:mod:`icefall_lite.train.grad_control`; 0 = off).
    """

    name: str
    label: str
    grad_filter_threshold: float = OBSERVE
    clip_grad_norm: float = 0.0
    clip_grad_value: float = 0.0
    agc_clipping: float = 0.0
    error_clip: float = 0.0
    clip_grad_norm_relative: float = 0.0

    @property
    def filter_on(self) -> bool:
        return math.isfinite(self.grad_filter_threshold)

    def train_flags(self) -> List[str]:
        """train.py flags that set this arm's controls (and switch the others off)."""
        return [item for c in CONTROLS for item in (flag_of(c), flag_value(getattr(self, c)))]


@dataclass(frozen=True)
class Thresholds:
    """The thresholds of the arms, by the names of train.py's flags (ablation.py's flags of the same names;
    RESULTS.md, "Thresholds of the ablation's clipping arms", says how the defaults were chosen);
    ``filter_sweep``: the GradientFilter thresholds of the arms ``filter-<t>``."""

    grad_filter_threshold: float = DEFAULT_GRAD_FILTER_THRESHOLD
    filter_sweep: Tuple[float, ...] = (10.0, 5.0)
    clip_grad_norm: float = 5.0
    agc_clipping: float = 0.08
    clip_grad_value: float = 1.0
    error_clip: float = 2e-4
    clip_grad_norm_relative: float = 2.0


def make_arms(t: Thresholds) -> List[Arm]:
    """Every arm, in table order."""
    arms = [
        Arm("none", "no control (filter observing)"),
        Arm("clip", f"clip_grad_norm {t.clip_grad_norm:g}", clip_grad_norm=t.clip_grad_norm),
        Arm("filter", f"GradientFilter {t.grad_filter_threshold:g}", grad_filter_threshold=t.grad_filter_threshold),
        Arm(
            "filter-clip",
            f"GradientFilter {t.grad_filter_threshold:g} + clip_grad_norm {t.clip_grad_norm:g}",
            grad_filter_threshold=t.grad_filter_threshold,
            clip_grad_norm=t.clip_grad_norm,
        ),
        Arm(
            "clip-relative",
            f"clip_grad_norm at {t.clip_grad_norm_relative:g}x the running median",
            clip_grad_norm_relative=t.clip_grad_norm_relative,
        ),
    ]
    arms += [Arm(f"filter-{x:g}", f"GradientFilter {x:g}", grad_filter_threshold=x) for x in t.filter_sweep]
    arms += [
        Arm("agc", f"adaptive clipping (AGC), lambda {t.agc_clipping:g}", agc_clipping=t.agc_clipping),
        Arm("value", f"clip by value {t.clip_grad_value:g}", clip_grad_value=t.clip_grad_value),
        Arm("error-clip", f"error clip {t.error_clip:g} on layer outputs", error_clip=t.error_clip),
    ]
    return arms


@dataclass(frozen=True)
class Condition:
    """A training condition: the corpus (prepare.sh's ``--corpus``, prepared in the recipe folder
    ``corpus_dir``), the budget (``steps`` at ``max_duration`` seconds per batch), the warm-up and the model
    flags (train.py and decode.py) and training-only flags."""

    name: str
    description: str
    corpus: str
    corpus_dir: str
    steps: int
    max_duration: float
    model_warm_step: int
    model_flags: Tuple[str, ...] = ()
    train_flags: Tuple[str, ...] = ()

    @property
    def warm_end(self) -> int:
        """The first step at the full loss weights (train/loss's step ramp: 0, then 0.1, then 1 after twice
        --model-warm-step)."""
        return 2 * self.model_warm_step

    def all_train_flags(self) -> List[str]:
        return ["--model-warm-step", str(self.model_warm_step), *self.model_flags, *self.train_flags]

    def prepare_command(self) -> List[str]:
        """prepare.sh's command for this condition's corpus (from the recipe folder)."""
        return ["bash", "prepare.sh", "--corpus", self.corpus] + (
            ["--work-dir", self.corpus_dir] if self.corpus_dir != "." else []
        )


# The learnable condition (RESULTS.md, "Ablation"): connected digit strings, the default model at its
# default learning rate, a short warm-up (the pruned loss at full weight from step 100 of 600). The pilot
# of 2026-11-25 (one seed) decoded to 4.8 / 13.5% greedy WER without any control, and 4.4% of its steps
# after warm-up had a layer over 25x the batch median.
# The stress condition was found by the exploration in RESULTS.md ("Stress conditions"): a deeper, narrower
# stack with a projection LSTM at 6.7x the working learning rate; it grows per-sequence outliers from the
# start, but no arm learns in it (97-100% WER): a from-scratch instability, not the regime icefall saw.
CONDITIONS: Dict[str, Condition] = {
    "digits": Condition(
        "digits",
        "connected digits (prepare.sh --corpus digits), the default model (4 x 256 LSTM layers), --base-lr 0.003, "
        "--model-warm-step 50",
        corpus="digits",
        corpus_dir="digits",
        steps=600,
        max_duration=60.0,
        model_warm_step=50,
        train_flags=("--base-lr", "0.003"),
    ),
    "stress": Condition(
        "stress",
        "synthetic LibriSpeech; 8 LSTM layers of d_model 128 with projection (LSTM hidden 384, feed-forward 512), "
        "--base-lr 0.02: a from-scratch instability in which no arm learns",
        corpus="synthetic",
        corpus_dir=".",
        steps=300,
        max_duration=40.0,
        model_warm_step=100,
        model_flags=(
            *("--num-encoder-layers", "8", "--encoder-dim", "128"),
            *("--rnn-hidden-size", "384", "--dim-feedforward", "512"),
        ),
        train_flags=("--base-lr", "0.02"),
    ),
}


@dataclass(frozen=True)
class RunSet:
    """A named set of runs: conditions, arms, seeds and replayed outlier events per seed."""

    name: str
    conditions: Tuple[str, ...]
    arms: Tuple[str, ...]
    num_seeds: int
    replays_per_seed: int


# primary: the question (about 3 h on 2 idle cores); secondary: the other thresholds and clipping designs
# with fewer seeds, and the from-scratch instability.
RUN_SETS: Dict[str, RunSet] = {
    "primary": RunSet("primary", ("digits",), ("none", "filter", "clip", "filter-clip", "clip-relative"), 5, 2),
    "secondary": RunSet(
        "secondary",
        ("digits", "stress"),
        ("none", "filter", "clip", "filter-clip", "filter-10", "filter-5", "agc", "value", "error-clip"),
        2,
        0,
    ),
}


def select(names: Sequence[str], known: Sequence[str], what: str) -> List[str]:
    """``names`` in the order of ``known``; ValueError naming any unknown one."""
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown {what} {', '.join(unknown)}; known: {', '.join(known)}")
    return [k for k in known if k in names]


@dataclass(frozen=True)
class RunKey:
    """One training run: a condition, an arm, a seed."""

    condition: str
    arm: str
    seed: int

    @property
    def relpath(self) -> str:
        return f"{self.condition}/{self.arm}/seed-{self.seed}"


def seeds_of(base_seed: int, num_seeds: int) -> List[int]:
    """The seeds of every arm: ``base_seed, base_seed + 1, ...``."""
    return [base_seed + i for i in range(num_seeds)]


@dataclass
class Plan:
    """The runs of an ablation, in the order they are made (seed-major: after the first seed of every arm
    the table has a row per arm)."""

    conditions: List[str]
    arms: List[Arm]
    seeds: List[int]
    runs: List[RunKey] = field(init=False)

    def __post_init__(self) -> None:
        self.runs = [RunKey(c, a.name, s) for s in self.seeds for c in self.conditions for a in self.arms]
