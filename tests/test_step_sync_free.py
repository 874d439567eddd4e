"""The sync-free training step (issue 74 item 3) equals the step it replaced: 20 steps of the tiny model, one of
them with an inf gradient, by train_step (the clip's device masks, the optimizer masked by the found-inf flag)
and by an independent reference written here (today's rule: a host check of the norm, torch's clip_grad_norm_,
and the optimizer's step as it was, with Python floats): with Eve parameters, state and losses bit for bit;
with ScaledAdam (its clipping rule on) within 1e-6 relative, the step counts and clipping history exactly."""

from __future__ import annotations

import math
from typing import Callable, Dict, List

import pytest
import torch

from benchmarks.train_setup import TokenTable, Trainer
from icefall_lite.nn.clip import RunningMedianThreshold
from icefall_lite.train.loss import batch_loss, compute_loss, loss_inputs
from icefall_lite.train.optim import Eden
from icefall_lite.train.step import mixed_precision, train_step

TINY = ["--num-encoder-layers", "2", "--encoder-dim", "32", "--rnn-hidden-size", "32", "--dim-feedforward", "64"]
TINY += ["--decoder-dim", "32", "--joiner-dim", "32", "--layer-dropout", "0"]
VOCAB = 50
STEPS = 20
INF_STEP = 7
NAN_BATCH = 12  # the float16 test: a batch without a finite loss
BIG_STEP = 15  # ScaledAdam's test: after its clipping threshold's first estimate (its 10th step)


def _batches(tokens: TokenTable) -> List[dict]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for b in range(STEPS):
        frames, lengths = ([60, 48], [6, 4]) if b % 2 == 0 else ([52, 60], [5, 6])
        feats = torch.full((2, 60, 80), -23.0)
        texts = []
        for i, (n, u) in enumerate(zip(frames, lengths)):
            feats[i, :n] = torch.randn(n, 80, generator=gen) * 3.0 - 8.0
            tokens.ids[f"b{b}-u{i}"] = torch.randint(3, VOCAB, (u,), generator=gen).tolist()
            texts.append(f"b{b}-u{i}")
        out.append({"inputs": feats, "supervisions": {"num_frames": torch.tensor(frames), "text": texts}})
    return out


def _eve_step_as_today(optimizer: torch.optim.Optimizer) -> None:
    """Eve's step before item 3 (copied): Python-int step counts, the bias corrections as Python floats."""
    for group in optimizer.param_groups:
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state[p]
            if len(state) == 0:
                state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            state["step"] += 1
            step = state["step"]
            state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            denom = (state["exp_avg_sq"].sqrt() * (1 - beta2**step) ** -0.5).add_(group["eps"])
            step_size = group["lr"] / (1 - beta1**step)
            with torch.no_grad():
                if p.numel() > 1:
                    above = p.norm() > group["target_rms"] * p.numel() ** 0.5
                    p.mul_(1 - group["weight_decay"] * above.to(p.dtype))
                p.addcdiv_(state["exp_avg"], denom, value=-step_size)
                if p.numel() == 1:
                    p.clamp_(min=-10.0, max=2.0)


