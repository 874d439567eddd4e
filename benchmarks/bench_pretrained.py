#!/usr/bin/env python3
"""Benchmark 11: real-time factor of pretrained.py and onnx_pretrained.py on sound files, beside sherpa-onnx.

Three decoders of the same files, side by side in one process: pretrained.py's
work (``icefall_lite.decoding.transcribe.transcribe`` with the PyTorch model:
reading, resampling, fbank, whole-file batches), onnx_pretrained.py's (the same
over the exported fp32 files in onnxruntime) and sherpa-onnx's
``OnlineRecognizer`` as sherpa_onnx_decode.py runs it (the files read and
resampled the same way, then decoded together with ``decode_streams``).
Greedy and modified beam search (beam 4), for the demo's model size (``cpu``)
and icefall's (``icefall``). Startup and model loading are not timed. The
weights are random (``--checkpoint`` to time a trained model): speed depends on
the sizes and the searches, little on the weights.

Usage (from the repository root, after prepare.sh):
  python -m benchmarks.bench_pretrained --threads 2 \\
      --audio egs/librispeech/ASR/download/LibriSpeech/test-clean
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import sentencepiece as spm
import torch

from benchmarks.common import (
    RECIPE,
    Section,
    add_common_arguments,
    interleaved_times,
    machine_header,
    markdown_table,
    setup_threads,
)
from icefall_lite.data.audio import audio_duration, read_audio, sound_files
from icefall_lite.data.bpe import DEFAULT_BPE_MODEL
from icefall_lite.decoding.decode_run import build_decoding_model
from icefall_lite.decoding.pretrained import TorchFileDecoder
from icefall_lite.decoding.pretrained import get_parser as pretrained_parser
from icefall_lite.decoding.transcribe import transcribe
from icefall_lite.export.onnx_export import build_exportable, export_transducer_onnx, write_tokens_file
from icefall_lite.export.onnx_pretrained import OnnxFileDecoder
from icefall_lite.export.sherpa import SherpaOnnxRecognizer
from icefall_lite.utils import AttributeDict, script_parser

METHODS = ("greedy_search", "modified_beam_search")
PRESETS = ("cpu", "icefall")


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    add_common_arguments(parser)
    parser.add_argument(
        "--audio",
        type=Path,
        default=RECIPE / "download/LibriSpeech/test-clean",
        help="Sound files, a folder or a list file. (default: the corpus's test-clean)",
    )
    parser.add_argument("--bpe-model", type=Path, default=RECIPE / DEFAULT_BPE_MODEL)
    parser.add_argument("--reps", type=int, default=3, help="Timed passes of every variant. (default: 3)")
    return parser


def variants(preset: str, bpe: Path, files: List[Path], threads: int, tmp: Path) -> Dict[str, Callable[[], object]]:
    """name -> one pass over ``files`` of every decoder and search, for a random model of ``preset``."""
    args = pretrained_parser().parse_args(["--checkpoint", "x", "--bpe-model", str(bpe), "--model-preset", preset, "x"])
    sp = spm.SentencePieceProcessor(model_file=str(bpe))
    torch.manual_seed(0)
    model = build_decoding_model(args, sp).eval()
    onnx = export_transducer_onnx(build_exportable(model), tmp, preset, int8=False)
    write_tokens_file(bpe, tmp / "tokens.txt")
    out: Dict[str, Callable[[], object]] = {}
    for method in METHODS:
        params = AttributeDict({**vars(args), "decoding_method": method})
        torch_decoder = TorchFileDecoder(params, model, sp)
        onnx_decoder = OnnxFileDecoder(list(onnx.values()), tmp / "tokens.txt", method, 4, threads)
        sherpa = SherpaOnnxRecognizer(onnx, tmp / "tokens.txt", decoding_method=method, num_threads=threads)
        out[f"pretrained.py {method}"] = lambda d=torch_decoder: transcribe(files, d, 100.0)
        out[f"onnx_pretrained.py {method}"] = lambda d=onnx_decoder: transcribe(files, d, 100.0)
        out[f"sherpa-onnx {method}"] = lambda r=sherpa: r.decode([(read_audio(p), 16000) for p in files])
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = get_parser().parse_args(argv)
    setup_threads(args.threads)
    header = machine_header(args.threads)  # the load average before the timed runs
    files = sound_files([args.audio])
    seconds = sum(audio_duration(p) for p in files)
    rows = []
    for preset in PRESETS:
        with tempfile.TemporaryDirectory() as tmp:
            times = interleaved_times(variants(preset, args.bpe_model, files, args.threads, Path(tmp)), args.reps)
        for method in METHODS:
            sherpa = sorted(times[f"sherpa-onnx {method}"])[len(times[f"sherpa-onnx {method}"]) // 2]
            for name in (f"pretrained.py {method}", f"onnx_pretrained.py {method}", f"sherpa-onnx {method}"):
                t = sorted(times[name])[len(times[name]) // 2]
                rows.append((preset, name, f"{t / seconds:.4f}", f"{t / sherpa:.2f}x"))
    title = "11. Transcribing sound files: pretrained.py and onnx_pretrained.py against sherpa-onnx"
    section = Section(title, args.threads, header=header)
    section.tables.append(markdown_table(("model", "decoder", "RTF", "time / sherpa-onnx"), rows))
    section.notes += [
        f"{len(files)} files, {seconds:.1f} s of audio from {args.audio}; random weights of the `cpu` (demo) and "
        "`icefall` presets, BPE " + str(spm.SentencePieceProcessor(model_file=str(args.bpe_model)).get_piece_size()),
        "Every variant reads and resamples the files itself (pretrained.py's reader for all three); "
        "pretrained.py: whole-file batches of up to 100 s, PyTorch; onnx_pretrained.py: the exported fp32 files "
        "in onnxruntime, sherpa-onnx's windows; sherpa-onnx: OnlineRecognizer, all files in one decode_streams loop.",
        f"One untimed warm-up pass, then {args.reps} interleaved passes (order alternating); medians; RTF = wall "
        "time / audio duration.",
    ]
    section.emit(args.markdown_out)


if __name__ == "__main__":
    main()
