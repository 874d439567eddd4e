#!/usr/bin/env python3
"""Export the LSTM transducer to ONNX in sherpa-onnx's streaming "lstm" format.

Usage (from egs/librispeech/ASR):

  ./lstm_transducer_stateless/export_onnx.py \\
      --epoch 5 --avg 2 --use-averaged-model true \\
      --exp-dir lstm_transducer_stateless/exp \\
      --bpe-model data/lang_bpe_100/bpe.model

Use the same model-size flags as in training (--model-preset, --encoder-dim, ...).
It writes into --output-dir (default: --exp-dir), as icefall's export-onnx.py:

  encoder-epoch-5-avg-2.onnx        (x (N, 9, 80), h, c) -> (encoder_out, next_h, next_c)
  decoder-epoch-5-avg-2.onnx        y (N, context_size) -> decoder_out
  joiner-epoch-5-avg-2.onnx         (encoder_out, decoder_out) -> logit
  *-epoch-5-avg-2.int8.onnx         the same, dynamically quantised to int8 (--int8 false skips them)
  tokens.txt

With --iter N the checkpoints are checkpoint-<batch>.pt (batch <= N) and the
suffix is iter-N-avg-A. With --checkpoint PATH (one model file anywhere, e.g.
icefall's published exp/pretrained.pt with --model-preset icefall) the suffix
is the file's name: encoder-pretrained.onnx, ... sherpa-onnx runs the files with its OnlineRecognizer
(model_type "lstm" is streaming-only):

  recognizer = sherpa_onnx.OnlineRecognizer.from_transducer(
      tokens="exp/tokens.txt", encoder="exp/encoder-epoch-5-avg-2.onnx",
      decoder="exp/decoder-epoch-5-avg-2.onnx", joiner="exp/joiner-epoch-5-avg-2.onnx",
      decoding_method="greedy_search")  # or "modified_beam_search"
  stream = recognizer.create_stream()
  stream.accept_waveform(16000, samples)  # float32 in [-1, 1]; add ~0.3 s of zeros at the end
  stream.input_finished()
  while recognizer.is_ready(stream):
      recognizer.decode_stream(stream)
  print(recognizer.get_result(stream))
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict, List, Optional

import torch

from icefall_lite.data.bpe import load_bpe_model
from icefall_lite.decoding.decode_run import build_decoding_model
from icefall_lite.export.cli import get_parser, validate_args
from icefall_lite.export.onnx_export import (
    ExportableTransducer,
    build_exportable,
    export_transducer_onnx,
    write_tokens_file,
)
from icefall_lite.export.onnx_runtime import OnnxRuntimeTransducer, max_abs_diff
from icefall_lite.nn.model import count_parameters
from icefall_lite.train.averaging import checkpoint_suffix, load_weights_from_flags
from icefall_lite.train.checkpoint import CheckpointError
from icefall_lite.utils import script_errors, setup_logger


@torch.no_grad()
def check_onnx(exportable: ExportableTransducer, files: Dict[str, Path], int8: bool) -> None:
    """Log the max |difference| between the PyTorch wrappers and the ONNX files on one random chunk."""
    meta = exportable.meta
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, meta.T, exportable.model.encoder.num_features, generator=gen)
    states = exportable.init_states(batch_size=2)
    want, _ = exportable.run_encoder(x, states)
    for kind in ["", ".int8"] if int8 else [""]:
        runner = OnnxRuntimeTransducer(files["encoder" + kind], files["decoder" + kind], files["joiner" + kind])
        got, _ = runner.run_encoder(x, states)
        diff = max_abs_diff(got, want)
        logging.info(f"encoder{kind or ' fp32'}: max |onnxruntime - torch| = {diff:.3g} on a random chunk")


def main(argv: Optional[List[str]] = None) -> None:
    parser = get_parser(__doc__)
    args = parser.parse_args(argv)
    validate_args(parser, args)
    output_dir = args.output_dir or args.exp_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    setup_logger(output_dir / "log" / "log-export-onnx")
    logging.info(f"Export to ONNX, arguments:\n{vars(args)}")

    sp = load_bpe_model(args.bpe_model)
    model = build_decoding_model(args, sp)
    device = torch.device("cpu")  # ONNX export is done on the CPU, as in icefall
    with script_errors("export_onnx.py", CheckpointError):
        load_weights_from_flags(model, vars(args), device)
    model.eval()
    logging.info(f"Number of model parameters: {count_parameters(model)}")

    exportable = build_exportable(model, decode_chunk_len=args.decode_chunk_len)
    suffix = checkpoint_suffix(args.epoch, args.iter, args.avg, args.checkpoint)
    files = export_transducer_onnx(exportable, output_dir, suffix, int8=args.int8)
    write_tokens_file(args.bpe_model, output_dir / "tokens.txt")
    check_onnx(exportable, files, args.int8)
    logging.info(f"Wrote {', '.join(str(f) for f in files.values())} and {output_dir / 'tokens.txt'}")
    logging.info("Done!")


if __name__ == "__main__":
    main()