class _ScaledAdamAsToday(torch.optim.Optimizer):
    """ScaledAdam's step before item 3 (copied): Python-int step counts, the clipping decision read on the host,
    the bias corrections and the learning rate as Python floats, the scale's update in a Python branch."""

    def __init__(self, params, lr: float, fused: bool) -> None:
        self.fused = fused
        defaults = dict(lr=lr, betas=(0.9, 0.98), scalar_lr_scale=0.1, eps=1e-8, param_min_rms=1e-5)
        super().__init__(params, {**defaults, "param_max_rms": 3.0, "scalar_max": 10.0, "size_update_period": 4})
        self.clip_threshold = RunningMedianThreshold(2.0, 100)
        self.num_clipped = 0

    def _add(self, delta: torch.Tensor, x: torch.Tensor, alpha: float) -> None:
        """``delta += alpha * x``: today's add_(alpha=) (fused: one rounding), or a multiply then an add."""
        if self.fused:
            delta.add_(x, alpha=alpha)
        else:
            delta.add_(x * torch.tensor(alpha, dtype=torch.float64).to(x.dtype))

    @staticmethod
    def _param_rms(p, state):
        if "param_rms" not in state:
            state["param_rms"] = p.detach().square().mean().sqrt()
        return state["param_rms"]

    def _clipping_factor(self) -> float:
        terms = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                sumsq = p.grad.detach().double().square().sum()
                terms.append(sumsq if p.numel() == 1 else sumsq * self._param_rms(p, self.state[p]).double() ** 2)
        total = torch.stack(terms).sum().sqrt()
        threshold = float(self.clip_threshold.update(total))
        norm = float(total)
        if math.isinf(threshold) or norm <= threshold or norm == 0.0:
            return 1.0
        self.num_clipped += 1
        return threshold / norm

    @torch.no_grad()
    def step(self):
        factor = self._clipping_factor()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad * factor if factor != 1.0 else p.grad
                state = self.state[p]
                if "step" not in state:
                    state.update(step=0, delta=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["delta"].mul_(beta1)
                (self._step_scalar if p.numel() == 1 else self._step_tensor)(group, p, grad, state)
                state["step"] += 1

    def _step_scalar(self, group, p, grad, state) -> None:
        beta1, beta2 = group["betas"]
        exp_avg_sq = state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq / (1 - beta2 ** (state["step"] + 1))).sqrt() + group["eps"]
        self._add(state["delta"], grad / denom, -group["lr"] * group["scalar_lr_scale"] * (1 - beta1))
        p.add_(state["delta"]).clamp_(min=-group["scalar_max"], max=group["scalar_max"])

    def _step_tensor(self, group, p, grad, state) -> None:
        beta1, beta2 = group["betas"]
        period = group["size_update_period"]
        step = state["step"]
        param_rms = self._param_rms(p, state)
        if "scale_grads" not in state:
            state["scale_grads"] = torch.zeros(period, dtype=p.dtype, device=p.device)
            state["scale_exp_avg_sq"] = torch.zeros((), dtype=p.dtype, device=p.device)
        state["scale_grads"][step % period] = (p.detach() * grad).sum()
        if step % period == period - 1:
            scale_grads = state["scale_grads"]
            state["scale_exp_avg_sq"].mul_(beta2**period).add_(scale_grads.square().mean(), alpha=1 - beta2**period)
            size_lr = group["lr"] * group["scalar_lr_scale"]
            bias_correction2 = 1 - beta2 ** ((step + 1) // period)
            denom = state["scale_exp_avg_sq"].sqrt() + group["eps"]
            scale_step = -size_lr * bias_correction2**0.5 * scale_grads.sum() / denom
            if param_rms < group["param_min_rms"]:
                scale_step = scale_step.clamp(min=0.0)
            if param_rms > group["param_max_rms"]:
                scale_step = torch.full_like(scale_step, -size_lr * period)
            state["delta"].add_(p.detach() * scale_step, alpha=1 - beta1)
            state["param_rms"] = p.detach().square().mean().sqrt()
        exp_avg_sq = state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction2 = 1 - beta2 ** (step + 1)
        denom = (exp_avg_sq / bias_correction2).sqrt() + group["eps"]
        rms = param_rms.clamp(min=group["param_min_rms"], max=group["param_max_rms"])
        self._add(state["delta"], grad / denom * rms, -group["lr"] * (1 - beta1))
        p.add_(state["delta"])


def _reference_step(
    trainer: Trainer,
    tokens: TokenTable,
    batch: dict,
    max_norm: float,
    update: Callable[[torch.optim.Optimizer], None] = _eve_step_as_today,
) -> float:
    """Today's step: forward, backward, skip on a non-finite norm read on the host, else torch's clip and the
    optimizer's step as it was (``update``)."""
    params, model, optimizer = trainer.params, trainer.model, trainer.optimizer
    with mixed_precision(params, torch.device("cpu")):
        warmup = params.batch_idx_train / params.model_warm_step
        loss, info = compute_loss(params, model, tokens, batch, is_training=True, warmup=warmup)
    loss.backward()
    grads = [p for p in model.parameters() if p.grad is not None]
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in grads]))
    trainer.scheduler.step_batch(params.batch_idx_train)
    if math.isfinite(norm):
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(grads, max_norm)
        update(optimizer)
    else:
        params.skipped_steps += 1
    optimizer.zero_grad(set_to_none=True)
    return info["loss"]


