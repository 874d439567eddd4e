"""icefall's scaled modules: learnable log-scales on weights, BasicNorm,
ActivationBalancer and DoubleSwish (as in icefall's
``pruned_transducer_stateless2/scaling.py``; our own code).

A ``Scaled*`` module stores a weight ``W`` and a log-scale ``s`` and uses
``W * exp(s)``. Weights are initialised small (``std = 0.1 / initial_speed``)
and the log-scale carries the usual ``fan_in ** -0.5`` magnitude, so the
optimiser moves the effective weight faster early in training.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from icefall_lite.nn.clip import ClipCounts, GradientFilter, check_grad_filter_mode, recurrent_grad_clip


def _init_scaled_weight(weight: Tensor, weight_scale: Tensor, fan_in: int, initial_speed: float) -> None:
    """W ~ U(+-sqrt(3) * std), std = 0.1 / initial_speed; log-scale += log(fan_in^-0.5 / std)."""
    std = 0.1 / initial_speed
    bound = math.sqrt(3.0) * std
    with torch.no_grad():
        nn.init.uniform_(weight, -bound, bound)
        weight_scale += math.log(fan_in**-0.5 / std)


class _LogScaledWeightAndBias:
    """Mixin of the ``Scaled*`` layers: log-scales ``weight_scale`` and ``bias_scale`` (None without bias).

    The effective weight is ``weight * exp(weight_scale)``, the effective
    bias ``bias * exp(bias_scale)``.
    """

    weight: nn.Parameter
    bias: Optional[nn.Parameter]

    def _init_log_scales(self, fan_in: int, initial_scale: float, initial_speed: float) -> None:
        """Register the log-scales after the layer's own parameters; initialise weight, log-scale and bias."""
        log_scale = math.log(initial_scale)
        self.weight_scale = nn.Parameter(torch.tensor(log_scale))
        self.bias_scale = nn.Parameter(torch.tensor(log_scale)) if self.bias is not None else None
        _init_scaled_weight(self.weight, self.weight_scale, fan_in, initial_speed)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def get_weight(self) -> Tensor:
        return self.weight * self.weight_scale.exp()

    def get_bias(self) -> Optional[Tensor]:
        return None if self.bias is None else self.bias * self.bias_scale.exp()


