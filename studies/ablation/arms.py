"""What the gradient-control ablation compares: its arms (which control is
on, with which threshold), its training conditions (corpus, model shape,
learning rate, warm-up and budget) and the sets of runs ``make ablation``
makes.

Every arm without the GradientFilter still carries one that only observes
(threshold ``inf``: statistics logged, gradients unchanged), so that every
run shows, per layer, how far the largest per-sequence gradient rose above
the batch median: where outliers arise and how often they would cross a
threshold.

An arm is named by train.py's flag (without ``--``) of each rule it switches on (icefall_lite.train.rules),
``+`` between rules, ``-<value>`` after a rule whose threshold is not the study's default for it (:class:`Thresholds`),
and ``grad-filter-mode-<mode>`` for the filter in a mode other than soft (:func:`arm_name`); the names the arms had
before are read through :mod:`studies.ablation.arm_names`. Arms (thresholds from :class:`Thresholds`; the primary
set's from ``family.json``):

  none                          no control (the filter observes)
  clip-grad-norm                clip_grad_norm at a fixed maximum (5: below every step's norm here, so it rescales
                                every step: normalisation, not a guard)
  clip-grad-norm-1000           the guard: clip_grad_norm at a fixed maximum far above the typical norm (about 4x
                                none's median), acting on rare steps only
  grad-filter-threshold         GradientFilter at the recipe's threshold
  grad-filter-threshold+clip-grad-norm   both (the recipe's design)
  clip-grad-norm-relative       clip_grad_norm at a multiple of the running median gradient norm (as ScaledAdam's
                                clipping_scale); clip-grad-norm-relative-<x> at each other multiple of the sweep
  grad-filter-threshold-<t>     GradientFilter at each other threshold of the sweep
  agc-clipping                  adaptive gradient clipping (Brock et al. 2021) with lambda
  clip-grad-value               clipping every gradient element to [-v, v]
  error-clip                    Paddle's ErrorClipByValue on every encoder layer's output gradient
  grad-filter-mode-hard-mask    the GradientFilter's hard-mask variant: sequences over the threshold zeroed, the
                                others kept
  zclip-z-threshold             ZClip (2025): clip when the global norm's z-score against its moving mean and
                                variance exceeds z
  autoclip-percentile           AutoClip (Seetharaman et al. 2020): clip at a percentile of every past global norm
  scaled-adam-clipping-scale    ScaledAdam's rule (icefall's zipformer): the RMS-scaled norm clipped at
                                clipping_scale x the median of the last 100
  recurrent-grad-clip           Kaldi nnet3's per-frame derivative cap inside the recurrent layers
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Sequence, Tuple

from icefall_lite.nn.model import DEFAULT_GRAD_FILTER_THRESHOLD
from icefall_lite.train.rules import DESTS, RULES
from studies.ablation.family import FamilyComparison, load_config
from studies.ablation.records import RunKey

OBSERVE = math.inf  # --grad-filter-threshold inf: the filter observes only
STUDY = load_config()  # the round's configuration, fixed before its runs (studies/ablation/family.json)


# Every gradient control of train.py (icefall_lite.train.rules.RULES), by its flag's argparse dest: an arm sets
# every one, those it does not use to their off value.
CONTROLS = DESTS
_RULE_OF = {rule.dest: rule for rule in RULES}
MODE_FLAG = "--grad-filter-mode"


def off_value(control: str) -> float:
    """A control's value when off (its rule's: ``inf`` for the filter, observing; 0 for the others)."""
    return _RULE_OF[control].off


def flag_of(control: str) -> str:
    """train.py's flag of a control: ``clip_grad_norm`` -> ``--clip-grad-norm``."""
    return _RULE_OF[control].flag


def flag_value(x: float) -> str:
    """A threshold as train.py reads it, exactly (``inf``, ``25``, ``0.08``)."""
    return "inf" if math.isinf(x) else (str(int(x)) if x == int(x) else repr(float(x)))


@dataclass(frozen=True)
class Arm:
    """One gradient-control setting: the controls it switches on (``settings``: ``{control: value}`` by
    train.py's argparse dest, :data:`CONTROLS`), every other control off.

    ``grad_filter_threshold``: ``OBSERVE`` (no filtering) or the GradientFilter threshold; the others are
    train.py's clipping flags of the same names (:mod:`icefall_lite.train.grad_control`; 0 = off).
    """

    name: str
    label: str
    settings: Tuple[Tuple[str, float], ...] = ()
    mode: str = "soft"  # the GradientFilter's mode (train.py's --grad-filter-mode)

    def __post_init__(self) -> None:
        unknown = [c for c, _ in self.settings if c not in CONTROLS]
        if unknown:
            raise ValueError(f"arm {self.name}: unknown control(s) {unknown}; train.py's are {list(CONTROLS)}")

    def value(self, control: str) -> float:
        return dict(self.settings).get(control, off_value(control))

    @property
    def filter_on(self) -> bool:
        return math.isfinite(self.value("grad_filter_threshold"))

    def train_flags(self) -> List[str]:
        """train.py flags that set this arm's controls (and switch every other off); the filter's mode only
        when it is not train.py's default, soft (the runs made before the mode existed keep their flags)."""
        flags = [item for c in CONTROLS for item in (flag_of(c), flag_value(self.value(c)))]
        return flags + ([MODE_FLAG, self.mode] if self.mode != "soft" else [])


