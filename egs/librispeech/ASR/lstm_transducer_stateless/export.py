#!/usr/bin/env python3
"""Save the averaged model as one file, ``<exp-dir>/pretrained.pt`` (icefall's
``lstm_transducer_stateless3/export.py``, on icefall_lite): ``{"model": state_dict}``
in icefall's names, the file icefall publishes and pretrained.py, decode.py
(``--checkpoint``) and export_onnx.py read.

Usage (from egs/librispeech/ASR):

  # the demo's model: the average over the batches from epoch-3.pt (excluded) to epoch-5.pt
  ./lstm_transducer_stateless/export.py --epoch 5 --avg 2 \\
      --exp-dir lstm_transducer_stateless/exp --bpe-model data/lang_bpe_100/bpe.model

  # the mean of the 3 newest checkpoint-<batch>.pt with batch <= 6000
  ./lstm_transducer_stateless/export.py --iter 6000 --avg 3 --use-averaged-model false

  # icefall's preset (the model-size flags of training); --checkpoint strips one file to its model
  ./lstm_transducer_stateless/export.py --model-preset icefall --bpe-model data/lang_bpe_500/bpe.model \\
      --epoch 40 --avg 15

Checkpoint selection is decode.py's (see its --help). The weights are loaded
into the model of the size flags before they are saved, so a mismatch is
reported here, with the differing tensors and the flags that fit.
"""

from __future__ import annotations

import logging
from typing import List, Optional

import torch

from icefall_lite.data.bpe import load_bpe_model
from icefall_lite.decoding.checkpoint_fit import with_fitting_flags
from icefall_lite.decoding.decode_run import build_decoding_model
from icefall_lite.export.pretrained_pt import PRETRAINED_NAME, get_parser, save_pretrained, validate_args
from icefall_lite.nn.model import count_parameters
from icefall_lite.train.averaging import load_weights_from_flags, select_checkpoints
from icefall_lite.train.checkpoint import CheckpointError
from icefall_lite.utils import script_errors, setup_logger


def main(argv: Optional[List[str]] = None) -> None:
    parser = get_parser(__doc__)
    args = parser.parse_args(argv)
    validate_args(parser, args)
    args.exp_dir.mkdir(parents=True, exist_ok=True)
    setup_logger(args.exp_dir / "log" / "log-export")
    logging.info(f"Export, arguments:\n{vars(args)}")
    sp = load_bpe_model(args.bpe_model)
    model = build_decoding_model(args, sp)
    device = torch.device("cpu")
    with script_errors("export.py", CheckpointError):
        try:
            load_weights_from_flags(model, vars(args), device)
        except CheckpointError as e:
            flags = dict(epoch=args.epoch, iter=args.iter, avg=args.avg, use_averaged_model=args.use_averaged_model)
            checkpoint = args.checkpoint or select_checkpoints(args.exp_dir, **flags).filenames[-1]
            raise with_fitting_flags(e, checkpoint, sp.get_piece_size()) from e
    logging.info(f"Number of model parameters: {count_parameters(model)}")
    filename = args.exp_dir / PRETRAINED_NAME
    save_pretrained(model, filename)
    logging.info(f"Saved {filename}")
    logging.info("Done!")


if __name__ == "__main__":
    main()
