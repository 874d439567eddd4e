"""The LSTM encoder: Conv2dSubsampling followed by a stack of RNNEncoderLayers.

The module tree is icefall's (``RNN`` with ``encoder_embed`` and
``encoder``, an ``RNNEncoder`` whose ``layers`` are the
``RNNEncoderLayer`` modules), so a state dict here has icefall's names.

As icefall's ``lstm_transducer_stateless3/lstm.py`` describes it (our own
code): every layer is a ScaledLSTM (with a GradientFilter when
``grad_filter_threshold > 0``) plus a feed-forward block, residual
connections, ActivationBalancer + BasicNorm, and icefall's layer-bypass
warm-up. Streaming is supported by passing and returning the LSTM states.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from icefall_lite.nn import scaling
from icefall_lite.nn.clip import GradientFilter
from icefall_lite.nn.scaling import (
    ActivationBalancer,
    BasicNorm,
    DoubleSwish,
    ScaledConv2d,
    ScaledLinear,
    ScaledLSTM,
)

# States of the whole encoder: h (num_layers, N, d_model or proj),
# c (num_layers, N, rnn_hidden_size).
EncoderStates = Tuple[Tensor, Tensor]
# Conv2dSubsampling: output frame p needs input frames [4p, 4p + 9), so a
# window of decode_chunk_len + 5 frames gives decode_chunk_len / 4 outputs.
SUBSAMPLING_FACTOR = 4
SUBSAMPLING_EXTRA_FRAMES = 5


def zero_states(
    num_layers: int, batch_size: int, d_model: int, rnn_hidden_size: int, device: Optional[torch.device] = None
) -> EncoderStates:
    """Initial encoder states (all streaming code starts from these): h (L, N, d_model), c (L, N, rnn_hidden_size)."""
    h = torch.zeros(num_layers, batch_size, d_model, device=device)
    c = torch.zeros(num_layers, batch_size, rnn_hidden_size, device=device)
    return h, c


def subsampled_length(num_frames: Tensor) -> Tensor:
    """Output frames of :class:`Conv2dSubsampling`: ``((T - 3) // 2 - 1) // 2`` (needs T >= 9 for 1 frame)."""
    return (((num_frames - 3) >> 1) - 1) >> 1


def real_extent(x_lens: Tensor, real: Tensor) -> Tensor:
    """(N,) int64: the input frames of each row that the training statistics count (the ActivationBalancers',
    the GradientFilters'): the batch's longest real utterance for a real row, 0 for a dummy row.

    Not each row's own length: the batch as lhotse makes it is padded to its longest utterance, and icefall's
    statistics count that padding; counting the same frames keeps icefall's numerics and makes a batch padded
    further (a static shape: extra frames, dummy rows) give the same statistics.

    Args:
      x_lens: (N,) frames of each row.
      real: (N,) bool, False for a dummy row.
    """
    longest = x_lens.masked_fill(~real, 0).max()
    return torch.where(real, longest, torch.zeros_like(longest))


def extent_mask(lengths: Tensor, frames: int) -> Tensor:
    """(N,) lengths -> (N, frames) bool, True at frame t < lengths[b]."""
    return torch.arange(frames, device=lengths.device) < lengths.unsqueeze(1)


def _masked(module: nn.Module, *args: Any, mask: Optional[Tensor]) -> Any:
    """``module(*args, mask=mask)``; ``module(*args)`` without a mask (outside training), which is also how
    a model converted for export calls the plain modules that replace the ActivationBalancers and the
    ScaledLSTMs there (:mod:`icefall_lite.export.scaling_converter`)."""
    return module(*args) if mask is None else module(*args, mask=mask)


class Conv2dSubsampling(nn.Module):
    """Three 3x3 convolutions (strides 1, 2, 2) then a linear layer: (N, T, F) -> (N, T', d_model).

    ``T' = ((T - 3) // 2 - 1) // 2``.
    """

    def __init__(
        self,
        num_features: int,
        d_model: int,
        layer1_channels: int = 8,
        layer2_channels: int = 32,
        layer3_channels: int = 128,
    ) -> None:
        super().__init__()
        if num_features < 9:
            raise ValueError(f"Conv2dSubsampling needs at least 9 feature bins, got {num_features}")
        self.conv = nn.Sequential(
            ScaledConv2d(1, layer1_channels, kernel_size=3, padding=0),
            ActivationBalancer(layer1_channels, channel_dim=1),
            DoubleSwish(),
            ScaledConv2d(layer1_channels, layer2_channels, kernel_size=3, stride=2),
            ActivationBalancer(layer2_channels, channel_dim=1),
            DoubleSwish(),
            ScaledConv2d(layer2_channels, layer3_channels, kernel_size=3, stride=2),
            ActivationBalancer(layer3_channels, channel_dim=1),
            DoubleSwish(),
        )
        out_freq = ((num_features - 3) // 2 - 1) // 2
        self.out = ScaledLinear(layer3_channels * out_freq, d_model)
        # learn_eps=False: the output norm must not learn to ignore its input.
        self.out_norm = BasicNorm(d_model, learn_eps=False)
        self.out_balancer = ActivationBalancer(d_model, channel_dim=-1, min_positive=0.45, max_positive=0.55)

    def forward(self, x: Tensor, extent: Optional[Tensor] = None) -> Tensor:
        """(N, T, num_features) -> (N, T', d_model).

        ``extent``: optional (N,) frames the balancers' statistics count (:func:`real_extent`), followed
        through each convolution's output length; every frame when None.
        """
        x = x.unsqueeze(1)  # (N, 1, T, F)
        lengths = extent
        for module in self.conv:
            if isinstance(module, ActivationBalancer) and lengths is not None:
                x = module(x, extent_mask(lengths, x.size(2))[:, None, :, None])
                continue
            x = module(x)
            if lengths is not None and isinstance(module, nn.Conv2d):
                lengths = ((lengths - module.kernel_size[0]) // module.stride[0] + 1).clamp(min=0)
        n, c, t, f = x.shape  # (N, C, T', F')
        x = self.out(x.transpose(1, 2).reshape(n, t, c * f))
        mask = None if lengths is None else extent_mask(lengths, t).unsqueeze(-1)
        return _masked(self.out_balancer, self.out_norm(x), mask=mask)


class RNNEncoderLayer(nn.Module):
    """``src += LSTM(src); src += FF(src); src = BasicNorm(balancer(src))`` with bypass warm-up.

    Args:
      d_model: input/output dimension (and the LSTM projection size when it
        differs from ``rnn_hidden_size``; equal sizes mean no projection).
      dim_feedforward: hidden size of the feed-forward block.
      rnn_hidden_size: LSTM cell size.
      grad_filter_threshold: GradientFilter threshold inside the LSTM; <= 0
        means no filter.
      grad_filter_mode: the filter's mode (:data:`icefall_lite.nn.clip.GRAD_FILTER_MODES`).
      recurrent_grad_clip: Kaldi's per-frame cap on the LSTM's recurrent derivative; 0 = off.
      dropout: dropout on both residual branches.
      layer_dropout: probability, in training, of nearly bypassing the layer
        (alpha = 0.1), as icefall.
    """

    def __init__(
        self,
        d_model: int,
        dim_feedforward: int,
        rnn_hidden_size: int,
        grad_filter_threshold: float,
        dropout: float,
        layer_dropout: float,
        grad_filter_mode: str = "soft",
        recurrent_grad_clip: float = 0.0,
    ) -> None:
        super().__init__()
        if rnn_hidden_size < d_model:
            raise ValueError(f"rnn_hidden_size ({rnn_hidden_size}) must be >= d_model ({d_model})")
        self.d_model = d_model
        self.rnn_hidden_size = rnn_hidden_size
        self.layer_dropout = layer_dropout
        proj_size = d_model if rnn_hidden_size != d_model else 0
        self.lstm = ScaledLSTM(
            input_size=d_model,
            hidden_size=rnn_hidden_size,
            proj_size=proj_size,
            grad_filter_threshold=grad_filter_threshold,
            grad_filter_mode=grad_filter_mode,
            recurrent_grad_clip=recurrent_grad_clip,
        )
        self.feed_forward = nn.Sequential(
            ScaledLinear(d_model, dim_feedforward),
            ActivationBalancer(dim_feedforward, channel_dim=-1),
            DoubleSwish(),
            nn.Dropout(dropout),
            ScaledLinear(dim_feedforward, d_model, initial_scale=0.25),
        )
        # icefall's order of the children (norm_final before balancer), so the state dict's order is icefall's too.
        self.norm_final = BasicNorm(d_model)
        self.balancer = ActivationBalancer(d_model, channel_dim=-1, min_positive=0.45, max_positive=0.55, max_abs=6.0)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self,
        src: Tensor,
        states: Optional[EncoderStates] = None,
        warmup: float = 1.0,
        mask: Optional[Tensor] = None,
    ) -> Tuple[Tensor, EncoderStates]:
        """
        Args:
          src: (T, N, d_model).
          states: (h (1, N, d_model), c (1, N, rnn_hidden_size)) or None for zeros.
          warmup: training progress in units of the model warm-up (>= 1 = warmed up).
          mask: optional (T, N, 1), the frames the balancers' and the GradientFilter's statistics count.
        Returns:
          (T, N, d_model) output and the new (h, c).
        """
        src_orig = src
        alpha = None
        if self.training:
            # icefall's draw, on the model's device: read by the host where that waits for nothing (the CPU,
            # HOST_DRAWS), else kept there (no host read), alpha a float64 tensor (as icefall's Python float:
            # 1 - alpha rounds to the activations' dtype once, as there).
            warmup_scale = min(0.1 + warmup, 1.0)
            kept = torch.rand((), device=src.device) > self.layer_dropout
            if src.device.type in scaling.HOST_DRAWS:
                alpha = warmup_scale if bool(kept) else 0.1
                alpha = None if alpha == 1.0 else alpha
            else:
                alpha = torch.where(kept, torch.full((), warmup_scale, dtype=torch.float64, device=src.device), 0.1)
        lstm_out, new_states = _masked(self.lstm, src, states, mask=mask)
        src = src + self.dropout(lstm_out)
        ff = src
        for module in self.feed_forward:
            ff = _masked(module, ff, mask=mask) if isinstance(module, ActivationBalancer) else module(ff)
        src = src + self.dropout(ff)
        src = self.norm_final(_masked(self.balancer, src, mask=mask))
        if isinstance(alpha, float):
            src = alpha * src + (1.0 - alpha) * src_orig
        elif alpha is not None:
            # Where alpha is 1 the layer's output as it is (a mask, not a branch on the host).
            src = torch.where(alpha == 1.0, src, alpha * src + (1.0 - alpha) * src_orig)
        return src, new_states


class RNNEncoder(nn.Module):
    """The stack of ``num_layers`` :class:`RNNEncoderLayer` modules: (T, N, d_model) -> (T, N, d_model).

    icefall's ``RNNEncoder`` (``model.encoder.encoder``): its only child is
    ``layers``, so the layer parameters are named
    ``encoder.encoder.layers.<i>.*`` as in icefall's checkpoints. The
    layers' arguments are :class:`RNNEncoderLayer`'s.
    """

    def __init__(
        self,
        d_model: int,
        dim_feedforward: int,
        rnn_hidden_size: int,
        num_layers: int,
        grad_filter_threshold: float,
        dropout: float,
        layer_dropout: float,
        grad_filter_mode: str = "soft",
        recurrent_grad_clip: float = 0.0,
    ) -> None:
        super().__init__()
        self.d_model = d_model
        self.rnn_hidden_size = rnn_hidden_size
        self.num_layers = num_layers
        self.layers = nn.ModuleList(
            [
                RNNEncoderLayer(
                    d_model,
                    dim_feedforward,
                    rnn_hidden_size,
                    grad_filter_threshold,
                    dropout,
                    layer_dropout,
                    grad_filter_mode=grad_filter_mode,
                    recurrent_grad_clip=recurrent_grad_clip,
                )
                for _ in range(num_layers)
            ]
        )

    def forward(
        self,
        src: Tensor,
        states: Optional[EncoderStates] = None,
        warmup: float = 1.0,
        mask: Optional[Tensor] = None,
    ) -> Tuple[Tensor, EncoderStates]:
        """
        Args:
          src: (T, N, d_model).
          states: optional (h (L, N, d_model), c (L, N, rnn_hidden_size)) to
            continue from; zeros when None.
          warmup: training progress in units of the model warm-up.
          mask: optional (T, N, 1), the frames the statistics count (:class:`RNNEncoderLayer`).
        Returns:
          (T, N, d_model) output and the final (h, c) of every layer.
        """
        new_h: List[Tensor] = []
        new_c: List[Tensor] = []
        for i, layer in enumerate(self.layers):
            layer_states = None if states is None else (states[0][i : i + 1], states[1][i : i + 1])
            src, (h, c) = layer(src, layer_states, warmup=warmup, mask=mask)
            new_h.append(h)
            new_c.append(c)
        return src, (torch.cat(new_h, dim=0), torch.cat(new_c, dim=0))


class RNN(nn.Module):
    """The encoder, icefall's ``RNN``: Conv2dSubsampling ``encoder_embed`` then the
    :class:`RNNEncoder` ``encoder``; (N, T, F) -> (N, T', d_model).

    The module tree (and so every parameter name) is icefall's
    ``lstm_transducer_stateless3`` encoder: ``encoder_embed.*`` and
    ``encoder.layers.<i>.*``, which are ``encoder.encoder_embed.*`` and
    ``encoder.encoder.layers.<i>.*`` in the transducer.

    Every size is an argument without a default: the presets of
    :data:`icefall_lite.nn.model.MODEL_PRESETS` hold the numbers. The
    layers' arguments are :class:`RNNEncoderLayer`'s.

    Padding frames at the end of a sequence do not affect the valid outputs
    (the LSTM is unidirectional), so no packing is needed.
    """

    def __init__(
        self,
        num_features: int,
        d_model: int,
        dim_feedforward: int,
        rnn_hidden_size: int,
        num_layers: int,
        grad_filter_threshold: float,
        dropout: float,
        layer_dropout: float,
        grad_filter_mode: str = "soft",
        recurrent_grad_clip: float = 0.0,
    ) -> None:
        super().__init__()
        self.num_features = num_features
        self.d_model = d_model
        self.rnn_hidden_size = rnn_hidden_size
        self.num_layers = num_layers
        self.encoder_embed = Conv2dSubsampling(num_features, d_model)
        self.encoder = RNNEncoder(
            d_model,
            dim_feedforward,
            rnn_hidden_size,
            num_layers,
            grad_filter_threshold,
            dropout,
            layer_dropout,
            grad_filter_mode=grad_filter_mode,
            recurrent_grad_clip=recurrent_grad_clip,
        )

    def get_init_states(self, batch_size: int = 1, device: Optional[torch.device] = None) -> EncoderStates:
        """Zero states: h (num_layers, N, d_model), c (num_layers, N, rnn_hidden_size).

        On ``device``, or on the device of the encoder's parameters when None.
        """
        if device is None:
            device = self.encoder_embed.out.weight.device
        return zero_states(self.num_layers, batch_size, self.d_model, self.rnn_hidden_size, device)

    def streaming_forward(self, x: Tensor, states: EncoderStates) -> Tuple[Tensor, EncoderStates]:
        """One chunk of every stream, continuing from ``states``.

        Args:
          x: (N, T, num_features), T frames valid in every stream (e.g.
            ``decode_chunk_len + SUBSAMPLING_EXTRA_FRAMES``).
          states: (h (L, N, d_model), c (L, N, rnn_hidden_size)) after the previous chunk.
        Returns:
          encoder_out (N, T', d_model) and the states after this chunk.
        """
        x_lens = torch.full((x.size(0),), x.size(1), dtype=torch.int64, device=x.device)
        encoder_out, _, next_states = self(x, x_lens, states)
        return encoder_out, next_states

    def forward(
        self,
        x: Tensor,
        x_lens: Tensor,
        states: Optional[EncoderStates] = None,
        warmup: float = 1.0,
        real: Optional[Tensor] = None,
    ) -> Tuple[Tensor, Tensor, EncoderStates]:
        """
        Args:
          x: (N, T, num_features) features.
          x_lens: (N,) valid frames per sequence.
          states: optional (h (L, N, d_model), c (L, N, rnn_hidden_size)) to
            continue from (streaming); zeros when None.
          warmup: training progress in units of the model warm-up.
          real: optional (N,) bool, False for a dummy row of a padded batch; all rows are real when None.
            In training the statistics of the balancers and the GradientFilters count the real rows'
            frames up to the longest real utterance (:func:`real_extent`), so a batch padded further gives
            the same gradients.
        Returns:
          encoder_out (N, T', d_model), encoder_out_lens (N,), final states.
        """
        extent = None
        if self.training and torch.is_grad_enabled():
            extent = real_extent(x_lens, torch.ones_like(x_lens, dtype=torch.bool) if real is None else real)
        x = self.encoder_embed(x, extent).permute(1, 0, 2)  # (T', N, d_model)
        lengths = subsampled_length(x_lens)
        mask = None if extent is None else extent_mask(subsampled_length(extent), x.size(0)).t().unsqueeze(-1)
        x, new_states = self.encoder(x, states, warmup=warmup, mask=mask)
        return x.permute(1, 0, 2), lengths, new_states

    def gradient_filters(self) -> List[Tuple[int, GradientFilter]]:
        """``[(layer_index, filter)]`` for the layers that have one (for logging)."""
        return [
            (i, layer.lstm.grad_filter)
            for i, layer in enumerate(self.encoder.layers)
            if layer.lstm.grad_filter is not None
        ]
