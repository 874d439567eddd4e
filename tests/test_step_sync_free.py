"""The sync-free training step (issue 74 item 3) equals the step it replaced: 20 steps of the tiny model, one of
them with an inf gradient, by train_step (the clip's device masks, Eve masked by the found-inf flag) and by an
independent reference written here (today's rule: a host check of the norm, torch's clip_grad_norm_, and Eve's
step as Python floats), parameters, Eve's state and losses bit for bit."""

from __future__ import annotations

import math
from typing import Dict, List

import pytest
import torch

from benchmarks.train_setup import TokenTable, Trainer
from icefall_lite.train.loss import batch_loss, compute_loss, loss_inputs
from icefall_lite.train.step import mixed_precision, train_step

TINY = ["--num-encoder-layers", "2", "--encoder-dim", "32", "--rnn-hidden-size", "32", "--dim-feedforward", "64"]
TINY += ["--decoder-dim", "32", "--joiner-dim", "32", "--layer-dropout", "0"]
VOCAB = 50
STEPS = 20
INF_STEP = 7


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


def _reference_step(trainer: Trainer, tokens: TokenTable, batch: dict, max_norm: float) -> float:
    """Today's step: forward, backward, skip on a non-finite norm read on the host, else torch's clip and Eve."""
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
        _eve_step_as_today(optimizer)
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
