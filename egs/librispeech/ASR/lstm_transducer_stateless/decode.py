#!/usr/bin/env python3
"""Decode the LSTM transducer and write icefall's WER files (icefall's
``lstm_transducer_stateless3/decode.py``, on icefall_lite).

Usage (from egs/librispeech/ASR, after train.py):

  # greedy search, averaged model between epoch-3.pt (excluded) and epoch-5.pt
  ./lstm_transducer_stateless/decode.py --epoch 5 --avg 2 \\
      --exp-dir lstm_transducer_stateless/exp --bpe-model data/lang_bpe_500/bpe.model \\
      --decoding-method greedy_search

  # modified beam search
  ./lstm_transducer_stateless/decode.py --epoch 5 --avg 2 \\
      --decoding-method modified_beam_search --beam-size 4

  # fast beam search (one best, trivial graph)
  ./lstm_transducer_stateless/decode.py --epoch 5 --avg 2 \\
      --decoding-method fast_beam_search --beam 20.0 --max-contexts 8 --max-states 64

  # the averaged model over the batch checkpoints up to checkpoint-6000.pt
  ./lstm_transducer_stateless/decode.py --iter 6000 --avg 3

  # any cut manifest, next to test-clean
  ./lstm_transducer_stateless/decode.py --test-sets test-clean data/fbank/my_cuts.jsonl.gz

  # one model file anywhere, e.g. icefall's published lstm_transducer_stateless3 (README:
  # "Using icefall's published model"); results in $D/exp/<method>/, suffix "pretrained-..."
  ./lstm_transducer_stateless/decode.py --model-preset icefall --bpe-model $D/data/lang_bpe_500/bpe.model \\
      --checkpoint $D/exp/pretrained.pt --exp-dir $D/exp --decoding-method modified_beam_search

Checkpoint selection (as icefall; ``icefall_lite.train.checkpoint.select_checkpoints``):

- ``--use-averaged-model true`` with ``--iter 0``: the average of the model
  over the batches between ``epoch-(E-A).pt`` (excluded) and ``epoch-E.pt``,
  from their ``model_avg`` entries; needs ``A < E``.
- ``--use-averaged-model true`` with ``--iter I``: the same between the
  newest and the ``A``-th older ``checkpoint-<batch>.pt`` with batch <= I.
- ``--use-averaged-model false``: the element-wise mean of the ``model``
  entries of ``epoch-(E-A+1).pt .. epoch-E.pt`` (or of the ``A`` newest
  ``checkpoint-<batch>.pt`` with batch <= I).
- ``--checkpoint PATH``: the ``model`` entry of that one file (icefall's
  format), the flags above unused; the suffix starts with the file's name.

Outputs go to ``<exp-dir>/<decoding-method>/``: ``recogs-<set>-<suffix>.txt``,
``errs-<set>-<suffix>.txt``, ``wer-summary-<set>-<suffix>.txt`` and
``log-decode-<suffix>-<date>``; the suffix is icefall's, e.g.
``epoch-5-avg-2-context-2-max-sym-per-frame-1-use-averaged-model``. The WER
and real-time factor (decoding wall time / audio duration) of every test set
are logged and printed as a table at the end.
"""

from __future__ import annotations

import argparse
import functools
import logging
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import sentencepiece as spm
import torch
import torch.nn as nn
from lhotse import load_manifest_lazy

from icefall_lite.data.datamodule import CutDataError, LibriSpeechAsrDataModule
from icefall_lite.decoding.constants import DECODING_METHODS
from icefall_lite.decoding.decode_run import (
    DecodeStats,
    add_decoding_arguments,
    add_decoding_method_argument,
    batch_features,
    check_positive,
    decode_and_report,
    decode_batches,
    load_decoding_model,
    make_suffix,
    result_key,
    validate_decoding_args,
)
from icefall_lite.decoding.fast_beam_search import fast_beam_search_one_best
from icefall_lite.decoding.greedy_search import greedy_search, greedy_search_batch
from icefall_lite.decoding.metrics import Result
from icefall_lite.decoding.modified_beam_search import modified_beam_search
from icefall_lite.recipe_defaults import AVG, EXP_DIR, NUM_EPOCHS
from icefall_lite.train.checkpoint import CheckpointError
from icefall_lite.train.checkpoint_args import add_checkpoint_arguments
from icefall_lite.utils import AttributeDict, script_errors, setup_logger

