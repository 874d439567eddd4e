"""decode.py's search of one batch: the whole utterances through the encoder at once, then the search that
``--decoding-method`` names (greedy, modified beam or fast beam search) over the encoder output. The
streaming counterpart, chunk by chunk with carried states, is :mod:`icefall_lite.decoding.streaming`."""

from __future__ import annotations

from typing import Dict, List

import sentencepiece as spm
import torch
import torch.nn as nn

from icefall_lite.decoding.decode_run import batch_features, result_key
from icefall_lite.decoding.fast_beam_search import fast_beam_search_one_best
from icefall_lite.decoding.greedy_search import greedy_search, greedy_search_batch
from icefall_lite.decoding.modified_beam_search import modified_beam_search
from icefall_lite.utils import AttributeDict


def search_tokens(
    params: AttributeDict, model: nn.Module, encoder_out: torch.Tensor, encoder_out_lens: torch.Tensor
) -> List[List[int]]:
    """Token ids of every utterance, by ``params.decoding_method``.

    Args:
      encoder_out: (N, T, encoder_dim) encoder output.
      encoder_out_lens: (N,) valid frames of each utterance.
    """
    if params.decoding_method == "fast_beam_search":
        return fast_beam_search_one_best(
            model,
            encoder_out,
            encoder_out_lens,
            beam=params.beam,
            max_states=params.max_states,
            max_contexts=params.max_contexts,
        )
    if params.decoding_method == "modified_beam_search":
        return modified_beam_search(model, encoder_out, encoder_out_lens, beam=params.beam_size)
    if params.decoding_method == "greedy_search" and params.max_sym_per_frame == 1:
        return greedy_search_batch(model, encoder_out, encoder_out_lens)
    if params.decoding_method == "greedy_search":
        return [
            greedy_search(model, encoder_out[i : i + 1, : int(n)], max_sym_per_frame=params.max_sym_per_frame)
            for i, n in enumerate(encoder_out_lens.tolist())
        ]
    raise ValueError(f"Unsupported decoding method: {params.decoding_method}")


@torch.inference_mode()
def decode_one_batch(
    params: AttributeDict, model: nn.Module, sp: spm.SentencePieceProcessor, batch: dict
) -> Dict[str, List[List[str]]]:
    """Decode one batch: ``{result_key(params): [hypothesis words per utterance]}``.

    ``batch["inputs"]`` (N, T, C) gets icefall's tail padding before the encoder.
    """
    feature, feature_lens = batch_features(batch, next(model.parameters()).device)
    encoder_out, encoder_out_lens, _ = model.encoder(x=feature, x_lens=feature_lens)
    hyp_tokens = search_tokens(params, model, encoder_out, encoder_out_lens)
    return {result_key(params): [sp.decode(tokens).split() for tokens in hyp_tokens]}
