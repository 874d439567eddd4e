"""The pilot's grid: every corruption of the training set crossed with every training setting, each cell one
set of train.py flags on the regime corpus (``prepare.sh --corpus digits --size regime``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

from icefall_lite.train.rules import RULES

# The corpus and where it is prepared (a folder of the recipe, as the ablation's "digits").
CORPUS_DIR = "digits-regime"
PREPARE = ("bash", "prepare.sh", "--corpus", "digits", "--size", "regime", "--work-dir", CORPUS_DIR)
BPE_MODEL = "data/lang_bpe_30/bpe.model"
CLEAN_MANIFESTS = "data/fbank"

# The ablation's learnable condition (its "digits"): the default model at --base-lr 0.003, warm-up 50 steps.
BASE_LR = 0.003
BASE_FLAGS = ("--max-duration", "60", "--model-warm-step", "50")
TWELVE_LAYERS = ("--num-encoder-layers", "12", "--encoder-dim", "128", "--rnn-hidden-size", "128")
TWELVE_LAYERS += ("--dim-feedforward", "512")


@dataclass(frozen=True)
class Corruption:
    """A training set: ``fraction`` of its cuts corrupted by local/make_corrupted_cuts.py's ``mix`` (0: clean)."""

    name: str
    fraction: float

    @property
    def manifest_dir(self) -> str:
        return CLEAN_MANIFESTS if self.fraction == 0 else f"data/fbank-mix-{round(self.fraction * 100)}"

    def command(self) -> List[str]:
        """make_corrupted_cuts.py's command (run in the corpus folder); none for the clean set."""
        return [
            "python",
            "../local/make_corrupted_cuts.py",
            "--out-dir",
            self.manifest_dir,
            "--bpe-model",
            BPE_MODEL,
            "--method",
            "mix",
            "--fraction",
            f"{self.fraction:g}",
        ]


@dataclass(frozen=True)
class Setting:
    """How training runs: train.py's flags beyond the base's, and the model flags decode.py needs too."""

    name: str
    description: str
    train_flags: Tuple[str, ...] = ()
    model_flags: Tuple[str, ...] = ()


CORRUPTIONS: Tuple[Corruption, ...] = (Corruption("clean", 0.0), Corruption("mix-2", 0.02), Corruption("mix-10", 0.10))
SETTINGS: Tuple[Setting, ...] = (
    Setting("base", f"--base-lr {BASE_LR:g}, warm-up 50 steps, 4 layers of 256"),
    Setting("lr-x3", "base learning rate x3", ("--base-lr", f"{3 * BASE_LR:g}")),
    Setting("lr-x10", "base learning rate x10", ("--base-lr", f"{10 * BASE_LR:g}")),
    Setting("no-warm-up", "no model warm-up (--model-warm-step 1)", ("--model-warm-step", "1")),
    Setting("12-layers", "12 LSTM layers of 128 (feed-forward 512)", (), TWELVE_LAYERS),
)


@dataclass(frozen=True)
class Cell:
    setting: Setting
    corruption: Corruption

    @property
    def name(self) -> str:
        return f"{self.setting.name}.{self.corruption.name}"

    def train_flags(self) -> List[str]:
        """The base flags with the setting's (a later flag wins in argparse), the model's and the manifests."""
        flags = ["--base-lr", f"{BASE_LR:g}", *BASE_FLAGS, *self.setting.train_flags, *self.setting.model_flags]
        return flags + ["--manifest-dir", self.corruption.manifest_dir]


CELLS: Tuple[Cell, ...] = tuple(Cell(s, c) for s in SETTINGS for c in CORRUPTIONS)
CELL_BY_NAME: Dict[str, Cell] = {c.name: c for c in CELLS}
REFERENCE = CELL_BY_NAME["base.clean"]


def arm_flags(arm: str) -> List[str]:
    """train.py's gradient-control flags of ``arm``: ``none`` is every rule of the registry off (the filter
    observing, --grad-filter-threshold inf); any other arm is a rule's name, at the value ``arm=value`` gives."""
    name, _, value = arm.partition("=")
    if name != "none" and name not in {r.name for r in RULES}:
        raise ValueError(f"unknown arm {arm!r}: 'none' or <rule>=<value> with a rule of icefall_lite.train.rules")
    flags: List[str] = []
    for rule in RULES:
        flags += [rule.flag, value if rule.name == name else f"{rule.off:g}"]
    return flags