# --------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------


def get_parser() -> argparse.ArgumentParser:
    """icefall's decode.py flags plus the model-size and datamodule flags."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_decoding_method_argument(parser, DECODING_METHODS)
    parser.add_argument(
        "--beam",
        type=float,
        default=20.0,
        help="fast_beam_search: log-probability cutoff below the best score, as Kaldi's beam. (default: 20.0)",
    )
    parser.add_argument(
        "--max-contexts",
        type=int,
        default=8,
        help="fast_beam_search: max decoder contexts per utterance and frame. (default: 8)",
    )
    parser.add_argument(
        "--max-states", type=int, default=64, help="fast_beam_search: max states per utterance and frame. (default: 64)"
    )
    parser.add_argument(
        "--max-sym-per-frame",
        type=int,
        default=1,
        help="greedy_search: max symbols per frame (1 uses the batched search). (default: 1)",
    )
    parser.add_argument(
        "--blank-penalty",
        type=float,
        default=0.0,
        help="Subtracted from the blank logit before every search step (icefall's flag); > 0 "
        "makes hypotheses longer (against deletions). (default: 0.0)",
    )
    add_checkpoint_arguments(parser, epoch=NUM_EPOCHS, avg=AVG, exp_dir=EXP_DIR)
    add_decoding_arguments(parser)
    return parser


def validate_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """argparse errors naming the flag for bad values; also resolves ``args.test_set_paths``."""
    check_positive(parser, args, ["beam", "max_contexts", "max_states", "max_sym_per_frame"])
    validate_decoding_args(parser, args)


# --------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------


def search_tokens(
    params: AttributeDict, model: nn.Module, encoder_out: torch.Tensor, encoder_out_lens: torch.Tensor
) -> List[List[int]]:
    """Token ids of every utterance, by ``params.decoding_method``."""
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


def decode_dataset(
    dl: torch.utils.data.DataLoader,
    params: AttributeDict,
    model: nn.Module,
    sp: spm.SentencePieceProcessor,
    test_set: str,
) -> Tuple[Dict[str, List[Result]], DecodeStats]:
    """Decode every batch of ``dl``; results ``{key: [(cut_id, ref words, hyp words)]}`` and timing."""
    return decode_batches(
        dl,
        functools.partial(decode_one_batch, params, model, sp),
        test_set,
        desc=f"{test_set} {params.decoding_method}",
        log_interval=50 if params.decoding_method == "greedy_search" else 20,
    )


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def get_params(args: argparse.Namespace) -> AttributeDict:
    """Flags plus derived settings (result dir, suffix)."""
    params = AttributeDict(vars(args))
    params.exp_dir = Path(args.exp_dir)
    params.res_dir = params.exp_dir / params.decoding_method
    params.suffix = make_suffix(params)
    if params.blank_penalty != 0:
        params.suffix += f"-blank-penalty-{params.blank_penalty}"
    return params


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = get_parser()
    args = parser.parse_args(argv)
    validate_args(parser, args)
    params = get_params(args)
    setup_logger(params.res_dir / f"log-decode-{params.suffix}")
    logging.info("Decoding started")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    logging.info(f"Device: {device}")
    with script_errors("decode.py", CheckpointError, CutDataError):
        model, sp = load_decoding_model(args, params, device)
        model.joiner.blank_penalty = params.blank_penalty
        model.to(device)
        model.eval()
        args.return_cuts = True  # cut ids name the utterances in the result files
        datamodule = LibriSpeechAsrDataModule(args)
        decode_and_report(
            params.test_set_paths,
            lambda name, path: decode_dataset(
                datamodule.test_dataloaders(load_manifest_lazy(path)), params, model, sp, name
            ),
            params.res_dir,
            params.suffix,
            f"{params.decoding_method}, {params.suffix}",
        )


if __name__ == "__main__":
    main()
