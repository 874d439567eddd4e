"""Training-step plumbing shared by benchmarks 3 and 4: the default model,
batches of the shapes train.py's ``--max-duration`` gives on the synthetic corpus, and
the library's ``train_step`` (the one train.py runs).

The batches are random features and random token ids with the corpus's
shapes (utterance durations, 100 feature frames per second, tokens per
second), so the benchmarks need no data; the cost of a training step depends
only on those shapes.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.nn as nn

from icefall_lite.data.bpe import DEFAULT_VOCAB_SIZE
from icefall_lite.nn.model import add_model_arguments, build_transducer
from icefall_lite.recipe_defaults import TRAIN_MAX_DURATION
from icefall_lite.train.args import add_training_arguments
from icefall_lite.train.grad_control import GradientControl
from icefall_lite.train.loop import filter_stats
from icefall_lite.train.optim import Eden
from icefall_lite.train.setup import make_optimizer, training_model_config
from icefall_lite.train.step import train_step
from icefall_lite.train.step_log import read_scalars
from icefall_lite.train.training import Training
from icefall_lite.utils import AttributeDict

FRAMES_PER_SECOND = 100  # 10 ms fbank frame shift
# Tokens per second of audio of the default BPE model on the default synthetic training set
# (measured 2026-11-23: total tokens / total seconds of train-clean-100).
TOKENS_PER_SECOND = 10.6


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    """Shape of the synthetic training batches."""
    parser.add_argument(
        "--max-duration",
        type=float,
        default=TRAIN_MAX_DURATION,
        help=f"Seconds of audio per batch, as train.py's --max-duration. (default: {TRAIN_MAX_DURATION:g})",
    )
    parser.add_argument(
        "--min-utt-duration", type=float, default=2.3, help="Shortest utterance, seconds. (default: 2.3)"
    )
    parser.add_argument(
        "--max-utt-duration",
        type=float,
        default=3.2,
        help="Longest utterance, seconds (the synthetic corpus averages 2.7 s; a bucketing "
        "sampler puts similar lengths together). (default: 3.2)",
    )
    parser.add_argument(
        "--tokens-per-second",
        type=float,
        default=TOKENS_PER_SECOND,
        help=f"BPE tokens per second of audio ({TOKENS_PER_SECOND} with the default BPE-"
        f"{DEFAULT_VOCAB_SIZE} model on the synthetic training set). (default: {TOKENS_PER_SECOND})",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB_SIZE,
        help=f"BPE vocabulary size. (default: {DEFAULT_VOCAB_SIZE})",
    )
    parser.add_argument("--num-batches", type=int, default=4, help="Distinct batches, cycled through. (default: 4)")


class TokenTable:
    """Stands in for the sentencepiece model in ``train_step``: ``encode`` maps
    the batch's texts (keys) to their pre-drawn token ids."""

    def __init__(self) -> None:
        self.ids: Dict[str, List[int]] = {}

    def encode(self, texts: Sequence[str], out_type: type = int) -> List[List[int]]:
        return [self.ids[t] for t in texts]


@dataclass
class Batch:
    data: Dict[str, Any]
    audio_seconds: float


def make_batches(args: argparse.Namespace, tokens: TokenTable, seed: int = 0) -> List[Batch]:
    """``args.num_batches`` batches of random utterances filling ``args.max_duration`` seconds."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for b in range(args.num_batches):
        durations: List[float] = []
        while True:
            d = rng.uniform(args.min_utt_duration, args.max_utt_duration)
            if sum(durations) + d > args.max_duration:
                break
            durations.append(d)
        frames = [int(d * FRAMES_PER_SECOND) for d in durations]
        feats = torch.full((len(frames), max(frames), 80), -23.0)  # lhotse pads with log(1e-10)
        texts = []
        for i, n in enumerate(frames):
            feats[i, :n] = torch.randn(n, 80, generator=gen) * 3.0 - 8.0
            key = f"batch{b}-utt{i}"
            num_tokens = max(1, round(durations[i] * args.tokens_per_second))
            tokens.ids[key] = torch.randint(3, args.vocab_size, (num_tokens,), generator=gen).tolist()
            texts.append(key)
        data = {"inputs": feats, "supervisions": {"num_frames": torch.tensor(frames), "text": texts}}
        batches.append(Batch(data, sum(durations)))
    return batches


def batch_shape(batches: Sequence[Batch]) -> str:
    """Human-readable batch sizes for the notes."""
    sizes = [len(b.data["supervisions"]["text"]) for b in batches]
    frames = [int(b.data["inputs"].shape[1]) for b in batches]
    audio = [b.audio_seconds for b in batches]
    return (
        f"{len(batches)} batches of {min(sizes)}-{max(sizes)} utterances, {min(frames)}-{max(frames)} padded "
        f"feature frames, {min(audio):.1f}-{max(audio):.1f} s of audio each"
    )


class Trainer:
    """The default model of train.py's step and model flags (``extra_flags`` on top of their defaults)
    with its optimizer, scheduler and gradient control; :meth:`step` is one ``train_step`` past warm-up."""

    def __init__(self, extra_flags: Sequence[str], vocab_size: int, seed: int = 0) -> None:
        parser = argparse.ArgumentParser()
        add_training_arguments(parser)
        add_model_arguments(parser)
        self.args = parser.parse_args(list(extra_flags))
        params = AttributeDict(vars(self.args))
        # Past warm-up: pruned loss on, no layer bypass ramp.
        params.update(
            batch_idx_train=3 * params.model_warm_step, skipped_steps=0, scaler_backoffs=0, skipped_utterances=0
        )
        self.params = params
        torch.manual_seed(seed)
        self.model: nn.Module = build_transducer(**training_model_config(self.args, vocab_size=vocab_size, blank_id=0))
        self.model.train()
        self.grad_control = GradientControl.from_params(params)
        self.grad_control.install(self.model)
        self.optimizer = make_optimizer(params, self.model)
        self.scheduler = Eden(self.optimizer, params.lr_batches, params.lr_epochs)

    def training(self, tokens: TokenTable, **extra: Any) -> Training:
        """The training loop's bundle of this model, optimizer and gradient control (``extra``: the other
        :class:`Training` fields, e.g. ``scaler``)."""
        return Training(
            params=self.params,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            grad_control=self.grad_control,
            sp=tokens,
            **extra,
        )

    def step(self, batch: Batch, tokens: TokenTable) -> None:
        """``train_step`` (forward, backward, clipping, optimizer) plus reading the filters' fraction filtered."""
        train_step(self.training(tokens), batch.data)
        read_scalars([s.fraction_filtered for s in filter_stats(self.model)])


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def lstm_flops_hooks(model: nn.Module) -> Tuple[List[int], List[Any]]:
    """Forward hooks adding the analytic FLOPs of every ``nn.LSTM`` call
    (FlopCounterMode does not see oneDNN's fused LSTM kernels).

    Per time step and sequence, forward: ``2 * 4H * (I + P)`` for the gate
    matmuls (``P`` = projection size or ``H``) plus ``2 * H * P`` for the
    projection; backward counts twice the forward. Returns ``([total], handles)``.
    """
    total = [0]

    def hook(module: nn.LSTM, inputs: Tuple[torch.Tensor, ...], _output: Any) -> None:
        x = inputs[0]
        steps = x.shape[0] * x.shape[1]
        hidden = module.hidden_size
        out = module.proj_size or hidden
        per_step = 2 * 4 * hidden * (module.input_size + out) + (2 * hidden * out if module.proj_size else 0)
        total[0] += 3 * steps * per_step * module.num_layers

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.LSTM)]
    return total, handles