def _inject_inf(model: torch.nn.Module) -> torch.utils.hooks.RemovableHandle:
    weight = model.joiner.output_linear.weight
    return weight.register_hook(lambda g: torch.full_like(g, math.inf))


@pytest.mark.parametrize("max_norm", [0.0, 0.5], ids=["no-clip", "clip-grad-norm"])
def test_twenty_steps_with_an_inf_equal_todays_step_bit_for_bit(max_norm):
    flags = [*TINY, "--clip-grad-norm", str(max_norm)]
    tokens = TokenTable()
    batches = _batches(tokens)
    ours, reference = Trainer(flags, vocab_size=VOCAB), Trainer(flags, vocab_size=VOCAB)
    t = ours.training(tokens)
    our_losses, reference_losses = [], []
    for i, batch in enumerate(batches):
        for trainer in (ours, reference):
            trainer.params.batch_idx_train += 1
        handles = [_inject_inf(m) for m in (ours.model, reference.model)] if i == INF_STEP else []
        torch.manual_seed(100 + i)  # the same draws (dropout, balancers) in both
        info, _, _ = train_step(t, batch)
        our_losses.append(info["loss"])
        torch.manual_seed(100 + i)
        reference_losses.append(_reference_step(reference, tokens, batch, max_norm))
        for h in handles:
            h.remove()
    t.flush_log()
    assert ours.params.skipped_steps == reference.params.skipped_steps == 1
    assert our_losses == reference_losses
    for (name, a), b in zip(ours.model.named_parameters(), reference.model.parameters()):
        assert torch.equal(a, b), name
    for p, q in zip(ours.model.parameters(), reference.model.parameters()):
        mine: Dict = ours.optimizer.state[p]
        theirs: Dict = reference.optimizer.state[q]
        assert float(mine["step"]) == theirs["step"] == STEPS - 1
        assert torch.equal(mine["exp_avg"], theirs["exp_avg"]) and torch.equal(mine["exp_avg_sq"], theirs["exp_avg_sq"])


def _reference_fp16_step(trainer: Trainer, tokens: TokenTable, batch: dict, scaler: torch.amp.GradScaler) -> float:
    """Today's float16 step, decided on the host: a batch without a finite loss back-propagates a zero (no
    overflow for the scaler) and is a skipped step; a non-finite norm with a finite loss is the scaler's
    overflow (a back-off: its scale halved, no update); else torch's clip and Eve's step as it was."""
    params, model, optimizer = trainer.params, trainer.model, trainer.optimizer
    with mixed_precision(params, torch.device("cpu")):
        warmup = params.batch_idx_train / params.model_warm_step
        loss, info = compute_loss(params, model, tokens, batch, is_training=True, warmup=warmup)
    if loss is None:
        loss = sum(p.sum() * 0.0 for p in model.parameters())
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    grads = [p for p in model.parameters() if p.grad is not None]
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in grads]))
    trainer.scheduler.step_batch(params.batch_idx_train)
    if not math.isfinite(norm) and info["utterances"] > 0:
        params.scaler_backoffs += 1
    elif info["utterances"] == 0:
        params.skipped_steps += 1
    else:
        torch.nn.utils.clip_grad_norm_(grads, 5.0)
        _eve_step_as_today(optimizer)
    optimizer.zero_grad(set_to_none=True)
    scaler.update()
    return info["loss"]


