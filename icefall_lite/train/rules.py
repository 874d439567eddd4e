"""The registry of train.py's gradient controls: every rule declared once, here.

Each :class:`Rule` is one flag of train.py (its name is the flag without ``--``, which is also the rule's arm
name in the studies), where it acts (:class:`Stage`), train.py's default, the value that switches it off, its
``--help`` text, its aliases and, for the rules that keep a history, its key in
:meth:`icefall_lite.train.grad_control.GradientControl.state_dict`. From :data:`RULES` come train.py's
"gradient control" argument group and its validation, :class:`~icefall_lite.train.grad_control.GradientControl`'s
fields, the studies' arms and the GPU check's list of rules. Adding a rule is one entry here, its function
(``icefall_lite.nn.clip``) and its test.

The GradientFilter's mode (``--grad-filter-mode``) is a choice among
:data:`icefall_lite.nn.clip.GRAD_FILTER_MODES`, not a rule: it says how the filter acts, not how much.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from icefall_lite.nn.model import DEFAULT_GRAD_FILTER_THRESHOLD

# The relative clip re-estimates its median every this many steps (as ScaledAdam's clipping_update_period).
RELATIVE_CLIP_UPDATE_PERIOD = 100


class Stage(str, enum.Enum):
    """Where a rule acts on the gradients."""

    IN_BACKWARD = "in backward"  # on one tensor's gradient while backward runs, before it flows further
    AFTER_BACKWARD = "after backward"  # on the parameters' gradients, from this step's gradients alone
    HISTORY = "from the norm's history"  # after backward, at a threshold that follows the past norms
    OPTIMIZER = "in the optimizer"  # inside the optimizer's step (--optimizer scaled-adam's own clipping)


@dataclass(frozen=True)
class Rule:
    """One gradient control of train.py.

    Attributes:
      name: train.py's flag without ``--`` (``clip-grad-norm``), also the rule's arm name in the studies.
      stage: where it acts.
      default: train.py's default.
      off: the value that switches it off (0; the filter's ``inf``, observing only, as a study's arm sets it).
      help: the flag's ``--help`` text.
      aliases: other spellings of the flag (``--grad-norm-threshold``, icefall's).
      state_key: its key in ``GradientControl.state_dict()`` (the rules that keep a history), else None.
    """

    name: str
    stage: Stage
    default: float
    off: float
    help: str
    aliases: Tuple[str, ...] = ()
    state_key: Optional[str] = None

    @property
    def dest(self) -> str:
        """The argparse destination (and the key in train.py's params): ``clip_grad_norm``."""
        return self.name.replace("-", "_")

    @property
    def flag(self) -> str:
        """``--clip-grad-norm``."""
        return f"--{self.name}"


# The GradientFilter's threshold first, then in the order the rules apply: in backward, after backward (the
# element-wise kinds before the global norm), then those that follow the norm's history (at the global stage
# with the fixed clip; with several on, the smallest scale wins).
RULES: Tuple[Rule, ...] = (
    Rule(
        "grad-filter-threshold",
        Stage.IN_BACKWARD,
        default=DEFAULT_GRAD_FILTER_THRESHOLD,
        off=math.inf,
        help="GradientFilter threshold inside every LSTM layer (x median per-sequence gradient RMS; "
        "--grad-norm-threshold is icefall's name for it); 0 = no filter anywhere in the graph; inf = observe "
        "only (per-layer statistics logged, gradients unchanged).",
        aliases=("--grad-norm-threshold",),  # icefall's lstm_transducer_stateless3 spelling
    ),
    Rule(
        "error-clip",
        Stage.IN_BACKWARD,
        default=0.0,
        off=0.0,
        help="Per-variable error clip (Paddle's ErrorClipByValue) during backward: the gradient "
        "arriving at every encoder layer's output is clamped element-wise to [-VALUE, VALUE] "
        "before it flows into the layer; 0 = off.",
    ),
    Rule(
        "recurrent-grad-clip",
        Stage.IN_BACKWARD,
        default=0.0,
        off=0.0,
        help="Kaldi nnet3's per-frame derivative cap (BackpropTruncationComponent, clipping-threshold 30 in its "
        "LSTM recipes): in every LSTM layer, the derivative that flows back from frame t+1 into the state "
        "[h_t, c_t] is scaled, for each frame of each sequence, to an L2 norm of at most this. The LSTMs then "
        "run frame by frame in training (slower); 0 = off (the fused kernel).",
    ),
    Rule(
        "clip-grad-value",
        Stage.AFTER_BACKWARD,
        default=0.0,
        off=0.0,
        help="Clamp every gradient element to [-VALUE, VALUE]; 0 = off.",
    ),
    Rule(
        "agc-clipping",
        Stage.AFTER_BACKWARD,
        default=0.0,
        off=0.0,
        help="Adaptive gradient clipping (AGC): lambda, the largest allowed unit-wise ratio of "
        "gradient norm to weight norm (the joiner's output layer is left unclipped); 0 = off.",
    ),
    Rule(
        "clip-grad-norm",
        Stage.AFTER_BACKWARD,
        default=5.0,
        off=0.0,
        help="Scale all gradients together so that their global L2 norm is at most this; 0 = off.",
    ),
    Rule(
        "clip-grad-norm-relative",
        Stage.HISTORY,
        default=0.0,
        off=0.0,
        help="Scale all gradients together so that their global L2 norm is at most S times the median of "
        f"the recent pre-clip norms (icefall's ScaledAdam rule: re-estimated at steps 10, 20, 40, then every "
        f"{RELATIVE_CLIP_UPDATE_PERIOD}; none before step 10); 0 = off.",
        state_key="relative_threshold",
    ),
    Rule(
        "zclip-z-threshold",
        Stage.HISTORY,
        default=0.0,
        off=0.0,
        help="ZClip (Kumar et al. 2025; its authors' default 'zscore' / 'adaptive_scaling' variant): EMAs "
        "(alpha 0.97) of the mean and variance of the global norm, started from the first 25 norms (not "
        "clipped); a norm whose z-score exceeds Z is clipped to mean + Z^2 std / z, and the EMAs are updated "
        "with the clipped norm. The authors recommend 2.5; 0 = off.",
        state_key="zclip",
    ),
    Rule(
        "autoclip-percentile",
        Stage.HISTORY,
        default=0.0,
        off=0.0,
        help="AutoClip (Seetharaman et al. 2020): clip the global norm at the P-th percentile (0 < P <= 100; "
        "numpy's linear interpolation) of every global norm so far, this step's included. The authors "
        "recommend 10; 0 = off.",
        state_key="autoclip",
    ),
    # icefall ScaledAdam's rule, applied by GradientControl after backward from its own history of norms
    # (with any optimizer); --optimizer scaled-adam's clipping inside its step is a choice of optimizer.
    Rule(
        "scaled-adam-clipping-scale",
        Stage.HISTORY,
        default=0.0,
        off=0.0,
        help="icefall ScaledAdam's gradient clipping, exactly, with any optimizer: the norm of the gradients "
        "each multiplied by its parameter's RMS (one-element parameters by 0.1) is clipped at S times the "
        "median of the last 100 such norms, re-estimated every 100 steps (and at steps 10, 20, 40 at twice "
        "that; none before step 10). The zipformer recipes use 2.0; 0 = off. (--clip-grad-norm-relative is "
        "the same idea on the raw norm.)",
        state_key="scaled_adam",
    ),
)
RULE_BY_NAME: Dict[str, Rule] = {rule.name: rule for rule in RULES}
DESTS: Tuple[str, ...] = tuple(rule.dest for rule in RULES)
