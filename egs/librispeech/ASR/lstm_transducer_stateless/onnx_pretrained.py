#!/usr/bin/env python3
"""Transcribe sound files with the ONNX files of export_onnx.py in onnxruntime (icefall's
``lstm_transducer_stateless3/onnx_pretrained.py``, on icefall_lite; no PyTorch model code).

Usage (from egs/librispeech/ASR, after export_onnx.py --epoch 5 --avg 2):

  ./lstm_transducer_stateless/onnx_pretrained.py \\
      --encoder-model-filename lstm_transducer_stateless/exp/encoder-epoch-5-avg-2.onnx \\
      --decoder-model-filename lstm_transducer_stateless/exp/decoder-epoch-5-avg-2.onnx \\
      --joiner-model-filename lstm_transducer_stateless/exp/joiner-epoch-5-avg-2.onnx \\
      --tokens lstm_transducer_stateless/exp/tokens.txt \\
      /path/to/foo.wav /path/to/bar.flac my-recordings/

The files are decoded as sherpa-onnx decodes them (its features, 0.35 s of
zeros after each file, the encoder's fixed windows, <unk> as blank), so the
text is sherpa-onnx's: sherpa_onnx_decode.py gives the same on the same audio.
--method greedy_search or modified_beam_search (--beam-size); the *.int8.onnx
files work too. Sound files, folders, list files, --max-duration, the log
lines and the bad-file rules are pretrained.py's (see its --help).
"""

from __future__ import annotations

import logging
import sys
from typing import Optional, Sequence

from icefall_lite.data.audio import AudioFileError, sound_files
from icefall_lite.decoding.transcribe import report, transcribe
from icefall_lite.export.onnx_pretrained import MODEL_FILE_FLAGS, OnnxFileDecoder, get_parser, validate_args
from icefall_lite.utils import script_errors, setup_logging


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = get_parser(__doc__)
    args = parser.parse_args(argv)
    validate_args(parser, args)
    setup_logging()
    logging.info(vars(args))
    with script_errors("onnx_pretrained.py", AudioFileError):
        paths = sound_files(args.sound_files)
    files = [getattr(args, name) for name in MODEL_FILE_FLAGS]
    decoder = OnnxFileDecoder(files, args.tokens, args.decoding_method, args.beam_size, args.num_threads)
    logging.info(f"Reading sound files: {[str(p) for p in paths]}")
    return report(paths, transcribe(paths, decoder, args.max_duration))


if __name__ == "__main__":
    sys.exit(main())
