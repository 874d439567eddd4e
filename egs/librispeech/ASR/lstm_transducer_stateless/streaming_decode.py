#!/usr/bin/env python3
"""Decode the LSTM transducer chunk by chunk, carrying the LSTM states, and write icefall's WER files
(icefall's ``lstm_transducer_stateless3/streaming_decode.py``, on icefall_lite).

Usage (from egs/librispeech/ASR, after train.py):

  # greedy search, averaged model between epoch-3.pt (excluded) and epoch-5.pt
  ./lstm_transducer_stateless/streaming_decode.py --epoch 5 --avg 2 \\
      --exp-dir lstm_transducer_stateless/exp --bpe-model data/lang_bpe_500/bpe.model \\
      --decoding-method greedy_search

  # modified beam search
  ./lstm_transducer_stateless/streaming_decode.py --epoch 5 --avg 2 \\
      --decoding-method modified_beam_search --beam-size 4

  # icefall's published model (one file anywhere: --checkpoint; see decode.py)
  ./lstm_transducer_stateless/streaming_decode.py --model-preset icefall \\
      --bpe-model $D/data/lang_bpe_500/bpe.model --checkpoint $D/exp/pretrained.pt --exp-dir $D/exp

The model runs through its streaming API (``Transducer.streaming_forward``,
``predict``, ``join``; the same modules export_onnx.py exports, without
importing ONNX: ``icefall_lite.decoding.streaming.TorchStreamingModel``) as sherpa-onnx runs the
exported files (``icefall_lite.decoding.streaming.streaming_search``): the encoder gets
windows of ``T = decode_chunk_len + 5`` feature frames every
``decode_chunk_len`` frames with the h/c states of the previous window, and
the search advances after every window. The initial decoder context is
sherpa-onnx's ``[-1] * (context_size - 1) + [blank]``, <unk> is treated as
blank, one symbol per frame.
Features are those of the cut manifests (as decode.py), with decode.py's 35
tail frames of log(1e-10). The utterances of a batch (--max-duration) are
decoded side by side, each with its own states.

Checkpoint selection and flags are decode.py's. Outputs go to
``<exp-dir>/streaming/<decoding-method>/``: ``recogs-<set>-<suffix>.txt``,
``errs-<set>-<suffix>.txt``, ``wer-summary-<set>-<suffix>.txt`` and
``log-decode-<suffix>-<date>``, the suffix being decode.py's plus
``-decode-chunk-len-<N>``. The WER and real-time factor (decoding wall time /
audio duration) of every test set are logged and printed as a table.
"""

from __future__ import annotations

import functools
import logging
from typing import Dict, List, Optional, Sequence

import sentencepiece as spm
import torch
from lhotse import load_manifest_lazy

from icefall_lite.data.datamodule import CutDataError, LibriSpeechAsrDataModule
from icefall_lite.decoding.cli import get_streaming_params, get_streaming_parser, validate_streaming_args
from icefall_lite.decoding.decode_run import (
    batch_features,
    decode_and_report,
    decode_batches,
    load_decoding_model,
    result_key,
)
from icefall_lite.decoding.streaming import TorchStreamingModel, streaming_search
from icefall_lite.train.checkpoint import CheckpointError
from icefall_lite.utils import AttributeDict, script_errors, setup_logger


@torch.inference_mode()
def decode_one_batch(
    params: AttributeDict, model: TorchStreamingModel, sp: spm.SentencePieceProcessor, unk_id: int, batch: dict
) -> Dict[str, List[List[str]]]:
    """Decode one batch chunk by chunk: ``{result_key(params): [hypothesis words per utterance]}``.

    ``batch["inputs"]`` (N, T, C) gets decode.py's tail padding; each
    utterance is cut to its own frames before chunking.
    """
    feature, feature_lens = batch_features(batch, model.device)
    features = [feature[i, :n] for i, n in enumerate(feature_lens.tolist())]
    hyp_tokens = streaming_search(
        model,
        features,
        decoding_method=params.decoding_method,
        beam_size=params.beam_size,
        blank_id=params.blank_id,
        unk_id=unk_id,
    )
    return {result_key(params): [sp.decode(tokens).split() for tokens in hyp_tokens]}


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = get_streaming_parser(__doc__)
    args = parser.parse_args(argv)
    validate_streaming_args(parser, args)
    params = get_streaming_params(args)
    setup_logger(params.res_dir / f"log-decode-{params.suffix}")
    logging.info("Streaming decoding started")
    torch.set_num_threads(params.num_threads)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    logging.info(f"Device: {device}, {params.num_threads} CPU thread(s)")
    with script_errors("streaming_decode.py", CheckpointError, CutDataError):
        model, sp = load_decoding_model(args, params, device)
        streaming_model = TorchStreamingModel(model.to(device), decode_chunk_len=params.decode_chunk_len)
        logging.info(f"Streaming: {streaming_model.meta}")
        args.return_cuts = True  # cut ids name the utterances in the result files
        datamodule = LibriSpeechAsrDataModule(args)
        decode_batch = functools.partial(decode_one_batch, params, streaming_model, sp, model.unk_id)
        decode_and_report(
            params.test_set_paths,
            lambda name, path: decode_batches(
                datamodule.test_dataloaders(load_manifest_lazy(path)),
                decode_batch,
                name,
                desc=f"{name} streaming {params.decoding_method}",
            ),
            params.res_dir,
            params.suffix,
            f"streaming {params.decoding_method}, {params.suffix}",
        )


if __name__ == "__main__":
    main()
