#!/usr/bin/env python3
"""Decode cut sets with sherpa-onnx and the files of export_onnx.py, and write icefall's WER files.

Usage (from egs/librispeech/ASR, after export_onnx.py --epoch 5 --avg 2):

  ./lstm_transducer_stateless/sherpa_onnx_decode.py --epoch 5 --avg 2 \\
      --exp-dir lstm_transducer_stateless/exp --decoding-method greedy_search

  # modified beam search with the int8 files
  ./lstm_transducer_stateless/sherpa_onnx_decode.py --epoch 5 --avg 2 \\
      --decoding-method modified_beam_search --beam-size 4 --int8 true

--epoch/--iter/--avg (or --checkpoint) name the files as export_onnx.py did
(``<onnx-dir>/encoder-epoch-5-avg-2.onnx``, or ``encoder-pretrained.onnx``
for ``--checkpoint .../pretrained.pt``, ...; --onnx-dir defaults to
--exp-dir). The audio of every cut (the recording in the cut manifest) goes
to sherpa-onnx's OnlineRecognizer, which computes the fbank itself and runs
the encoder chunk by chunk (model_type "lstm" is streaming-only in
sherpa-onnx). Every waveform gets 0.35 s of zeros appended, the counterpart
of decode.py's 35 tail frames. --num-streams cuts are decoded side by side.

Outputs go to ``<exp-dir>/sherpa-onnx/<decoding-method>/``:
``recogs-<set>-<suffix>.txt``, ``errs-<set>-<suffix>.txt``,
``wer-summary-<set>-<suffix>.txt`` and ``log-decode-<suffix>-<date>``, the
suffix as decode.py's (e.g. ``epoch-5-avg-2-context-2-max-sym-per-frame-1``)
plus ``-decode-chunk-len-<N>`` and ``-int8`` for the int8 files. The WER and
real-time factor (wall time of reading the audio and decoding / audio
duration) of every test set are logged and printed as a table.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import logging
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

from lhotse import load_manifest_lazy
from lhotse.cut import Cut

from icefall_lite.data.datamodule import CutDataError
from icefall_lite.decoding.constants import STREAMING_METHODS
from icefall_lite.decoding.decode_run import (
    add_decoding_method_argument,
    add_num_threads_argument,
    add_test_sets_argument,
    check_positive,
    decode_and_report,
    decode_batches,
    make_suffix,
    result_key,
    validate_test_sets,
)
from icefall_lite.decoding.streaming import StreamingMeta
from icefall_lite.export.onnx_export import onnx_filenames, read_meta_data
from icefall_lite.export.sherpa import SherpaOnnxRecognizer, cut_waveform
from icefall_lite.recipe_defaults import AVG, EXP_DIR, NUM_EPOCHS
from icefall_lite.train.averaging import checkpoint_suffix
from icefall_lite.train.checkpoint_args import validate_checkpoint_args
from icefall_lite.utils import AttributeDict, script_errors, setup_logger, str2bool


def get_parser() -> argparse.ArgumentParser:
    """Which exported files, the search, the threads and the test sets."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--epoch",
        type=int,
        default=NUM_EPOCHS,
        help=f"The --epoch given to export_onnx.py (names the files). (default: {NUM_EPOCHS})",
    )
    parser.add_argument(
        "--iter",
        type=int,
        default=0,
        help="The --iter given to export_onnx.py; if positive, --epoch is ignored. (default: 0)",
    )
    parser.add_argument(
        "--avg", type=int, default=AVG, help=f"The --avg given to export_onnx.py (names the files). (default: {AVG})"
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="The --checkpoint given to export_onnx.py: only its name is used, to name the files "
        "(pretrained.pt -> encoder-pretrained.onnx, ...); --epoch/--iter/--avg are then not used. (default: none)",
    )
    parser.add_argument(
        "--exp-dir", type=Path, default=EXP_DIR, help=f"Results are written below it. (default: {EXP_DIR})"
    )
    parser.add_argument(
        "--onnx-dir",
        type=Path,
        default=None,
        help="Where export_onnx.py wrote the .onnx files and tokens.txt (its --output-dir). (default: --exp-dir)",
    )
    parser.add_argument("--int8", type=str2bool, default=False, help="Use the *.int8.onnx files. (default: false)")
    add_decoding_method_argument(parser, STREAMING_METHODS, "sherpa-onnx's search.")
    parser.add_argument(
        "--beam-size",
        type=int,
        default=4,
        help="modified_beam_search: hypotheses kept per frame (sherpa-onnx's max_active_paths). (default: 4)",
    )
    add_num_threads_argument(parser)
    parser.add_argument(
        "--num-streams",
        type=int,
        default=32,
        help="Cuts decoded side by side (sherpa-onnx's decode_streams). (default: 32)",
    )
    parser.add_argument(
        "--manifest-dir",
        type=Path,
        default=Path("data/fbank"),
        help="Where the cut manifests librispeech_cuts_<part>.jsonl.gz are. (default: data/fbank)",
    )
    add_test_sets_argument(parser)
    return parser


