"""What the gradient-control ablation compares: its arms (which control is
on, with which threshold) and its training conditions (model shape and
learning rate).

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


def flag_value(x: float) -> str:
    """A threshold as train.py reads it, exactly (``inf``, ``25``, ``0.08``)."""
    return "inf" if math.isinf(x) else (str(int(x)) if x == int(x) else repr(float(x)))


@dataclass(frozen=True)
class Arm:
    """One gradient-control setting.

    ``filter_threshold``: ``OBSERVE`` (no filtering) or the GradientFilter
    threshold; the others are train.py's gradient-control flags of the same
    names (:mod:`icefall_lite.train.grad_control`; 0 = off).
    """

    name: str
    label: str
    filter_threshold: float = OBSERVE
    clip_grad_norm: float = 0.0
    clip_grad_value: float = 0.0
    agc_clipping: float = 0.0
    error_clip: float = 0.0
    clip_grad_norm_relative: float = 0.0

    @property
    def filter_on(self) -> bool:
        return math.isfinite(self.filter_threshold)

    def train_flags(self) -> List[str]:
        """train.py flags that set this arm's controls (and switch the others off)."""
        values = {
            "--grad-filter-threshold": self.filter_threshold,
            "--clip-grad-norm": self.clip_grad_norm,
            "--clip-grad-value": self.clip_grad_value,
            "--agc-clipping": self.agc_clipping,
            "--error-clip": self.error_clip,
            "--clip-grad-norm-relative": self.clip_grad_norm_relative,
        }
        return [item for flag, value in values.items() for item in (flag, flag_value(value))]


@dataclass(frozen=True)
class Thresholds:
    """The thresholds of the arms (ablation.py's flags; RESULTS.md, "Thresholds of the ablation's clipping
    arms", says how the defaults were chosen)."""

    filter: float = DEFAULT_GRAD_FILTER_THRESHOLD
    sweep: Tuple[float, ...] = (10.0, 5.0)
    clip_norm: float = 5.0
    agc_lambda: float = 0.08
    clip_value: float = 1.0
    error_clip: float = 2e-4


def make_arms(t: Thresholds) -> List[Arm]:
    """Every arm, in table order."""
    arms = [
        Arm("none", "no control (filter observing)"),
        Arm("clip", f"clip_grad_norm {t.clip_norm:g}", clip_grad_norm=t.clip_norm),
        Arm("filter", f"GradientFilter {t.filter:g}", filter_threshold=t.filter),
        Arm(
            "filter-clip",
            f"GradientFilter {t.filter:g} + clip_grad_norm {t.clip_norm:g}",
            filter_threshold=t.filter,
            clip_grad_norm=t.clip_norm,
        ),
    ]
    arms += [Arm(f"filter-{x:g}", f"GradientFilter {x:g}", filter_threshold=x) for x in t.sweep]
    arms += [
        Arm("agc", f"adaptive clipping (AGC), lambda {t.agc_lambda:g}", agc_clipping=t.agc_lambda),
        Arm("value", f"clip by value {t.clip_value:g}", clip_grad_value=t.clip_value),
        Arm("error-clip", f"error clip {t.error_clip:g} on layer outputs", error_clip=t.error_clip),
    ]
    return arms


@dataclass(frozen=True)
class Condition:
    """A training condition: model flags (train.py and decode.py) and training-only flags."""

    name: str
    description: str
    model_flags: Tuple[str, ...] = ()
    train_flags: Tuple[str, ...] = ()


# The stress condition was found by the exploration in RESULTS.md ("Stress
# conditions"): a deeper, narrower stack with a projection LSTM at a high
# learning rate grows per-sequence outliers by itself, starting in the upper
# layers and growing on the way down, as icefall saw in its 12-layer model.
CONDITIONS: Dict[str, Condition] = {
    "stress": Condition(
        "stress",
        "8 LSTM layers of d_model 128 with projection (LSTM hidden 384, feed-forward 512), --base-lr 0.02",
        ("--num-encoder-layers", "8", "--encoder-dim", "128", "--rnn-hidden-size", "384", "--dim-feedforward", "512"),
        ("--base-lr", "0.02"),
    ),
    "default": Condition("default", "the default model (4 x 256 LSTM layers, no projection), --base-lr 0.003"),
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