class ScaledLinear(_LogScaledWeightAndBias, nn.Linear):
    """``nn.Linear`` with effective weight ``W * exp(weight_scale)`` and bias ``b * exp(bias_scale)``.

    Args:
      initial_scale: multiplies the initial effective weight (0.25 for the
        last layer of a residual branch, as icefall).
      initial_speed: larger = smaller stored weights = faster relative updates.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        initial_scale: float = 1.0,
        initial_speed: float = 1.0,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self._init_log_scales(in_features, initial_scale, initial_speed)

    def forward(self, x: Tensor) -> Tensor:
        """``(..., in_features)`` -> ``(..., out_features)``."""
        return F.linear(x, self.get_weight(), self.get_bias())


class _ScaledConv(_LogScaledWeightAndBias):
    """A convolution (``nn.Conv1d``/``nn.Conv2d`` after this class in the bases) with log-scaled weight and bias."""

    def __init__(self, *args, initial_scale: float = 1.0, initial_speed: float = 1.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        fan_in = self.weight.shape[1] * self.weight[0][0].numel()
        self._init_log_scales(fan_in, initial_scale, initial_speed)

    def forward(self, x: Tensor) -> Tensor:
        """``(N, C_in, L)`` -> ``(N, C_out, L')`` (1-d) or ``(N, C_in, H, W)`` -> ``(N, C_out, H', W')`` (2-d)."""
        return self._conv_forward(x, self.get_weight(), self.get_bias())


class ScaledConv1d(_ScaledConv, nn.Conv1d):
    """``nn.Conv1d`` with log-scaled weight and bias (see :class:`ScaledLinear`)."""


class ScaledConv2d(_ScaledConv, nn.Conv2d):
    """``nn.Conv2d`` with log-scaled weight and bias (see :class:`ScaledLinear`)."""


class ScaledEmbedding(nn.Module):
    """Embedding with weight ~ N(0, 0.1) and a log-scale ``scale`` initialised to log(10).

    The parameters are ``scale`` then ``weight``, in icefall's order. A
    ``padding_idx`` row (none unless given; the transducer's decoder gives
    none, so its blank row is learned, as icefall's) embeds to zero and gets
    no gradient.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.scale = nn.Parameter(torch.tensor(math.log(10.0)))
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        with torch.no_grad():
            nn.init.normal_(self.weight, std=0.1)
            if padding_idx is not None:
                self.weight[padding_idx].zero_()

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight, self.padding_idx) * self.scale.exp()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}"


class ScaledLSTM(nn.LSTM):
    """Unidirectional ``nn.LSTM`` (optionally with projection) with one log-scale per flat weight.

    The log-scale of flat weight ``<name>`` (``weight_ih_l0``, ...,
    ``weight_hr_l0``) is the parameter ``<name>_scale``, registered after the
    LSTM's own parameters, as in icefall's ``ScaledLSTM``; :meth:`scales` lists
    them in the order of ``_flat_weights_names``.

    The effective flat weights are ``w * exp(s)``. When
    ``grad_filter_threshold > 0`` a :class:`GradientFilter` sees the input and
    every effective flat weight just before the LSTM kernel, so in backward it
    filters the gradient that has come back through the recurrence. With
    ``grad_filter_threshold <= 0`` no filter exists anywhere in the graph.
    ``grad_filter_mode="hard-mask"`` makes it the hard-mask variant, which
    wraps the LSTM kernel (the sequences above the cutoff are dropped from
    the kernel's gradients, the others untouched); ``"uniform"`` scales
    every sequence alike (see :class:`GradientFilter`).

    ``recurrent_grad_clip`` (0 = off; train.py's ``--recurrent-grad-clip``):
    Kaldi's per-frame cap on the derivative of the recurrence. When it is on,
    training runs the LSTM one frame at a time in PyTorch ops, the state
    ``[h_t, c_t]`` fed to frame t+1 passing :func:`recurrent_grad_clip` (the
    same function as the kernel's, slower); otherwise, and in evaluation and
    without grad, the fused kernel runs as always. Capped rows are counted in
    :attr:`recurrent_clip_stats`.

    Input ``(T, N, C)`` (``batch_first=False``), as icefall.
    """

    def __init__(
        self,
        *args,
        initial_scale: float = 1.0,
        initial_speed: float = 1.0,
        grad_filter_threshold: float,
        grad_filter_mode: str = "soft",
        recurrent_grad_clip: float = 0.0,
        **kwargs,
    ) -> None:
        if kwargs.get("bidirectional", False):
            raise ValueError("ScaledLSTM must be unidirectional")
        if kwargs.get("batch_first", False):
            raise ValueError("ScaledLSTM takes (T, N, C) input; batch_first is not supported")
        super().__init__(*args, **kwargs)
        log_scale = math.log(initial_scale)
        self._scale_names: List[str] = [f"{name}_scale" for name in self._flat_weights_names]
        for scale_name in self._scale_names:
            self.register_parameter(scale_name, nn.Parameter(torch.tensor(log_scale)))
        std = 0.1 / initial_speed
        bound = math.sqrt(3.0) * std
        with torch.no_grad():
            for name, scale in zip(self._flat_weights_names, self.scales()):
                param = getattr(self, name)
                if "weight" in name:
                    nn.init.uniform_(param, -bound, bound)
                    scale += math.log(self.hidden_size**-0.5 / std)
                else:
                    nn.init.zeros_(param)
        if not recurrent_grad_clip >= 0:
            raise ValueError(f"recurrent_grad_clip must be >= 0 (0 = off), got {recurrent_grad_clip}")
        self.recurrent_grad_clip = float(recurrent_grad_clip)
        self.recurrent_clip_stats = ClipCounts()
        check_grad_filter_mode(grad_filter_mode)  # also without a filter: a bad flag is an error either way
        self.grad_filter: Optional[GradientFilter] = (
            GradientFilter(batch_dim=1, threshold=grad_filter_threshold, mode=grad_filter_mode)
            if grad_filter_threshold > 0
            else None
        )

    def scales(self) -> List[nn.Parameter]:
        """The log-scales ``<name>_scale``, in the order of ``_flat_weights_names``."""
        return [getattr(self, name) for name in self._scale_names]

    def _flat_scaled_weights(self) -> List[Tensor]:
        return [getattr(self, name) * scale.exp() for name, scale in zip(self._flat_weights_names, self.scales())]

    def forward(
        self, input: Tensor, hx: Optional[Tuple[Tensor, Tensor]] = None, mask: Optional[Tensor] = None
    ) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
        """
        Args:
          input: (T, N, input_size).
          hx: optional (h0, c0), h0 (num_layers, N, proj_size or hidden_size),
            c0 (num_layers, N, hidden_size); zeros when omitted.
          mask: optional (T, N, 1), the frames the GradientFilter's statistics count (see
            :class:`GradientFilter`); every frame when None.
        Returns:
          output (T, N, proj_size or hidden_size) and (h_n, c_n).
        """
        if hx is None:
            batch = input.size(1)
            real_hidden = self.proj_size if self.proj_size > 0 else self.hidden_size
            h0 = input.new_zeros(self.num_layers, batch, real_hidden)
            c0 = input.new_zeros(self.num_layers, batch, self.hidden_size)
            hx = (h0, c0)
        flat_weights = self._flat_scaled_weights()
        if self.grad_filter is not None:
            if self.grad_filter.mode == "hard-mask":
                output, h_n, c_n = self.grad_filter.around(
                    self._run_flat, input, hx[0], hx[1], *flat_weights, mask=mask
                )
                return output, (h_n, c_n)
            input, *flat_weights = self.grad_filter(input, *flat_weights, mask=mask)
        return self._run(input, hx, flat_weights)

    def _run_flat(self, input: Tensor, h0: Tensor, c0: Tensor, *flat_weights: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """:meth:`_run` on flat arguments and results, as the hard-mask filter calls it."""
        output, (h_n, c_n) = self._run(input, (h0, c0), list(flat_weights))
        return output, h_n, c_n

    def _run(
        self, input: Tensor, hx: Tuple[Tensor, Tensor], flat_weights: List[Tensor]
    ) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
        """The LSTM kernel on the effective weights (in bfloat16 itself under CUDA bf16 autocast)."""
        if self.recurrent_grad_clip > 0 and self.training and torch.is_grad_enabled():
            return self._frame_by_frame(input, hx, flat_weights)
        if cuda_autocast_dtype(input) == torch.bfloat16:
            # CUDA autocast sends an LSTM to cuDNN in float16 whatever dtype it was asked for (ATen's
            # AutocastRNN casts to kHalf), with no GradScaler behind --use-bf16: cast to bfloat16 ourselves
            # and run the LSTM with autocast off, so bf16 means bf16 here too.
            with torch.autocast(device_type="cuda", enabled=False):
                return self._lstm(
                    input.to(torch.bfloat16),
                    (hx[0].to(torch.bfloat16), hx[1].to(torch.bfloat16)),
                    [w.to(torch.bfloat16) for w in flat_weights],
                )
        return self._lstm(input, hx, flat_weights)

    def _frame_by_frame(
        self, input: Tensor, hx: Tuple[Tensor, Tensor], flat_weights: List[Tensor]
    ) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
        """The LSTM (PyTorch's gate order i, f, g, o) frame by frame, with the recurrent derivative capped."""
        if self.num_layers != 1:
            raise ValueError(f"--recurrent-grad-clip: ScaledLSTM runs one layer per LSTM, not {self.num_layers}")
        weights = dict(zip(self._flat_weights_names, flat_weights))
        bias = weights["bias_ih_l0"] + weights["bias_hh_l0"] if self.bias else None
        w_hh, w_hr = weights["weight_hh_l0"], weights.get("weight_hr_l0")
        input_gates = F.linear(input, weights["weight_ih_l0"], bias)  # (T, N, 4 hidden), one product
        h, c = hx[0][0], hx[1][0]
        stats = self.recurrent_clip_stats
        stats.start()
        outputs = []
        for t in range(input.size(0)):
            if t > 0:  # the state from frame t-1: its derivative from this frame is capped
                h, c = recurrent_grad_clip(self.recurrent_grad_clip, h, c, stats=stats)
            i, f, g, o = (input_gates[t] + F.linear(h, w_hh)).chunk(4, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            if w_hr is not None:
                h = F.linear(h, w_hr)
            outputs.append(h)
        return torch.stack(outputs), (h.unsqueeze(0), c.unsqueeze(0))

    def _lstm(
        self, input: Tensor, hx: Tuple[Tensor, Tensor], flat_weights: List[Tensor]
    ) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
        output, h_n, c_n = torch._VF.lstm(
            input,
            hx,
            flat_weights,
            self.bias,
            self.num_layers,
            self.dropout,
            self.training,
            self.bidirectional,
            self.batch_first,
        )
        return output, (h_n, c_n)


def cuda_autocast_dtype(x: Tensor) -> Optional[torch.dtype]:
    """The dtype CUDA autocast runs lower-precision ops in when ``x`` is on a GPU and autocast is on, else None."""
    if x.device.type != "cuda" or not torch.is_autocast_enabled("cuda"):
        return None
    return torch.get_autocast_dtype("cuda")


class BasicNorm(nn.Module):
    """``y = x * (mean_c(x^2) + exp(eps)) ** -0.5`` over ``channel_dim``; no mean subtraction.

    ``eps`` is stored as a log (initial 0.25) and is learnable unless
    ``learn_eps=False``.
    """

    def __init__(self, num_channels: int, channel_dim: int = -1, eps: float = 0.25, learn_eps: bool = True) -> None:
        super().__init__()
        self.num_channels = num_channels
        self.channel_dim = channel_dim
        eps_tensor = torch.tensor(eps).log()
        if learn_eps:
            self.eps = nn.Parameter(eps_tensor)
        else:
            self.register_buffer("eps", eps_tensor)

    def forward(self, x: Tensor) -> Tensor:
        assert x.shape[self.channel_dim] == self.num_channels
        scales = (x.square().mean(dim=self.channel_dim, keepdim=True) + self.eps.exp()) ** -0.5
        return x * scales


def _mean_over(x: Tensor, mask: Optional[Tensor], dims: List[int]) -> Tensor:
    """Mean of ``x`` over ``dims`` (kept), over the positions where ``mask`` (broadcastable to ``x``, 1 = counted,
    0 = not) is 1; every position when ``mask`` is None."""
    if mask is None:
        return x.mean(dim=dims, keepdim=True)
    mask = mask.to(x.dtype)
    count = mask.expand_as(x).sum(dim=dims, keepdim=True)
    return (x * mask).sum(dim=dims, keepdim=True) / count.clamp(min=1.0)


class _ActivationBalancerFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        mask: Optional[Tensor],
        active: Tensor,
        channel_dim: int,
        min_positive: float,
        max_positive: float,
        max_factor: float,
        min_abs: float,
        max_abs: float,
    ) -> Tensor:
        channel_dim = channel_dim % x.ndim
        sum_dims = [d for d in range(x.ndim) if d != channel_dim]
        x_positive = x > 0
        proportion_positive = _mean_over(x_positive.to(x.dtype), mask, sum_dims)
        factor = torch.zeros_like(proportion_positive)
        if min_positive > 0.0:
            factor = factor + (min_positive - proportion_positive).relu() * (max_factor / min_positive)
        if max_positive < 1.0:
            factor = factor + (proportion_positive - max_positive).relu() * (max_factor / (max_positive - 1.0))
        mean_abs = _mean_over(x.abs(), mask, sum_dims)
        below = (mean_abs < min_abs).to(x.dtype)
        above = (mean_abs > max_abs).to(x.dtype)
        ctx.save_for_backward(factor, x_positive, below, above, active)
        ctx.max_factor = max_factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, x_grad: Tensor):
        factor, x_positive, below, above, active = ctx.saved_tensors
        # Too small |x|: push x away from 0; too large: pull it towards 0.
        abs_factor = (below - above) * (x_positive.to(x_grad.dtype) - 0.5) * (2.0 * ctx.max_factor)
        # A batch the draw left out gets its gradient untouched (a mask, not a branch: no host read).
        x_grad = torch.where(active, x_grad - x_grad.abs() * (factor + abs_factor), x_grad)
        return x_grad, None, None, None, None, None, None, None, None


# Device types on which the training draws (the ActivationBalancers', layer dropout's) are read by the host to
# skip work, as icefall does: on the CPU a read waits for nothing, and skipping the balancers' statistics on
# 3 of 4 batches saves about a tenth of a step there (the default model, measured). On a GPU the draw stays
# on the device and masks the work instead (no host read: the step can be a CUDA graph). Tests set it to ()
# to run the GPU's path on the CPU (tests/test_graph_safety.py, tests/test_cuda_graphs.py).
HOST_DRAWS = ("cpu",)


class ActivationBalancer(nn.Module):
    """Identity in forward; in backward nudges each channel's statistics into range.

    When the fraction of positive values of a channel lies outside
    ``[min_positive, max_positive]`` or its mean ``|x|`` outside
    ``[min_abs, max_abs]``, a term proportional to ``|grad|`` (at most
    ``max_factor``) is added to push it back. As icefall after PR #612, it
    acts on a random ``prob`` of training batches with its factor scaled by
    ``1/prob``, which keeps the average push. icefall draws on the host and skips the other batches, as this
    does on the CPU (:data:`HOST_DRAWS`); on a GPU the draw stays on the device (its generator) and masks the
    push, so the step reads nothing back and one CUDA graph serves both outcomes (the statistics computed on
    every batch). The draws and the gradients are the same either way.

    ``mask`` (broadcastable to ``x``, size 1 on the channel dimension; 1 = counted) limits the statistics to
    the frames of the batch as it came, so that padding it to a static shape (extra frames, dummy rows) does
    not move them: the encoder gives it (:func:`icefall_lite.nn.encoder.extent_mask`). Without it every
    position counts, as in icefall.
    """

    def __init__(
        self,
        num_channels: int,
        channel_dim: int,
        min_positive: float = 0.05,
        max_positive: float = 0.95,
        max_factor: float = 0.01,
        min_abs: float = 0.2,
        max_abs: float = 100.0,
        prob: float = 0.25,
    ) -> None:
        super().__init__()
        self.num_channels = num_channels
        self.channel_dim = channel_dim
        self.min_positive = min_positive
        self.max_positive = max_positive
        self.max_factor = max_factor
        self.min_abs = min_abs
        self.max_abs = max_abs
        self.prob = prob

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        if not self.training or not x.requires_grad or torch.jit.is_scripting() or torch.jit.is_tracing():
            return x
        if self.prob < 1.0:
            active = torch.rand((), device=x.device) < self.prob
            if x.device.type in HOST_DRAWS and not bool(active):
                return x
        else:
            active = torch.ones((), dtype=torch.bool, device=x.device)
        return _ActivationBalancerFunction.apply(
            x,
            mask,
            active,
            self.channel_dim,
            self.min_positive,
            self.max_positive,
            self.max_factor / self.prob,
            self.min_abs,
            self.max_abs,
        )


class _DoubleSwishFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x - 1.0)

    @staticmethod
    def backward(ctx, y_grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x - 1.0)
        y = x * s
        return y_grad * (y * (1.0 - s) + s)


class DoubleSwish(nn.Module):
    """``x * sigmoid(x - 1)``; backward recomputes the sigmoid instead of storing graph tensors."""

    def forward(self, x: Tensor) -> Tensor:
        if torch.jit.is_scripting() or torch.jit.is_tracing() or not x.requires_grad:
            return x * torch.sigmoid(x - 1.0)
        return _DoubleSwishFunction.apply(x)
