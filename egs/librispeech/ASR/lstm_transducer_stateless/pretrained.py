#!/usr/bin/env python3
"""Transcribe sound files with one model file (icefall's ``lstm_transducer_stateless3/pretrained.py``, on
icefall_lite).

Usage (from egs/librispeech/ASR):

  # the demo's model, after export.py --epoch 5 --avg 2
  ./lstm_transducer_stateless/pretrained.py \\
      --checkpoint lstm_transducer_stateless/exp/pretrained.pt \\
      --bpe-model data/lang_bpe_100/bpe.model \\
      --method greedy_search \\
      /path/to/foo.wav /path/to/bar.flac

  # icefall's published lstm_transducer_stateless3 (README: "Using icefall's published model"), a folder and a
  # list file (one path a line), modified beam search
  ./lstm_transducer_stateless/pretrained.py --model-preset icefall \\
      --checkpoint $D/exp/pretrained.pt --bpe-model $D/data/lang_bpe_500/bpe.model \\
      --method modified_beam_search --beam-size 4 my-recordings/ more.txt

Any sound file libsndfile reads (WAV, FLAC, OGG, MP3 with libsndfile >= 1.1),
any sample rate (resampled to 16 kHz with libsoxr) and channel count (mixed
down). Files are decoded whole, up to --max-duration seconds of audio per
batch; a longer file (an hour, say) is decoded chunk by chunk through the
encoder's states, in bounded memory and to the same text. The model runs on
the GPU when there is one. Use the model-size flags the model was trained
with (--model-preset icefall for icefall's); a checkpoint that does not fit
them is refused with the differing tensors and the flags it fits.

The transcripts are logged as icefall's pretrained.py logs them (the file
name, then its text) and printed to stdout. A file that cannot be transcribed
(missing, unreadable, empty, shorter than 0.085 s) is named with the reason
after them, the others are transcribed, and the exit status is 1.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional, Sequence

import torch

from icefall_lite.data.audio import AudioFileError, sound_files
from icefall_lite.decoding.pretrained import TorchFileDecoder, get_parser, load_model, validate_args
from icefall_lite.decoding.transcribe import report, transcribe
from icefall_lite.train.checkpoint import CheckpointError
from icefall_lite.utils import AttributeDict, script_errors, setup_logging


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = get_parser(__doc__)
    args = parser.parse_args(argv)
    validate_args(parser, args)
    params = AttributeDict(vars(args))
    setup_logging()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    logging.info(f"device: {device}")
    with script_errors("pretrained.py", CheckpointError, AudioFileError):
        paths = sound_files(params.sound_files)
        logging.info("Creating model")
        model, sp = load_model(args, params, device)
    logging.info(f"Reading sound files: {[str(p) for p in paths]}")
    transcripts = transcribe(paths, TorchFileDecoder(params, model, sp), params.max_duration)
    return report(paths, transcripts)


if __name__ == "__main__":
    sys.exit(main())