def validate_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """argparse errors naming the flag for bad values or missing files; sets ``args.files``,
    ``args.tokens``, ``args.meta`` and ``args.test_set_paths``."""
    validate_checkpoint_args(parser, args, checkpoint_must_exist=False)
    check_positive(parser, args, ["beam_size", "num_threads", "num_streams"])
    onnx_dir = args.onnx_dir or args.exp_dir
    suffix = checkpoint_suffix(args.epoch, args.iter, args.avg, args.checkpoint)
    args.files = onnx_filenames(onnx_dir, suffix, int8=args.int8)
    args.tokens = onnx_dir / "tokens.txt"
    for path in [*args.files.values(), args.tokens]:
        if not path.is_file():
            parser.error(
                f"{path} does not exist: run export_onnx.py with the same --epoch/--iter/--avg or --checkpoint "
                f"(and --output-dir {onnx_dir} if it is not --exp-dir), or pass --onnx-dir"
            )
    args.meta = StreamingMeta.from_metadata(*(read_meta_data(args.files[p]) for p in ("encoder", "decoder", "joiner")))
    validate_test_sets(parser, args)


def get_params(args: argparse.Namespace) -> AttributeDict:
    """Flags plus derived settings (result dir, suffix)."""
    params = AttributeDict(vars(args))
    params.update(context_size=args.meta.context_size, max_sym_per_frame=1, use_averaged_model=False)
    params.res_dir = Path(args.exp_dir) / "sherpa-onnx" / params.decoding_method
    params.suffix = f"{make_suffix(params)}-decode-chunk-len-{args.meta.decode_chunk_len}" + (
        "-int8" if args.int8 else ""
    )
    return params


def cut_batches(cuts: Iterator[Cut], size: int) -> Iterator[dict]:
    """Groups of ``size`` cuts as decode.py's batches: ``{"supervisions": {"text": [...], "cut": [...]}}``."""
    while group := list(itertools.islice(cuts, size)):
        texts = [" ".join(s.text for s in cut.supervisions) for cut in group]
        yield {"supervisions": {"text": texts, "cut": group}}


def decode_one_batch(
    params: AttributeDict, recognizer: SherpaOnnxRecognizer, batch: dict
) -> Dict[str, List[List[str]]]:
    """``{result_key(params): [hypothesis words per cut]}`` of one group of cuts."""
    return {result_key(params): recognizer.decode([cut_waveform(cut) for cut in batch["supervisions"]["cut"]])}


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = get_parser()
    args = parser.parse_args(argv)
    validate_args(parser, args)
    params = get_params(args)
    setup_logger(params.res_dir / f"log-decode-{params.suffix}")
    logging.info("sherpa-onnx decoding started")
    logging.info(params)
    recognizer = SherpaOnnxRecognizer(
        params.files,
        params.tokens,
        decoding_method=params.decoding_method,
        beam_size=params.beam_size,
        num_threads=params.num_threads,
    )
    decode_batch = functools.partial(decode_one_batch, params, recognizer)
    # A cut without readable audio raises ValueError, an empty test set CutDataError.
    with script_errors("sherpa_onnx_decode.py", CutDataError, ValueError):
        decode_and_report(
            params.test_set_paths,
            lambda name, path: decode_batches(
                cut_batches(iter(load_manifest_lazy(path)), params.num_streams),
                decode_batch,
                name,
                desc=f"{name} sherpa-onnx {params.decoding_method}",
            ),
            params.res_dir,
            params.suffix,
            f"sherpa-onnx {params.decoding_method}, {params.suffix}",
        )


if __name__ == "__main__":
    main()
