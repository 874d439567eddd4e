"""The exported encoder/decoder/joiner files run with onnxruntime (for streaming decoding and export checks)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import onnxruntime as ort
import torch
from torch import Tensor

from icefall_lite.decoding.streaming import StreamingMeta
from icefall_lite.nn.encoder import EncoderStates, zero_states

PathLike = Union[str, Path]


class OnnxRuntimeTransducer:
    """The exported encoder/decoder/joiner run with onnxruntime, as a
    :class:`~icefall_lite.decoding.streaming.StreamingModel`.

    Takes torch tensors on any device and returns CPU tensors; sizes come from
    the files' metadata. ``providers``: onnxruntime execution providers (default:
    all that the installed onnxruntime has, best first).
    """

    def __init__(
        self,
        encoder: PathLike,
        decoder: PathLike,
        joiner: PathLike,
        num_threads: int = 1,
        providers: Optional[Sequence[str]] = None,
    ) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = num_threads
        options.inter_op_num_threads = num_threads
        providers = list(providers or ort.get_available_providers())
        self.encoder, self.decoder, self.joiner = (
            ort.InferenceSession(str(f), sess_options=options, providers=providers) for f in (encoder, decoder, joiner)
        )
        self.meta = StreamingMeta.from_metadata(
            *(s.get_modelmeta().custom_metadata_map for s in (self.encoder, self.decoder, self.joiner))
        )

    def init_states(self, batch_size: int = 1) -> EncoderStates:
        """Zeros: h (L, N, d_model), c (L, N, rnn_hidden_size)."""
        m = self.meta
        return zero_states(m.num_encoder_layers, batch_size, m.d_model, m.rnn_hidden_size)

    @staticmethod
    def _run(session: ort.InferenceSession, *inputs: Tensor) -> List[Tensor]:
        feeds = {i.name: t.detach().cpu().numpy() for i, t in zip(session.get_inputs(), inputs)}
        return [torch.from_numpy(np.asarray(o)) for o in session.run(None, feeds)]

    def run_encoder(self, x: Tensor, states: EncoderStates) -> Tuple[Tensor, EncoderStates]:
        """x (N, T, F) -> encoder_out (N, T', joiner_dim), next states."""
        out, h, c = self._run(self.encoder, x.float(), states[0], states[1])
        return out, (h, c)

    def run_decoder(self, y: Tensor) -> Tensor:
        """y (N, context_size) -> (N, joiner_dim)."""
        return self._run(self.decoder, y.to(torch.int64))[0]

    def run_joiner(self, encoder_out: Tensor, decoder_out: Tensor) -> Tensor:
        """(N, joiner_dim), (N, joiner_dim) -> logit (N, vocab_size)."""
        return self._run(self.joiner, encoder_out, decoder_out)[0]


def max_abs_diff(a: Tensor, b: Tensor) -> float:
    """``max |a - b|`` as a float (0 for empty tensors)."""
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


__all__ = ["OnnxRuntimeTransducer", "max_abs_diff"]