def test_twenty_float16_steps_with_overflows_and_a_nan_batch_equal_todays_step_bit_for_bit():
    """--use-fp16 (autocast float16 and a GradScaler on the CPU, from a scale of 2^20 growing every 3 steps, so
    that steps overflow and back off), an inf gradient at step 8 and a batch without a finite loss at step 13:
    the device-decided step (the scaler's update and the back-offs counted on the device) against today's
    host-decided one: losses, parameters, Eve's state, the scaler's state, skipped steps and back-offs."""
    tokens = TokenTable()
    batches = _batches(tokens)
    batches[NAN_BATCH]["inputs"][:] = math.nan
    flags = [*TINY, "--use-fp16", "true"]
    ours, reference = Trainer(flags, vocab_size=VOCAB), Trainer(flags, vocab_size=VOCAB)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3) for _ in range(2)]
    t = ours.training(tokens, scaler=scalers[0])
    our_losses, reference_losses = [], []
    for i, batch in enumerate(batches):
        for trainer in (ours, reference):
            trainer.params.batch_idx_train += 1
        handles = [_inject_inf(m) for m in (ours.model, reference.model)] if i == INF_STEP else []
        torch.manual_seed(100 + i)
        info, _, _ = train_step(t, batch)
        our_losses.append(info["loss"])
        torch.manual_seed(100 + i)
        reference_losses.append(_reference_fp16_step(reference, tokens, batch, scalers[1]))
        for h in handles:
            h.remove()
    t.flush_log()
    assert ours.params.skipped_steps == reference.params.skipped_steps == 1
    assert ours.params.scaler_backoffs == reference.params.scaler_backoffs >= 2, "overflows, the inf's among them"
    assert scalers[0].state_dict() == scalers[1].state_dict()
    assert our_losses == reference_losses
    for (name, a), b in zip(ours.model.named_parameters(), reference.model.parameters()):
        assert torch.equal(a, b), name
    for p, q in zip(ours.model.parameters(), reference.model.parameters()):
        mine, theirs = ours.optimizer.state[p], reference.optimizer.state[q]
        assert float(mine["step"]) == theirs["step"]
        assert torch.equal(mine["exp_avg"], theirs["exp_avg"]) and torch.equal(mine["exp_avg_sq"], theirs["exp_avg_sq"])


