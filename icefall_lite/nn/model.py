"""The stateless transducer: encoder + decoder + joiner, trained with the pruned RNN-T loss."""

from __future__ import annotations

import argparse
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from icefall_lite.nn.decoder import Decoder
from icefall_lite.nn.encoder import RNN, EncoderStates
from icefall_lite.nn.joiner import Joiner
from icefall_lite.nn.rnnt_loss import make_boundary, rnnt_loss_pruned, rnnt_loss_smoothed
from icefall_lite.nn.rnnt_pruning import do_rnnt_pruning, get_rnnt_prune_ranges, get_rnnt_prune_ranges_raised
from icefall_lite.nn.scaling import ScaledLinear

# Token ids: N lists (no blank), or a padded (N, U) int64 tensor with its (N,) lengths.
TokenIds = Union[Sequence[Sequence[int]], Tensor]


def _at_least_float32(x: Tensor) -> Tensor:
    """``x`` in float32 when it is in a lower precision (the losses' recursions run in float32 under autocast,
    as icefall's), else as it is: a float64 model's losses are float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def token_id_tensors(token_ids: Sequence[Sequence[int]]) -> Tuple[Tensor, Tensor]:
    """N token-id lists -> (N, max_len) int64 padded with 0, and (N,) int64 lengths (on the CPU)."""
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64)
    out = torch.zeros((len(token_ids), int(lengths.max()) if len(token_ids) else 0), dtype=torch.int64)
    for i, ids in enumerate(token_ids):
        out[i, : len(ids)] = torch.as_tensor(list(ids), dtype=torch.int64)
    return out, lengths


def _as_tensors(y: TokenIds, y_lens: Optional[Tensor], device: torch.device) -> Tuple[Tensor, Tensor]:
    """The one form the model computes with: (N, U) int64 token ids, 0 after each row's length, and (N,)
    lengths, on ``device``. Lists are converted here, once."""
    if not isinstance(y, Tensor):
        if y_lens is not None:
            raise ValueError("y_lens goes with y as a padded tensor, not with token-id lists")
        y, y_lens = token_id_tensors(y)
    elif y_lens is None:
        raise ValueError("y as a padded (N, U) tensor needs y_lens (N,)")
    y, y_lens = y.to(device, non_blocking=True), y_lens.to(device, non_blocking=True)
    within = torch.arange(y.size(1), device=device) < y_lens.unsqueeze(1)
    return y.masked_fill(~within, 0), y_lens


class Transducer(nn.Module):
    """icefall's stateless transducer with simple and pruned losses, and an
    optional CTC head on the encoder output (as icefall's zipformer recipes).

    Args:
      encoder: (N, T, F) -> (N, T', encoder_dim).
      decoder: stateless prediction network.
      joiner: combines encoder and decoder frames into logits.
      encoder_dim, decoder_dim, vocab_size: sizes of the simple-loss projections.
      use_ctc: add ``ctc_output`` (dropout, linear, log-softmax over the
        vocabulary, blank = the decoder's blank) and return a CTC loss.
      ctc_dropout: dropout before the CTC head's linear layer.
    """

    # Parameters only training uses: a checkpoint trained with them loads into
    # a model built without them (decoding, export) with these keys dropped.
    TRAINING_ONLY_PREFIXES = ("ctc_output.",)

    def __init__(
        self,
        encoder: RNN,
        decoder: Decoder,
        joiner: Joiner,
        encoder_dim: int,
        decoder_dim: int,
        vocab_size: int,
        use_ctc: bool,
        ctc_dropout: float,
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.joiner = joiner
        self.simple_am_proj = ScaledLinear(encoder_dim, vocab_size, initial_speed=0.5)
        self.simple_lm_proj = ScaledLinear(decoder_dim, vocab_size)
        self.ctc_output: Optional[nn.Module] = None
        if use_ctc:
            self.ctc_output = nn.Sequential(
                nn.Dropout(ctc_dropout), ScaledLinear(encoder_dim, vocab_size), nn.LogSoftmax(dim=-1)
            )

    def ctc_loss(
        self, encoder_out: Tensor, encoder_out_lens: Tensor, y: TokenIds, y_lens: Optional[Tensor] = None
    ) -> Tensor:
        """Per-utterance CTC loss (N,) of the CTC head, summed over each utterance.

        Args:
          encoder_out: (N, T', encoder_dim).
          encoder_out_lens: (N,).
          y: N token-id lists (no blank), or (N, U) int64 padded, with ``y_lens`` (N,).
        An utterance too short for its labels (CTC needs a blank between
        repeated tokens) gets loss 0 and no gradient rather than inf.
        """
        if self.ctc_output is None:
            raise RuntimeError("this model has no CTC head (build it with use_ctc=True)")
        log_probs = _at_least_float32(self.ctc_output(encoder_out))  # (N, T', V)
        targets, target_lens = _as_tensors(y, y_lens, encoder_out.device)
        return F.ctc_loss(
            log_probs.permute(1, 0, 2),
            targets,
            encoder_out_lens,
            target_lens,
            blank=self.decoder.blank_id,
            reduction="none",
            zero_infinity=True,
        )

    # ----------------------------------------------------------------------
    # Streaming API (as torchaudio's RNNT: transcribe_streaming / predict /
    # join): what streaming decoding, the ONNX wrappers and sherpa-onnx
    # export run. Every output is already in the joiner's space (joiner_dim).
    # ----------------------------------------------------------------------

    def get_init_states(self, batch_size: int = 1, device: Optional[torch.device] = None) -> EncoderStates:
        """Zero encoder states: h (L, N, d_model), c (L, N, rnn_hidden_size) (the model's device when None)."""
        return self.encoder.get_init_states(batch_size, device)

    def streaming_forward(self, x: Tensor, states: EncoderStates) -> Tuple[Tensor, EncoderStates]:
        """One chunk: x (N, T, F), states -> encoder_out (N, T', joiner_dim) after ``encoder_proj``, next states."""
        encoder_out, next_states = self.encoder.streaming_forward(x, states)
        return self.joiner.encoder_proj(encoder_out), next_states

    def predict(self, y: Tensor) -> Tensor:
        """Decoder step: y int64 (N, context_size) -> decoder_out (N, joiner_dim) after ``decoder_proj``."""
        return self.joiner.decoder_proj(self.decoder(y, need_pad=False).squeeze(1))

    def join(self, encoder_out: Tensor, decoder_out: Tensor) -> Tensor:
        """(N, joiner_dim), (N, joiner_dim) (outputs of streaming_forward / predict) -> logit (N, vocab_size)."""
        return self.joiner(encoder_out, decoder_out, project_input=False)

    def forward(
        self,
        x: Tensor,
        x_lens: Tensor,
        y: TokenIds,
        prune_range: int = 5,
        am_scale: float = 0.0,
        lm_scale: float = 0.0,
        warmup: float = 1.0,
        delay_penalty: float = 0.0,
        *,
        y_lens: Optional[Tensor] = None,
        real: Optional[Tensor] = None,
        prune_range_raised: bool = False,
    ) -> Tuple[Tensor, Tensor, Optional[Tensor], Tensor]:
        """
        Args:
          x: (N, T, F) features.
          x_lens: (N,) valid frames.
          y: N token-id lists (no blank), or (N, U) int64 token ids padded after each row's length, with
            ``y_lens`` (N,) (a training step's inputs: :mod:`icefall_lite.data.static_batch`).
          prune_range: s_range of the pruned loss, raised as k2 raises it where a row has too many tokens for
            its frames (a read of the lengths on the device) unless ``prune_range_raised``: then it is
            :func:`icefall_lite.nn.rnnt_loss.raised_s_range` of these lengths already (the training step's,
            from the host's lengths).
          am_scale, lm_scale: smoothing scales of the simple loss.
          warmup: training progress in units of the model warm-up.
          delay_penalty: k2's penalty on symbol delay in both losses (arXiv 2211.00490), which
            rewards emitting symbols earlier; 0 = none.
          real: optional (N,) bool, False for a dummy row of a batch padded to a static shape: its losses are
            0 (so its gradients too) and the encoder's training statistics leave it out; all real when None.
        Returns:
          simple_loss (N,), pruned_loss (N,) (per-utterance, summed over the
          utterance, not normalised), ctc_loss (N,) (None without a CTC
          head), and encoder_out_lens (N,).
        """
        device = x.device
        y_padded, y_lens = _as_tensors(y, y_lens, device)  # (N, U), (N,)
        sizes = {x_lens.size(0), y_padded.size(0), y_lens.size(0)} | ({real.size(0)} if real is not None else set())
        if x.ndim != 3 or x_lens.ndim != 1 or sizes != {x.size(0)}:
            raise ValueError(f"bad shapes: x {tuple(x.shape)}, x_lens {tuple(x_lens.shape)}, y {tuple(y_padded.shape)}")
        encoder_out, encoder_out_lens, _ = self.encoder(x, x_lens, warmup=warmup, real=real)
        blank_id = self.decoder.blank_id
        # The decoder's input: blank, then the tokens, blank after each row's length.
        within = torch.arange(y_padded.size(1), device=device) < y_lens.unsqueeze(1)
        sos_y = F.pad(y_padded.masked_fill(~within, blank_id), (1, 0), value=blank_id)  # (N, U+1)
        decoder_out = self.decoder(sos_y)  # (N, U+1, decoder_dim)

        boundary = make_boundary(y_lens, encoder_out_lens)  # (N, 4)

        lm = self.simple_lm_proj(decoder_out)
        am = self.simple_am_proj(encoder_out)
        with torch.autocast(device_type=device.type, enabled=False):
            simple_loss, (px_grad, py_grad) = rnnt_loss_smoothed(
                lm=_at_least_float32(lm),
                am=_at_least_float32(am),
                symbols=y_padded,
                termination_symbol=blank_id,
                lm_only_scale=lm_scale,
                am_only_scale=am_scale,
                boundary=boundary,
                delay_penalty=delay_penalty,
                reduction="none",
                return_grad=True,
            )
        prune = get_rnnt_prune_ranges_raised if prune_range_raised else get_rnnt_prune_ranges
        ranges = prune(px_grad=px_grad, py_grad=py_grad, boundary=boundary, s_range=prune_range)
        am_pruned, lm_pruned = do_rnnt_pruning(
            am=self.joiner.encoder_proj(encoder_out), lm=self.joiner.decoder_proj(decoder_out), ranges=ranges
        )
        logits = self.joiner(am_pruned, lm_pruned, project_input=False)  # (N, T', prune_range, V)
        with torch.autocast(device_type=device.type, enabled=False):
            pruned_loss = rnnt_loss_pruned(
                logits=_at_least_float32(logits),
                symbols=y_padded,
                ranges=ranges,
                termination_symbol=blank_id,
                boundary=boundary,
                delay_penalty=delay_penalty,
                reduction="none",
            )
        ctc_loss = None if self.ctc_output is None else self.ctc_loss(encoder_out, encoder_out_lens, y_padded, y_lens)
        if real is not None:
            # where, not a product: a dummy row's loss gets exactly no gradient whatever its value.
            simple_loss, pruned_loss = (torch.where(real, loss, 0.0) for loss in (simple_loss, pruned_loss))
            ctc_loss = None if ctc_loss is None else torch.where(real, ctc_loss, 0.0)
        return simple_loss, pruned_loss, ctc_loss, encoder_out_lens


def build_transducer(
    *,
    vocab_size: int,
    num_features: int,
    encoder_dim: int,
    rnn_hidden_size: int,
    dim_feedforward: int,
    num_encoder_layers: int,
    decoder_dim: int,
    joiner_dim: int,
    context_size: int,
    blank_id: int,
    grad_filter_threshold: float,
    dropout: float,
    layer_dropout: float,
    use_ctc: bool,
    grad_filter_mode: str = "soft",
    recurrent_grad_clip: float = 0.0,
) -> Transducer:
    """Build the whole model; every argument but the last two is required, as torchaudio's
    ``emformer_rnnt_model``. ``grad_filter_mode`` (the GradientFilters' mode,
    :data:`icefall_lite.nn.clip.GRAD_FILTER_MODES`) and ``recurrent_grad_clip`` (Kaldi's per-frame cap in every
    LSTM, 0 = off) came later: they default to icefall's soft filter and no cap, so the configurations of
    earlier checkpoints still build. Both reach every ScaledLSTM through the encoder's constructors.

    The numbers live in :data:`MODEL_PRESETS` and the flags of
    :func:`add_model_arguments`; :func:`model_config_from_args` turns flags
    into these arguments and is the one place they are validated.
    """
    encoder = RNN(
        num_features=num_features,
        d_model=encoder_dim,
        dim_feedforward=dim_feedforward,
        rnn_hidden_size=rnn_hidden_size,
        num_layers=num_encoder_layers,
        grad_filter_threshold=grad_filter_threshold,
        dropout=dropout,
        layer_dropout=layer_dropout,
        grad_filter_mode=grad_filter_mode,
        recurrent_grad_clip=recurrent_grad_clip,
    )
    decoder = Decoder(vocab_size, decoder_dim, blank_id=blank_id, context_size=context_size)
    joiner = Joiner(encoder_dim, decoder_dim, joiner_dim, vocab_size, blank_id=blank_id)
    return Transducer(
        encoder, decoder, joiner, encoder_dim, decoder_dim, vocab_size, use_ctc=use_ctc, ctc_dropout=dropout
    )


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# The recipe's GradientFilter threshold, icefall's --grad-norm-threshold of lstm_transducer_stateless3 (train.py's
# default: icefall_lite.train.rules.RULES).
DEFAULT_GRAD_FILTER_THRESHOLD = 25.0
# Model sizes. "cpu" trains 5 epochs of the default synthetic corpus in about 36 minutes
# on 2 CPU cores; "icefall" is lstm_transducer_stateless3's size (GPU).
# With rnn_hidden_size == encoder_dim the LSTM has no projection (oneDNN
# runs it much faster on CPU); otherwise it projects back to encoder_dim.
MODEL_PRESETS: Dict[str, Dict[str, int]] = {
    "cpu": dict(
        num_encoder_layers=4,
        encoder_dim=256,
        rnn_hidden_size=256,
        dim_feedforward=1024,
        decoder_dim=256,
        joiner_dim=256,
    ),
    "icefall": dict(
        num_encoder_layers=12,
        encoder_dim=512,
        rnn_hidden_size=1024,
        dim_feedforward=2048,
        decoder_dim=512,
        joiner_dim=512,
    ),
}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Model flags shared by train.py, decode.py and export_onnx.py (their one home, with the presets).

    The GradientFilter's flags are not among them: the filter acts only in backward, so train.py has them
    with its other gradient controls (:func:`icefall_lite.train.grad_control.add_gradient_control_arguments`)
    and a model built to decode or export has no filter.
    """
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model-preset",
        choices=sorted(MODEL_PRESETS),
        default="cpu",
        help="Sizes to start from; any size flag below overrides the preset. "
        + "; ".join(f"{k}: {v}" for k, v in MODEL_PRESETS.items()),
    )
    for name in MODEL_PRESETS["cpu"]:
        group.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=None, help=f"Overrides the preset's {name}."
        )
    group.add_argument("--context-size", type=int, default=2, help="Decoder context: 1 = bigram, 2 = trigram.")


def check_model_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """An argparse error (exit 2, naming the flag) for model flags :func:`model_config_from_args` rejects."""
    try:
        model_config_from_args(args, vocab_size=2, blank_id=0, num_features=1)  # sizes only
    except ValueError as e:
        parser.error(str(e))


def model_config_from_args(
    args: argparse.Namespace, *, vocab_size: int, blank_id: int, num_features: int
) -> Dict[str, Any]:
    """:func:`build_transducer` keyword arguments for a model that decodes or exports: the preset plus
    the flags' overrides, no dropout, no CTC head and no GradientFilter (training adds those:
    :func:`icefall_lite.train.setup.training_model_config`).

    The one place the model flags are validated: ``ValueError`` naming the flag.
    """
    config: Dict[str, Any] = dict(MODEL_PRESETS[args.model_preset])
    for name in MODEL_PRESETS["cpu"]:
        value = getattr(args, name, None)
        if value is not None:
            if value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
            config[name] = value
    if config["rnn_hidden_size"] < config["encoder_dim"]:
        raise ValueError(
            f"--rnn-hidden-size ({config['rnn_hidden_size']}) must be >= --encoder-dim ({config['encoder_dim']})"
        )
    if args.context_size < 1:
        raise ValueError(f"--context-size must be >= 1, got {args.context_size}")
    config.update(
        vocab_size=vocab_size,
        blank_id=blank_id,
        num_features=num_features,
        context_size=args.context_size,
        grad_filter_threshold=0.0,  # no filter: it acts only in backward
        dropout=0.0,
        layer_dropout=0.0,
        use_ctc=False,
    )
    return config
