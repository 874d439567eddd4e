#!/usr/bin/env python3
"""Benchmark: the cost of --recurrent-grad-clip (Kaldi's per-frame recurrent derivative cap) in a training step.

Three copies of the default model (``--model-preset cpu``) with the same weights run the recipe's
``train_step`` on the same batches, alternately:

- ``before``: every encoder layer's ScaledLSTM is the one of commit ``--before`` (read with ``git show``,
  with the GradientFilter of that commit), i.e. the default path as it was before the gradient-control rules
  of issue 39 (hard-mask filter, recurrent cap) were added to ScaledLSTM;
- ``cap off``: today's default path (``--recurrent-grad-clip 0``, the fused LSTM kernel);
- ``cap on``: ``--recurrent-grad-clip --cap`` (the LSTMs run frame by frame so the cap can act).

``cap off / before`` says whether the cap costs the default path anything; ``cap on / cap off`` is what the
cap costs when used.

Usage:
  python -m benchmarks.bench_recurrent_clip
  python -m benchmarks.bench_recurrent_clip --reps 2 --num-batches 1 --max-duration 10   # a quick look
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from benchmarks.common import (
    Section,
    add_common_arguments,
    fmt_ms,
    load_modules_at,
    markdown_table,
    median,
    paired_ratio,
    setup_threads,
    timed,
)
from benchmarks.train_setup import TokenTable, Trainer, add_batch_arguments, batch_shape, make_batches
from icefall_lite.nn.scaling import ScaledLSTM
from icefall_lite.train.optim import Eden
from icefall_lite.train.setup import make_optimizer
from icefall_lite.utils import script_parser

# The last commit before issue 39's rules touched ScaledLSTM and the GradientFilter.
BEFORE = "d2bc635"


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument("--cap", type=float, default=30.0, help="Cap of the 'cap on' arm (Kaldi's). (default: 30)")
    parser.add_argument(
        "--before", default=BEFORE, help=f"Commit whose ScaledLSTM the 'before' arm runs. (default: {BEFORE})"
    )
    parser.add_argument("--reps", type=int, default=12, help="Timed steps per arm, arms alternating. (default: 12)")
    add_batch_arguments(parser)
    add_common_arguments(parser)
    return parser


def with_lstms_of(trainer: Trainer, commit: str) -> Trainer:
    """``trainer`` with every ScaledLSTM replaced by the class of ``commit`` (same weights, same filter
    threshold), and its optimizer and scheduler rebuilt over the new parameters."""
    old = load_modules_at(commit, ["icefall_lite/nn/clip.py", "icefall_lite/nn/scaling.py"], alias="_before")
    for layer in trainer.model.encoder.encoder.layers:
        new = layer.lstm
        threshold = 0.0 if new.grad_filter is None else new.grad_filter.threshold
        lstm = old["scaling"].ScaledLSTM(
            new.input_size, new.hidden_size, proj_size=new.proj_size, grad_filter_threshold=threshold
        )
        lstm.load_state_dict(new.state_dict())
        layer.lstm = lstm
    trainer.optimizer = make_optimizer(trainer.params, trainer.model)
    trainer.scheduler = Eden(trainer.optimizer, trainer.params.lr_batches, trainer.params.lr_epochs)
    return trainer


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = get_parser().parse_args(argv)
    setup_threads(args.threads)
    tokens = TokenTable()
    batches = make_batches(args, tokens)
    arms = {
        "before": Trainer([], args.vocab_size),
        "cap off": Trainer([], args.vocab_size),
        f"cap {args.cap:g}": Trainer(["--recurrent-grad-clip", str(args.cap)], args.vocab_size),
    }
    names = list(arms)
    for name in names[1:]:
        arms[name].model.load_state_dict(arms[names[0]].model.state_dict())
    with_lstms_of(arms["before"], args.before)
    assert not any(isinstance(m, ScaledLSTM) for m in arms["before"].model.modules())
    for batch in batches:  # warm-up: oneDNN builds its kernels once per shape
        for name in names:
            arms[name].step(batch, tokens)
    times = {name: [] for name in names}
    for rep in range(args.reps):
        batch = batches[rep % len(batches)]
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            times[name].append(timed(lambda: arms[name].step(batch, tokens)))
    capped = [
        float(m.recurrent_clip_stats.fraction_clipped)
        for m in arms[names[2]].model.modules()
        if isinstance(m, ScaledLSTM) and m.recurrent_clip_stats.clipped is not None
    ]
    off_vs_before = paired_ratio(times["cap off"], times["before"])
    on_vs_off = paired_ratio(times[names[2]], times["cap off"])
    rows = [[name, fmt_ms(median(times[name]))] for name in names]
    rows.append(["cap off / before (the default path)", f"{off_vs_before:.4f} ({(off_vs_before - 1) * 100:+.1f}%)"])
    rows.append([f"cap {args.cap:g} / cap off", f"{on_vs_off:.3f}"])
    table = markdown_table(["arm", "median train_step (ms)"], rows)
    section = Section(
        title="10. Recurrent derivative cap (--recurrent-grad-clip): its cost off and on",
        threads=args.threads,
        tables=[table],
        notes=[
            f"Default model (--model-preset cpu), the recipe's train_step past warm-up; 'before' runs the "
            f"ScaledLSTM and GradientFilter of commit {args.before}.",
            f"Batches: {batch_shape(batches)} (random features and tokens, --max-duration {args.max_duration:g}).",
            f"{args.reps} steps per arm, arms in rotating order; ratios are medians of per-step ratios.",
            "Rows capped per layer in the last step of the cap arm (random batches, not the corpus): "
            + ", ".join(f"{c:.3f}" for c in capped),
        ],
    )
    section.emit(args.markdown_out)


if __name__ == "__main__":
    main()
