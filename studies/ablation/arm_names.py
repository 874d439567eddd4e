"""The ablation's arms by their old names: one table, read wherever an arm's name comes from stored text.

An arm is named by the flag (without ``--``) of each train.py rule it switches on, ``+`` between rules, with
``-<value>`` after a rule whose threshold is not the study's default for it (:func:`studies.ablation.arms.arm_name`).
Before, the arms had names of their own (``clip``, ``filter``, ``guard``, ...), and ``studies/ablation/family.json``
(fixed before the runs, never edited), the run summaries and ``cpus.json`` written then still use them: every
reader maps a stored name through :func:`canonical_arm`. ``tests/test_ablation_family.py`` checks that each new name
here is an arm :func:`studies.ablation.arms.make_arms` makes.
"""

from __future__ import annotations

from typing import Dict, List

ARM_ALIASES: Dict[str, str] = {
    "clip": "clip-grad-norm",
    "guard": "clip-grad-norm-1000",  # family.json's guard_clip_grad_norm; the report still calls it the guard
    "filter": "grad-filter-threshold",
    "filter-clip": "grad-filter-threshold+clip-grad-norm",
    "clip-relative": "clip-grad-norm-relative",
    "clip-relative-5": "clip-grad-norm-relative-5",
    "filter-10": "grad-filter-threshold-10",
    "filter-5": "grad-filter-threshold-5",
    "agc": "agc-clipping",
    "value": "clip-grad-value",
    "filter-hard": "grad-filter-mode-hard-mask",
    "zclip": "zclip-z-threshold",
    "autoclip": "autoclip-percentile",
    "scaled-adam": "scaled-adam-clipping-scale",
    "recurrent-clip": "recurrent-grad-clip",
}


def canonical_arm(name: str) -> str:
    """An arm's name now, from a name as stored (an old one or already a new one)."""
    return ARM_ALIASES.get(name, name)


def stored_names(name: str) -> List[str]:
    """The names an arm may be stored under: its own, then its old one (if it had one)."""
    return [name, *(old for old, new in ARM_ALIASES.items() if new == name)]