def _relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (0 where both are zero)."""
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm()) if b.norm() > 0 else float(a.norm())


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_twenty_steps_of_scaled_adam_with_an_inf_equal_todays_step(fused):
    """ScaledAdam with its clipping rule (threshold from step 10), its scale updated every 4th step, an inf at
    step 8, at step BIG_STEP the joiner's gradient 100 times its own (which the rule clips): the device-decided
    step against today's. Where today's two updates scaled by the learning rate are written as a multiply then
    an add (``unfused``), as the device step computes them, everything agrees bit for bit; against today's
    ``add_(alpha=)`` itself, which fuses them (one rounding), losses and parameters agree to 1e-6 relative and
    what is counted (steps, the clipped steps, the norms' history) exactly."""
    flags = [*TINY, "--clip-grad-norm", "0", "--optimizer", "scaled-adam", "--base-lr", "0.02"]
    tokens = TokenTable()
    batches = _batches(tokens)
    ours, reference = Trainer(flags, vocab_size=VOCAB), Trainer(flags, vocab_size=VOCAB)
    reference.optimizer = _ScaledAdamAsToday(reference.model.parameters(), lr=0.02, fused=fused)
    reference.scheduler = Eden(reference.optimizer, reference.params.lr_batches, reference.params.lr_epochs)
    t = ours.training(tokens)
    our_losses, reference_losses = [], []
    for i, batch in enumerate(batches):
        for trainer in (ours, reference):
            trainer.params.batch_idx_train += 1
        handles = [_inject_inf(m) for m in (ours.model, reference.model)] if i == INF_STEP else []
        if i == BIG_STEP:
            models = (ours.model, reference.model)
            handles = [m.joiner.output_linear.weight.register_hook(lambda g: g * 100.0) for m in models]
        torch.manual_seed(100 + i)
        info, _, _ = train_step(t, batch)
        our_losses.append(info["loss"])
        torch.manual_seed(100 + i)
        reference_losses.append(_reference_step(reference, tokens, batch, 0.0, update=lambda o: o.step()))
        for h in handles:
            h.remove()
    t.flush_log()
    assert ours.params.skipped_steps == reference.params.skipped_steps == 1
    assert reference.optimizer.num_clipped > 0, "the rule clipped in the reference: the test covers it"
    assert ours.optimizer.num_clipped == reference.optimizer.num_clipped
    ring, theirs = ours.optimizer._clip_threshold.state_dict(), reference.optimizer.clip_threshold.state_dict()
    assert ring["steps"] == theirs["steps"] == STEPS - 1
    for p, q in zip(ours.model.parameters(), reference.model.parameters()):
        assert int(ours.optimizer.state[p]["step"]) == reference.optimizer.state[q]["step"] == STEPS - 1
    if not fused:
        assert our_losses == reference_losses and ring == theirs
        for (name, a), b in zip(ours.model.named_parameters(), reference.model.parameters()):
            assert torch.equal(a, b), name
        for p, q in zip(ours.model.parameters(), reference.model.parameters()):
            mine, theirs = ours.optimizer.state[p], reference.optimizer.state[q]
            assert all(torch.equal(mine[k], theirs[k]) for k in theirs if k != "step"), list(theirs)
        return
    losses = torch.tensor(reference_losses, dtype=torch.float64)
    torch.testing.assert_close(torch.stack(our_losses), losses, rtol=1e-6, atol=0)
    for (name, a), b in zip(ours.model.named_parameters(), reference.model.parameters()):
        assert _relative_gap(a, b) <= 1e-6, name


def test_the_prune_window_is_raised_from_the_hosts_lengths():
    """A row with more tokens than its encoder frames allow at --prune-range 5: k2 raises the window to
    ``(U - 1) // T' + 2`` (worked here: 40 tokens over 8 frames, 39 // 8 + 2 = 6). The step computes it from
    the lengths the host has (no read of the boundary) and its losses equal the model's own raise on the
    device, exactly."""
    tokens = TokenTable()
    trainer = Trainer(TINY, vocab_size=VOCAB)
    t = trainer.training(tokens)
    gen = torch.Generator().manual_seed(11)
    frames = [40, 60]  # encoder frames ((T - 3) // 2 - 1) // 2: 8 and 13
    feats = torch.full((2, 60, 80), -23.0)
    for i, (n, u) in enumerate(zip(frames, [40, 4])):
        feats[i, :n] = torch.randn(n, 80, generator=gen) * 3.0 - 8.0
        tokens.ids[f"u{i}"] = torch.randint(3, VOCAB, (u,), generator=gen).tolist()
    batch = {"inputs": feats, "supervisions": {"num_frames": torch.tensor(frames), "text": ["u0", "u1"]}}
    inputs = loss_inputs(trainer.params, t.sp, batch)
    assert trainer.params.prune_range == 5 and inputs.prune_range == 6
    t.model.eval()
    with torch.no_grad():
        _, sums, finite = batch_loss(trainer.params, t.model, inputs, is_training=False)
        x = inputs.tensors
        p = trainer.params
        simple, pruned, _, _ = t.model(
            x.features, x.feature_lens, x.tokens, p.prune_range, p.am_scale, p.lm_scale, y_lens=x.token_lens
        )
    assert finite.tolist() == [True, True]
    assert float(sums["simple_loss"]) == float(simple.sum()) and float(sums["pruned_loss"]) == float(pruned.sum())
