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

import functools
import logging
from typing import Dict, List, Optional, Sequence, Tuple

import sentencepiece as spm
import torch
import torch.nn as nn
from lhotse import load_manifest_lazy

from icefall_lite.data.datamodule import CutDataError, LibriSpeechAsrDataModule
from icefall_lite.decoding.cli import get_params, get_parser, validate_args
from icefall_lite.decoding.decode_run import DecodeStats, decode_and_report, decode_batches, load_decoding_model
from icefall_lite.decoding.metrics import Result
from icefall_lite.decoding.offline import decode_one_batch
from icefall_lite.train.checkpoint import CheckpointError
from icefall_lite.utils import AttributeDict, script_errors, setup_logger


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


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = get_parser(__doc__)
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
