"""The second-moment monitor against Adam's update worked by hand: the jump of a tensor's exp_avg_sq after
an outlier gradient, and the steps until it decays back."""

import math

import pytest
import torch

from icefall_lite.train.loop import batch_digest
from icefall_lite.train.optimizer_state import SecondMomentMonitor

BETA2 = 0.98


def _step(model: torch.nn.Linear, optimizer: torch.optim.Optimizer, scale: float) -> None:
    optimizer.zero_grad()
    model.weight.grad = torch.full_like(model.weight, scale)
    model.bias.grad = torch.full_like(model.bias, 1.0)
    optimizer.step()


def test_jump_and_recovery_follow_adams_second_moment():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, BETA2))
    monitor = SecondMomentMonitor(model, optimizer, event_jump=2.0, recovered_ratio=1.25)
    _step(model, optimizer, 1.0)
    first = monitor.update(1)
    assert first.jump == 1.0 and first.recovery_steps == [], "no state before the first step"
    warm = 400  # unit gradients until exp_avg_sq is near its steady value 1
    for step in range(2, warm + 1):
        _step(model, optimizer, 1.0)
        monitor.update(step)
    v = 1 - BETA2**warm  # each element of exp_avg_sq after `warm` unit gradients
    _step(model, optimizer, 20.0)  # a 20x gradient on the weight only
    report = monitor.update(warm + 1)
    expected_jump = (BETA2 * v + (1 - BETA2) * 400.0) / v
    assert report.jump == pytest.approx(expected_jump, rel=1e-6) and report.jump_tensor == "weight"
    assert monitor.largest_open().name == "weight"
    # Back at or below 1.25 x v: v_n = BETA2^n (BETA2 v + 0.02 * 400) + (1 - BETA2^n), first n with v_n <= 1.25 v.
    inflated = BETA2 * v + (1 - BETA2) * 400.0
    n = next(n for n in range(1, 10_000) if BETA2**n * inflated + (1 - BETA2**n) <= 1.25 * v)
    recovered = []
    for step in range(warm + 2, warm + 2 + n + 5):
        _step(model, optimizer, 1.0)
        recovered += monitor.update(step).recovery_steps
    assert recovered == [n] and monitor.largest_open() is None
    assert n == math.ceil(math.log((1.25 * v - 1) / (inflated - 1)) / math.log(BETA2))


def test_a_monitor_made_after_resuming_measures_the_first_step():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters(), betas=(0.9, BETA2))
    for _ in range(3):
        _step(model, optimizer, 1.0)
    monitor = SecondMomentMonitor(model, optimizer)  # as train.py builds it after loading the optimizer state
    _step(model, optimizer, 10.0)
    v = 1 - BETA2**3
    assert monitor.update(4).jump == pytest.approx((BETA2 * v + (1 - BETA2) * 100.0) / v, rel=1e-6)


class _Cut:
    def __init__(self, cut_id: str) -> None:
        self.id = cut_id


def test_batch_digest_depends_on_the_cut_ids_and_their_order():
    a = batch_digest({"supervisions": {"cut": [_Cut("u1"), _Cut("u2")]}})
    assert a == batch_digest({"supervisions": {"cut": [_Cut("u1"), _Cut("u2")]}})
    assert a != batch_digest({"supervisions": {"cut": [_Cut("u2"), _Cut("u1")]}})
    assert 0 <= a < 2**24 and float(a) == float(torch.tensor(float(a), dtype=torch.float32)), "exact in float32"
    assert batch_digest({"supervisions": {"text": ["x"]}}) is None


def test_queued_steps_read_together_report_as_steps_read_one_by_one():
    reports = {}
    for mode in ("update", "record"):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, BETA2))
        monitor = SecondMomentMonitor(model, optimizer, event_jump=2.0, recovered_ratio=1.25)
        got = []
        for step, scale in enumerate([1.0] * 400 + [20.0] + [1.0] * 200, start=1):
            _step(model, optimizer, scale)
            if mode == "update":
                got.append((step, monitor.update(step)))
            else:
                monitor.record(step)
        reports[mode] = got if mode == "update" else monitor.reports()
    assert reports["record"] == reports["update"]
    assert max(r.jump for _, r in reports["update"]) > 2.0 and any(r.recovery_steps for _, r in reports["update"])