def arm_name(settings: Mapping[str, float], defaults: "Thresholds", mode: str = "soft") -> str:
    """An arm's name: the flag (without ``--``) of each control on, in train.py's order, ``+`` between them, each
    with ``-<value>`` when it is not ``defaults``' (the study's default for it); the filter in another mode than
    soft at its default threshold is ``grad-filter-mode-<mode>``; no control on is ``none``."""
    parts = []
    for control in CONTROLS:
        if control not in settings:
            continue
        name = _RULE_OF[control].name
        value = settings[control]
        if control == "grad_filter_threshold" and mode != "soft":
            name = f"grad-filter-mode-{mode}"
        parts.append(name if value == getattr(defaults, control) else f"{name}-{value:g}")
    return "+".join(parts) or "none"


def arm(label: str, defaults: "Thresholds", mode: str = "soft", **settings: float) -> Arm:
    """An arm with the controls ``settings`` on (by train.py's argparse dests) and the filter in ``mode``, named
    by :func:`arm_name`."""
    return Arm(arm_name(settings, defaults, mode), label, tuple(settings.items()), mode)


def same_controls(flags_a: Sequence[str], flags_b: Sequence[str]) -> bool:
    """Whether two lists of train.py control flags set every control alike (a control a list does not name
    is off: train.py had no such flag when it was written)."""

    def values(flags: Sequence[str]) -> Dict[str, object]:
        pairs = dict(zip(flags[::2], flags[1::2]))
        return {
            **{c: float(pairs.get(flag_of(c), off_value(c))) for c in CONTROLS},
            "mode": pairs.get(MODE_FLAG, "soft"),
        }

    return values(flags_a) == values(flags_b)


@dataclass(frozen=True)
class Thresholds:
    """The thresholds of the arms, by the names of train.py's flags (ablation.py's flags of the same names;
    RESULTS.md, "Thresholds of the ablation's clipping arms", says how the defaults were chosen);
    ``filter_sweep``: the GradientFilter thresholds of the arms ``filter-<t>``; ``guard``: the guard arm's
    clip_grad_norm; ``relative_sweep``: the multiples of the arms ``clip-relative-<x>``."""

    grad_filter_threshold: float = DEFAULT_GRAD_FILTER_THRESHOLD
    filter_sweep: Tuple[float, ...] = (10.0, 5.0)
    clip_grad_norm: float = 5.0
    agc_clipping: float = 0.08
    clip_grad_value: float = 1.0
    error_clip: float = 2e-4
    clip_grad_norm_relative: float = STUDY.clip_grad_norm_relative[0]
    relative_sweep: Tuple[float, ...] = STUDY.clip_grad_norm_relative[1:]
    guard: float = STUDY.guard_clip_grad_norm
    zclip_z_threshold: float = 2.5
    autoclip_percentile: float = 10.0
    scaled_adam_clipping_scale: float = 2.0
    recurrent_grad_clip: float = 30.0


