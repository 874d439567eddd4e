#!/usr/bin/env python3
"""Benchmark 5: decoding speed, ours against sherpa-onnx.

Ours (PyTorch, whole-utterance encoder): batched greedy search, modified beam
search and fast beam search of ``icefall_lite.decoding`` on precomputed fbank
features, with decode.py's tail padding and default search settings. sherpa-onnx:
``OnlineRecognizer`` (greedy and modified beam search) on the model exported
in sherpa-onnx's streaming "lstm" format, fed the cuts' audio (it computes its
own fbank), all streams of a chunk decoded together with ``decode_streams``,
the same thread count. Features and audio are read into memory before timing.

The cuts are split into chunks of ``--chunk-cuts``; every chunk is decoded by
all five variants in turn (the order rotating between chunks), so all see the
same load. RTF = wall time / audio duration over the whole cut set. The WER
of each variant is printed as a check that they decode alike.

Usage (defaults: the trained default model and test-clean, from the repository root):
  python -m benchmarks.bench_decode --epoch 5 --avg 2 \\
      --exp-dir egs/librispeech/ASR/lstm_transducer_stateless/exp \\
      --cuts egs/librispeech/ASR/data/fbank/librispeech_cuts_test-clean.jsonl.gz

  # already exported files (encoder-epoch-5-avg-2.onnx, ..., tokens.txt)
  python -m benchmarks.bench_decode --onnx-dir egs/librispeech/ASR/lstm_transducer_stateless/exp
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import kaldialign
import numpy as np
import sentencepiece as spm
import torch
from lhotse import load_manifest
from lhotse.cut import Cut

from benchmarks.common import RECIPE, Section, add_common_arguments, markdown_table, setup_threads
from icefall_lite.data.bpe import DEFAULT_BPE_MODEL
from icefall_lite.data.features import LOG_EPS, NUM_MEL_BINS, NUM_TAIL_PADDED_FRAMES
from icefall_lite.data.layout import librispeech_cuts_path
from icefall_lite.decoding.decode_run import build_decoding_model
from icefall_lite.decoding.fast_beam_search import fast_beam_search_one_best
from icefall_lite.decoding.greedy_search import greedy_search_batch
from icefall_lite.decoding.modified_beam_search import modified_beam_search
from icefall_lite.export.onnx_export import build_exportable, export_transducer_onnx, onnx_filenames, write_tokens_file
from icefall_lite.export.sherpa import tail_padding
from icefall_lite.nn.model import add_model_arguments
from icefall_lite.recipe_defaults import AVG, EXP_DIR, NUM_EPOCHS
from icefall_lite.train.averaging import load_averaged_weights
from icefall_lite.utils import script_parser, str2bool

SAMPLE_RATE = 16000


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument(
        "--exp-dir",
        type=Path,
        default=RECIPE / EXP_DIR,
        help=f"Checkpoints (epoch-N.pt). (default: the recipe's {EXP_DIR})",
    )
    parser.add_argument(
        "--epoch", type=int, default=NUM_EPOCHS, help=f"Last epoch to average. (default: {NUM_EPOCHS}, train.py's last)"
    )
    parser.add_argument("--avg", type=int, default=AVG, help=f"Epochs to average, as decode.py. (default: {AVG})")
    parser.add_argument(
        "--use-averaged-model",
        type=str2bool,
        default=True,
        help="Average with model_avg, as decode.py. (default: true)",
    )
    parser.add_argument(
        "--bpe-model",
        type=Path,
        default=RECIPE / DEFAULT_BPE_MODEL,
        help=f"sentencepiece model. (default: the recipe's {DEFAULT_BPE_MODEL})",
    )
    parser.add_argument(
        "--cuts",
        type=Path,
        default=librispeech_cuts_path(RECIPE / "data" / "fbank", "test-clean"),
        help="Cut manifest with features and recordings. (default: the recipe's test-clean)",
    )
    parser.add_argument(
        "--data-root",
        type=Path,
        default=None,
        help="Folder that the manifest's relative feature/audio paths start from (the recipe "
        "folder). (default: the folder holding data/ in --cuts' path)",
    )
    parser.add_argument(
        "--onnx-dir",
        type=Path,
        default=None,
        help="Folder with encoder/decoder/joiner-epoch-E-avg-A.onnx and tokens.txt from "
        "export_onnx.py; by default the model is exported to a temporary folder.",
    )
    parser.add_argument("--max-cuts", type=int, default=0, help="Decode only the first N cuts (0 = all). (default: 0)")
    parser.add_argument(
        "--chunk-cuts",
        type=int,
        default=50,
        help="Cuts per interleaving chunk (and per batch / set of streams). (default: 50)",
    )
    parser.add_argument("--beam-size", type=int, default=4, help="modified_beam_search beam (both). (default: 4)")
    parser.add_argument("--beam", type=float, default=20.0, help="fast_beam_search beam. (default: 20)")
    parser.add_argument("--max-contexts", type=int, default=8, help="fast_beam_search max contexts. (default: 8)")
    parser.add_argument("--max-states", type=int, default=64, help="fast_beam_search max states. (default: 64)")
    add_model_arguments(parser)
    add_common_arguments(parser)
    return parser


# --------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------


def default_data_root(cuts_path: Path) -> Path:
    """``X`` for ``X/data/fbank/cuts.jsonl.gz`` (icefall's scripts run from the recipe folder)."""
    resolved = cuts_path.resolve()
    for parent in resolved.parents:
        if parent.name == "data":
            return parent.parent
    return resolved.parent


def load_inputs(cuts: Sequence[Cut], data_root: Path) -> Tuple[List[torch.Tensor], List[np.ndarray]]:
    """Features (T, 80) and 16 kHz mono float32 audio of every cut (relative paths from ``data_root``)."""
    cwd = Path.cwd()
    os.chdir(data_root)
    try:
        return _load_inputs(cuts)
    finally:
        os.chdir(cwd)


def _load_inputs(cuts: Sequence[Cut]) -> Tuple[List[torch.Tensor], List[np.ndarray]]:
    feats, audio = [], []
    for cut in cuts:
        feats.append(torch.from_numpy(cut.load_features()).float())
        samples = cut.load_audio()
        if cut.sampling_rate != SAMPLE_RATE:
            raise SystemExit(f"cut {cut.id}: sampling rate {cut.sampling_rate}, sherpa-onnx input needs {SAMPLE_RATE}")
        audio.append(samples[0].astype(np.float32))
    return feats, audio


def pad_batch(feats: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Padded (N, T + tail, 80) batch with decode.py's tail padding, and lengths."""
    lens = torch.tensor([f.shape[0] + NUM_TAIL_PADDED_FRAMES for f in feats])
    batch = torch.full((len(feats), int(lens.max()), feats[0].shape[1]), LOG_EPS)
    for i, f in enumerate(feats):
        batch[i, : f.shape[0]] = f
    return batch, lens


# --------------------------------------------------------------------------
# decoders: each maps a chunk index to hypotheses (lists of words)
# --------------------------------------------------------------------------


def torch_decoder(model: torch.nn.Module, sp: spm.SentencePieceProcessor, search: Callable) -> Callable:
    def decode(feats: Sequence[torch.Tensor], _audio: Sequence[np.ndarray]) -> List[List[str]]:
        with torch.inference_mode():
            x, x_lens = pad_batch(feats)
            encoder_out, encoder_out_lens, _ = model.encoder(x=x, x_lens=x_lens)
            return [sp.decode(t).split() for t in search(model, encoder_out, encoder_out_lens)]

    return decode


def sherpa_decoder(files: Dict[str, Path], tokens: Path, method: str, threads: int, beam_size: int) -> Callable:
    import sherpa_onnx

    recognizer = sherpa_onnx.OnlineRecognizer.from_transducer(
        tokens=str(tokens),
        encoder=str(files["encoder"]),
        decoder=str(files["decoder"]),
        joiner=str(files["joiner"]),
        num_threads=threads,
        sample_rate=SAMPLE_RATE,
        feature_dim=NUM_MEL_BINS,
        decoding_method=method,
        max_active_paths=beam_size,
    )
    tail = tail_padding(SAMPLE_RATE)

    def decode(_feats: Sequence[torch.Tensor], audio: Sequence[np.ndarray]) -> List[List[str]]:
        streams = []
        for samples in audio:
            stream = recognizer.create_stream()
            stream.accept_waveform(SAMPLE_RATE, samples)
            stream.accept_waveform(SAMPLE_RATE, tail)
            stream.input_finished()
            streams.append(stream)
        while True:
            ready = [s for s in streams if recognizer.is_ready(s)]
            if not ready:
                break
            recognizer.decode_streams(ready)
        results = [recognizer.get_result(s) for s in streams]
        return [(r if isinstance(r, str) else r.text).split() for r in results]

    return decode


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def word_errors(refs: Sequence[List[str]], hyps: Sequence[List[str]]) -> Tuple[int, int]:
    """(errors, reference words) over all utterances."""
    errors = sum(kaldialign.edit_distance(r, h)["total"] for r, h in zip(refs, hyps))
    return errors, sum(len(r) for r in refs)


def export_onnx(model: torch.nn.Module, bpe_model: Path, out_dir: Path, suffix: str) -> Tuple[Dict[str, Path], Path]:
    """Export a copy of ``model`` in sherpa-onnx's format (fp32) and tokens.txt into ``out_dir``."""
    files = export_transducer_onnx(build_exportable(copy.deepcopy(model)), out_dir, suffix, int8=False)
    tokens = out_dir / "tokens.txt"
    write_tokens_file(bpe_model, tokens)
    return files, tokens


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = get_parser()
    args = parser.parse_args(argv)
    setup_threads(args.threads)
    for flag in ("bpe_model", "cuts"):
        if not getattr(args, flag).is_file():
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)} does not exist")
    sp = spm.SentencePieceProcessor()
    sp.load(str(args.bpe_model))
    model = build_decoding_model(args, sp)
    load_averaged_weights(
        model,
        args.exp_dir,
        epoch=args.epoch,
        avg=args.avg,
        use_averaged_model=args.use_averaged_model,
        device=torch.device("cpu"),
    )
    model.eval()

    cuts = list(load_manifest(args.cuts))
    if args.max_cuts > 0:
        cuts = cuts[: args.max_cuts]
    feats, audio = load_inputs(cuts, args.data_root or default_data_root(args.cuts))
    refs = [c.supervisions[0].text.split() for c in cuts]
    audio_seconds = sum(c.duration for c in cuts)

    suffix = f"epoch-{args.epoch}-avg-{args.avg}"
    with tempfile.TemporaryDirectory() as tmp:
        if args.onnx_dir is not None:
            files, tokens = onnx_filenames(args.onnx_dir, suffix), args.onnx_dir / "tokens.txt"
            onnx_source = f"{args.onnx_dir}/*-{suffix}.onnx (fp32)"
        else:
            files, tokens = export_onnx(model, args.bpe_model, Path(tmp), suffix)
            onnx_source = "exported by the script (fp32, export_onnx.py's default chunk length)"
        variants: Dict[str, Callable] = {
            "ours greedy_search (batched)": torch_decoder(model, sp, greedy_search_batch),
            f"ours modified_beam_search (beam {args.beam_size})": torch_decoder(
                model, sp, lambda m, e, n: modified_beam_search(m, e, n, beam=args.beam_size)
            ),
            f"ours fast_beam_search (beam {args.beam:g}, {args.max_contexts} contexts, "
            f"{args.max_states} states)": torch_decoder(
                model,
                sp,
                lambda m, e, n: fast_beam_search_one_best(
                    m, e, n, beam=args.beam, max_states=args.max_states, max_contexts=args.max_contexts
                ),
            ),
            "sherpa-onnx greedy_search": sherpa_decoder(files, tokens, "greedy_search", args.threads, args.beam_size),
            f"sherpa-onnx modified_beam_search (beam {args.beam_size})": sherpa_decoder(
                files, tokens, "modified_beam_search", args.threads, args.beam_size
            ),
        }
        names = list(variants)
        wall = {n: 0.0 for n in names}
        hyps: Dict[str, List[List[str]]] = {n: [] for n in names}
        chunks = [range(i, min(i + args.chunk_cuts, len(cuts))) for i in range(0, len(cuts), args.chunk_cuts)]
        for name in names:  # warm-up (oneDNN kernels, onnxruntime sessions) on the first chunk, untimed
            variants[name]([feats[i] for i in chunks[0]], [audio[i] for i in chunks[0]])
        for k, chunk in enumerate(chunks):
            order = names[k % len(names) :] + names[: k % len(names)]
            for name in order:
                start = time.perf_counter()
                out = variants[name]([feats[i] for i in chunk], [audio[i] for i in chunk])
                wall[name] += time.perf_counter() - start
                hyps[name].extend(out)
            print(
                f"chunk {k + 1}/{len(chunks)}: " + ", ".join(f"{n.split(' (')[0]} {wall[n]:.1f} s" for n in names),
                flush=True,
            )

    rtf = {n: wall[n] / audio_seconds for n in names}
    sherpa_greedy, sherpa_beam = names[3], names[4]
    reference = {
        names[0]: sherpa_greedy,
        names[1]: sherpa_beam,
        names[2]: sherpa_beam,
        sherpa_greedy: sherpa_greedy,
        sherpa_beam: sherpa_beam,
    }
    rows = []
    for n in names:
        errors, words = word_errors(refs, hyps[n])
        rows.append(
            [
                n,
                f"{rtf[n]:.4f}",
                f"{rtf[n] / rtf[reference[n]]:.2f}x ({reference[n].split(' (')[0]})",
                f"{100 * errors / max(words, 1):.2f}",
            ]
        )
    greedy_ok = rtf[names[0]] <= rtf[sherpa_greedy]
    beams_ok = {n: rtf[n] <= 2 * rtf[sherpa_beam] for n in names[1:3]}
    section = Section(
        title="5. Decoding speed against sherpa-onnx",
        threads=args.threads,
        tables=[markdown_table(["decoder", "RTF", "RTF / sherpa-onnx", "WER %"], rows)],
        notes=[
            f"{len(cuts)} cuts, {audio_seconds:.1f} s of audio from {args.cuts}; model {args.exp_dir} "
            f"--epoch {args.epoch} --avg {args.avg} --use-averaged-model {str(args.use_averaged_model).lower()} "
            f"({sum(p.numel() for p in model.parameters()):,} parameters); ONNX: {onnx_source}.",
            "Ours: whole-utterance encoder on precomputed fbank (read before timing), batches of up to "
            f"{args.chunk_cuts} cuts, decode.py's 35 frames of tail padding. sherpa-onnx: streaming "
            "OnlineRecognizer on the audio (its time includes computing the fbank), 0.35 s of zeros appended, "
            f"up to {args.chunk_cuts} streams per decode_streams call, num_threads {args.threads}.",
            "One untimed warm-up pass of every variant over the first chunk, then interleaved per chunk of "
            f"{args.chunk_cuts} cuts, order rotating; RTF = summed wall time / audio "
            "duration. Beam searches are compared with sherpa-onnx's modified_beam_search (it has no fast beam "
            "search for this model type).",
            f"Goal batched greedy no slower than sherpa-onnx greedy: {'met' if greedy_ok else 'missed'}; beam "
            "searches within 2x of sherpa-onnx modified_beam_search: "
            + ", ".join(
                f"{n.split(' (')[0].replace('ours ', '')} {'met' if ok else 'missed'}" for n, ok in beams_ok.items()
            )
            + ".",
        ],
    )
    section.emit(args.markdown_out)


if __name__ == "__main__":
    main()
