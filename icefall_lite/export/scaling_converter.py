"""Scaled modules to plain ones, for export (icefall's ``scaling_converter.py``, our own code).

:func:`convert_scaled_to_non_scaled` folds every ``Scaled*`` log-scale into
plain weights, turns :class:`~icefall_lite.nn.scaling.BasicNorm` into a
non-learned :class:`NonScaledBasicNorm` and the activation balancers into
``nn.Identity`` (the GradientFilter lives inside ScaledLSTM and disappears
with it). A ScaledLSTM without projection becomes a plain ``nn.LSTM``
(exported as the ONNX ``LSTM`` op); one with projection becomes
:class:`LSTMP`, explicit gate math, because the TorchScript ONNX exporter
refuses ``nn.LSTM(proj_size>0)``. Plain PyTorch: no ONNX import.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn
from torch import Tensor

from icefall_lite.nn.encoder import EncoderStates
from icefall_lite.nn.scaling import (
    ActivationBalancer,
    BasicNorm,
    ScaledConv1d,
    ScaledConv2d,
    ScaledEmbedding,
    ScaledLinear,
    ScaledLSTM,
)


class LSTMP(nn.Module):
    """One-layer unidirectional LSTM with optional projection, written with plain ops.

    Same maths and flat-weight layout as ``nn.LSTM`` (gates ``i, f, g, o``)::

        gates = x W_ih^T + b_ih + h W_hh^T + b_hh
        c' = sigmoid(f) * c + sigmoid(i) * tanh(g)
        h' = (sigmoid(o) * tanh(c')) W_hr^T        # W_hr only with projection

    Args:
      weight_ih: (4 * hidden, input_size).
      weight_hh: (4 * hidden, proj_size or hidden).
      bias: (4 * hidden,) = b_ih + b_hh.
      weight_hr: (proj_size, hidden) or None.
    """

    def __init__(self, weight_ih: Tensor, weight_hh: Tensor, bias: Tensor, weight_hr: Optional[Tensor]) -> None:
        super().__init__()
        self.hidden_size = weight_ih.size(0) // 4
        self.weight_ih = nn.Parameter(weight_ih.detach().clone())
        self.weight_hh = nn.Parameter(weight_hh.detach().clone())
        self.bias = nn.Parameter(bias.detach().clone())
        self.weight_hr = None if weight_hr is None else nn.Parameter(weight_hr.detach().clone())

    def forward(self, input: Tensor, hx: Optional[EncoderStates] = None) -> Tuple[Tensor, EncoderStates]:
        """
        Args:
          input: (T, N, input_size).
          hx: (h (1, N, proj_size or hidden), c (1, N, hidden)); zeros when None.
        Returns:
          output (T, N, proj_size or hidden) and (h (1, N, .), c (1, N, hidden)).
        """
        if hx is None:
            out_size = self.hidden_size if self.weight_hr is None else self.weight_hr.size(0)
            hx = (input.new_zeros(1, input.size(1), out_size), input.new_zeros(1, input.size(1), self.hidden_size))
        h, c = hx[0][0], hx[1][0]
        x_gates = torch.matmul(input, self.weight_ih.t()) + self.bias  # (T, N, 4 * hidden)
        outputs: List[Tensor] = []
        for t in range(input.size(0)):
            gates = x_gates[t] + torch.matmul(h, self.weight_hh.t())
            i, f, g, o = gates.chunk(4, dim=-1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            if self.weight_hr is not None:
                h = torch.matmul(h, self.weight_hr.t())
            outputs.append(h)
        return torch.stack(outputs, dim=0), (h.unsqueeze(0), c.unsqueeze(0))


class NonScaledBasicNorm(nn.Module):
    """:class:`~icefall_lite.nn.scaling.BasicNorm` with its ``eps`` frozen to a constant.

    ``y = x * (mean_c(x^2) + eps) ** -0.5`` over ``channel_dim``.
    """

    def __init__(self, channel_dim: int, eps: float) -> None:
        super().__init__()
        self.channel_dim = channel_dim
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """(..., C, ...) -> same shape."""
        return x * torch.rsqrt(x.square().mean(dim=self.channel_dim, keepdim=True) + self.eps)

    def extra_repr(self) -> str:
        return f"channel_dim={self.channel_dim}, eps={self.eps}"


def _factory(weight: Tensor) -> Dict[str, object]:
    return {"device": weight.device, "dtype": weight.dtype}


@torch.no_grad()
def _plain_linear(m: ScaledLinear) -> nn.Linear:
    out = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, **_factory(m.weight))
    out.weight.copy_(m.get_weight())
    if m.bias is not None:
        out.bias.copy_(m.get_bias())
    return out


@torch.no_grad()
def _plain_conv(m: Union[ScaledConv1d, ScaledConv2d]) -> Union[nn.Conv1d, nn.Conv2d]:
    cls = nn.Conv1d if isinstance(m, ScaledConv1d) else nn.Conv2d
    out = cls(
        m.in_channels,
        m.out_channels,
        m.kernel_size,
        stride=m.stride,
        padding=m.padding,
        dilation=m.dilation,
        groups=m.groups,
        bias=m.bias is not None,
        padding_mode=m.padding_mode,
        **_factory(m.weight),
    )
    out.weight.copy_(m.get_weight())
    if m.bias is not None:
        out.bias.copy_(m.get_bias())
    return out


@torch.no_grad()
def _plain_embedding(m: ScaledEmbedding) -> nn.Embedding:
    out = nn.Embedding(m.num_embeddings, m.embedding_dim, padding_idx=m.padding_idx, **_factory(m.weight))
    out.weight.copy_(m.weight * m.scale.exp())
    return out


@torch.no_grad()
def _plain_lstm(m: ScaledLSTM) -> nn.Module:
    """ScaledLSTM -> ``nn.LSTM`` (no projection) or :class:`LSTMP` (projection), scales folded in."""
    weights = dict(zip(m._flat_weights_names, m._flat_scaled_weights()))
    if m.proj_size == 0:
        out = nn.LSTM(m.input_size, m.hidden_size, num_layers=m.num_layers, bias=m.bias, **_factory(m.weight_ih_l0))
        for name, value in weights.items():
            getattr(out, name).copy_(value)
        out.flatten_parameters()
        return out
    if m.num_layers != 1:
        raise ValueError(f"LSTMP conversion supports one layer per ScaledLSTM, got num_layers={m.num_layers}")
    if m.bias:
        bias = weights["bias_ih_l0"] + weights["bias_hh_l0"]
    else:
        bias = weights["weight_ih_l0"].new_zeros(4 * m.hidden_size)
    return LSTMP(weights["weight_ih_l0"], weights["weight_hh_l0"], bias, weights["weight_hr_l0"])


def _plain_module(m: nn.Module) -> Optional[nn.Module]:
    """The exportable replacement of one module, or None to keep it (and look inside it)."""
    if isinstance(m, ScaledLSTM):
        return _plain_lstm(m)
    if isinstance(m, ScaledLinear):
        return _plain_linear(m)
    if isinstance(m, (ScaledConv1d, ScaledConv2d)):
        return _plain_conv(m)
    if isinstance(m, ScaledEmbedding):
        return _plain_embedding(m)
    if isinstance(m, BasicNorm):
        return NonScaledBasicNorm(m.channel_dim, float(m.eps.detach().exp()))
    if isinstance(m, ActivationBalancer):
        return nn.Identity()
    return None


def _replace_children(module: nn.Module) -> None:
    for name, child in module.named_children():
        replacement = _plain_module(child)
        if replacement is None:
            _replace_children(child)
        else:
            setattr(module, name, replacement)


def convert_scaled_to_non_scaled(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` in eval mode with every scaled module replaced (see the module doc).

    The copy computes the same function as ``model.eval()``; ``model`` itself is untouched.
    """
    converted = copy.deepcopy(model)
    replacement = _plain_module(converted)
    if replacement is not None:
        converted = replacement
    else:
        _replace_children(converted)
    return converted.eval()


__all__ = ["LSTMP", "NonScaledBasicNorm", "convert_scaled_to_non_scaled"]