def make_arms(t: Thresholds) -> List[Arm]:
    """Every arm, in table order."""
    f = t.grad_filter_threshold
    arms = [
        arm("no control (filter observing)", t),
        arm(f"clip_grad_norm {t.clip_grad_norm:g}", t, clip_grad_norm=t.clip_grad_norm),
        arm(f"clip_grad_norm {t.guard:g} (guard)", t, clip_grad_norm=t.guard),
        arm(f"GradientFilter {f:g}", t, grad_filter_threshold=f),
        arm(
            f"GradientFilter {f:g} + clip_grad_norm {t.clip_grad_norm:g}",
            t,
            grad_filter_threshold=f,
            clip_grad_norm=t.clip_grad_norm,
        ),
        arm(
            f"clip_grad_norm at {t.clip_grad_norm_relative:g}x the running median",
            t,
            clip_grad_norm_relative=t.clip_grad_norm_relative,
        ),
    ]
    arms += [
        arm(f"clip_grad_norm at {x:g}x the running median", t, clip_grad_norm_relative=x) for x in t.relative_sweep
    ]
    arms += [arm(f"GradientFilter {x:g}", t, grad_filter_threshold=x) for x in t.filter_sweep]
    arms += [
        arm(f"adaptive clipping (AGC), lambda {t.agc_clipping:g}", t, agc_clipping=t.agc_clipping),
        arm(f"clip by value {t.clip_grad_value:g}", t, clip_grad_value=t.clip_grad_value),
        arm(f"error clip {t.error_clip:g} on layer outputs", t, error_clip=t.error_clip),
        arm(f"GradientFilter {f:g}, hard mask", t, mode="hard-mask", grad_filter_threshold=f),
        arm(f"ZClip, z-score {t.zclip_z_threshold:g}", t, zclip_z_threshold=t.zclip_z_threshold),
        arm(f"AutoClip, percentile {t.autoclip_percentile:g}", t, autoclip_percentile=t.autoclip_percentile),
        arm(
            f"ScaledAdam's clipping, scale {t.scaled_adam_clipping_scale:g}",
            t,
            scaled_adam_clipping_scale=t.scaled_adam_clipping_scale,
        ),
        arm(
            f"per-frame recurrent gradient cap {t.recurrent_grad_clip:g}",
            t,
            recurrent_grad_clip=t.recurrent_grad_clip,
        ),
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
# default learning rate, a short warm-up (the pruned loss at full weight from step 100); its budget is the
# round's (family.json: 1,800 steps in round 2, 600 in round 1). The 12-layer condition has its own budget
# (family.json's depth.budget: 1,800 steps did not converge there).
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
        steps=STUDY.steps,
        max_duration=60.0,
        model_warm_step=50,
        train_flags=("--base-lr", "0.003"),
    ),
    "digits-12": Condition(
        "digits-12",
        "connected digits, 12 LSTM layers of 128 (feed-forward 512), --base-lr 0.003, --model-warm-step 50: the "
        "depth of icefall's stack at a width whose 1,800 steps fit about 15 minutes on 2 cores (RESULTS.md, 'Depth "
        "pilot'); its budget is its own (family.json's depth.budget)",
        corpus="digits",
        corpus_dir="digits",
        steps=STUDY.depth_budget.steps,
        max_duration=60.0,
        model_warm_step=50,
        model_flags=(
            *("--num-encoder-layers", "12", "--encoder-dim", "128"),
            *("--rnn-hidden-size", "128", "--dim-feedforward", "512"),
        ),
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
    """A named set of runs: conditions, the seeds of each arm (``{arm: number of seeds}``), and the replayed
    outlier events (in all, and at most per seed)."""

    name: str
    conditions: Tuple[str, ...]
    seeds_per_arm: Tuple[Tuple[str, int], ...]
    replay_events: int
    replays_per_seed: int

    @property
    def arms(self) -> Tuple[str, ...]:
        return tuple(a for a, _ in self.seeds_per_arm)


def family_run_set(name: str, condition: str, family: Sequence[FamilyComparison], seeds: int) -> RunSet:
    """The arms of ``family`` (its baselines first, each once) on ``condition``, ``seeds`` each, no replays."""
    arms = dict.fromkeys([*(c.baseline for c in family), *(c.arm for c in family)])
    return RunSet(name, (condition,), tuple((a, seeds) for a in arms), 0, 0)


# primary: the question, as family.json fixes it for the round (seeds per arm chosen for the power of filter -
# none; see its "time" for what 8 hours hold); secondary: the other thresholds and clipping designs with fewer
# seeds, and the from-scratch instability; landscape: every other rule against none on the round's condition
# and seeds (family.json's "landscape", a family of its own), its none runs the round's; depth: the 12-layer
# condition's arms against none (family.json's "depth", its own family and the filter's interaction with depth).
RUN_SETS: Dict[str, RunSet] = {
    "primary": RunSet(
        "primary",
        (STUDY.condition,),
        tuple(STUDY.seeds_per_arm.items()),
        STUDY.replay_events,
        STUDY.replays_per_seed,
    ),
    "secondary": RunSet(
        "secondary",
        ("digits", "stress"),
        tuple(
            (a, 2)
            for a in (
                "none",
                "grad-filter-threshold",
                "clip-grad-norm",
                "grad-filter-threshold+clip-grad-norm",
                "grad-filter-threshold-10",
                "grad-filter-threshold-5",
                "agc-clipping",
                "clip-grad-value",
                "error-clip",
            )
        ),
        0,
        0,
    ),
    "depth": family_run_set("depth", STUDY.depth_condition, STUDY.depth_family, STUDY.depth_seeds),
    "landscape": family_run_set("landscape", STUDY.condition, STUDY.landscape_family, STUDY.landscape_seeds),
}


def select(names: Sequence[str], known: Sequence[str], what: str) -> List[str]:
    """``names`` in the order of ``known``; ValueError naming any unknown one."""
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown {what} {', '.join(unknown)}; known: {', '.join(known)}")
    return [k for k in known if k in names]


def seeds_of(base_seed: int, num_seeds: int) -> List[int]:
    """The seeds of an arm: ``base_seed, base_seed + 1, ...``."""
    return [base_seed + i for i in range(num_seeds)]


@dataclass
class Plan:
    """The runs of an ablation, in the order they are made: seed-major (every arm of the first seed, then of
    the second, ...), so that whatever is finished pairs up; an arm with fewer seeds drops out after its
    last. ``seeds``: ``{arm name: its seeds}``."""

    conditions: List[str]
    arms: List[Arm]
    seeds: Mapping[str, Sequence[int]]
    runs: List[RunKey] = field(init=False)

    def __post_init__(self) -> None:
        every = sorted({s for a in self.arms for s in self.seeds[a.name]})
        self.runs = [
            RunKey(c, a.name, s) for s in every for c in self.conditions for a in self.arms if s in self.seeds[a.name]
        ]

    @property
    def all_seeds(self) -> List[int]:
        return sorted({k.seed for k in self.runs})
