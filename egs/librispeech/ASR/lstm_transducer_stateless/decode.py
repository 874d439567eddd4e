#!/usr/bin/env python3
"""Decode the LSTM transducer and write icefall's WER files (icefall's
``lstm_transducer_stateless3/decode.py``, on icefall_lite).

Usage (from egs/librispeech/ASR, after train.py):

  # greedy search, averaged model between epoch-5.pt (excluded) and epoch-8.pt
  ./lstm_transducer_stateless/decode.py --epoch 8 --avg 3 \
      --exp-dir lstm_transducer_stateless/exp --bpe-model data/lang_bpe_500/bpe.model \
      --decoding-method greedy_search

  # modified beam search
  ./lstm_transducer_stateless/decode.py --epoch 8 --avg 3 \
      --decoding-method modified_beam_search --beam-size 4

  # fast beam search (one best, trivial graph)
  ./lstm_transducer_stateless/decode.py --epoch 8 --avg 3 \
      --decoding-method fast_beam_search --beam 20.0 --max-contexts 8 --max-states 64

  # the averaged model over the batch checkpoints up to checkpoint-6000.pt
  ./lstm_transducer_stateless/decode.py --iter 6000 --avg 3

  # any cut manifest, next to test-clean
  ./lstm_transducer_stateless/decode.py --test-sets test-clean data/fbank/my_cuts.jsonl.gz

Checkpoint selection (as icefall; ``icefall_lite.checkpoint.select_checkpoints``):

- ``--use-averaged-model true`` with ``--iter 0``: the average of the model
  over the batches between ``epoch-(E-A).pt`` (excluded) and ``epoch-E.pt``,
  from their ``model_avg`` entries; needs ``A < E``.
- ``--use-averaged-model true`` with ``--iter I``: the same between the
  newest and the ``A``-th older ``checkpoint-<batch>.pt`` with batch <= I.
- ``--use-averaged-model false``: the element-wise mean of the ``model``
  entries of ``epoch-(E-A+1).pt .. epoch-E.pt`` (or of the ``A`` newest
  ``checkpoint-<batch>.pt`` with batch <= I).

Outputs go to ``<exp-dir>/<decoding-method>/``: ``recogs-<set>-<suffix>.txt``,
``errs-<set>-<suffix>.txt``, ``wer-summary-<set>-<suffix>.txt`` and
``log-decode-<suffix>-<date>``; the suffix is icefall's, e.g.
``epoch-8-avg-3-context-2-max-sym-per-frame-1-use-averaged-model``. The WER
and real-time factor (decoding wall time / audio duration) of every test set
are logged and printed as a table at the end.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import sentencepiece as spm
import torch
import torch.nn as nn
from lhotse import CutSet, load_manifest_lazy
from tqdm import tqdm

from icefall_lite.checkpoint import CheckpointError, checkpoint_suffix, load_averaged_weights
from icefall_lite.data import LibriSpeechAsrDataModule
from icefall_lite.metrics import Result, save_results
from icefall_lite.model import add_model_arguments, build_transducer, count_parameters, model_config_from_args
from icefall_lite.search import (
    fast_beam_search_one_best,
    greedy_search,
    greedy_search_batch,
    modified_beam_search,
)
from icefall_lite.utils import AttributeDict, setup_logger, str2bool

LOG_EPS = math.log(1e-10)
# icefall pads this many frames of LOG_EPS at the end of every utterance
# before the LSTM encoder, against deletions at the end of utterances.
NUM_TAIL_PADDED_FRAMES = 35
DECODING_METHODS = ("greedy_search", "modified_beam_search", "fast_beam_search")
DEFAULT_TEST_SETS = ("test-clean", "test-other")
MANIFEST_SUFFIXES = (".jsonl.gz", ".jsonl")
MANIFEST_PREFIX = "librispeech_cuts_"


# --------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------


def get_parser() -> argparse.ArgumentParser:
    """icefall's decode.py flags plus the model-size and datamodule flags."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epoch", type=int, default=8,
                        help="Decode exp-dir/epoch-N.pt (epochs count from 1; train.py's default --num-epochs is 8). "
                        "Use --avg to average it with earlier epochs. (default: 8)")
    parser.add_argument("--iter", type=int, default=0,
                        help="If positive, --epoch is ignored and the checkpoint-<batch>.pt files with batch <= ITER "
                        "are used. (default: 0)")
    parser.add_argument("--avg", type=int, default=3,
                        help="Number of checkpoints to average: consecutive checkpoints ending at the one chosen by "
                        "--epoch or --iter. (default: 3)")
    parser.add_argument("--use-averaged-model", type=str2bool, default=True,
                        help="Decode with the average of the model over the batches from epoch-(EPOCH-AVG).pt "
                        "(excluded) to epoch-EPOCH.pt, computed from the model_avg of those two checkpoints. "
                        "(default: true)")
    parser.add_argument("--exp-dir", type=Path, default=Path("lstm_transducer_stateless/exp"),
                        help="The experiment dir: checkpoints are read from it, results written below it. "
                        "(default: lstm_transducer_stateless/exp)")
    parser.add_argument("--bpe-model", type=str, default="data/lang_bpe_500/bpe.model",
                        help="Path to the BPE model. (default: data/lang_bpe_500/bpe.model)")
    parser.add_argument("--decoding-method", type=str, default="greedy_search", choices=DECODING_METHODS,
                        help="Search to decode with. (default: greedy_search)")
    parser.add_argument("--beam-size", type=int, default=4,
                        help="Hypotheses kept per frame by modified_beam_search. (default: 4)")
    parser.add_argument("--beam", type=float, default=20.0,
                        help="fast_beam_search: log-probability cutoff below the best score, as Kaldi's beam. "
                        "(default: 20.0)")
    parser.add_argument("--max-contexts", type=int, default=8,
                        help="fast_beam_search: max decoder contexts per utterance and frame. (default: 8)")
    parser.add_argument("--max-states", type=int, default=64,
                        help="fast_beam_search: max states per utterance and frame. (default: 64)")
    parser.add_argument("--max-sym-per-frame", type=int, default=1,
                        help="greedy_search: max symbols per frame (1 uses the batched search). (default: 1)")
    parser.add_argument("--test-sets", nargs="+", default=list(DEFAULT_TEST_SETS),
                        help="Parts to decode: names of parts in --manifest-dir (librispeech_cuts_<part>.jsonl.gz) "
                        "or paths to cut manifests (.jsonl.gz). (default: test-clean test-other)")
    add_model_arguments(parser)
    LibriSpeechAsrDataModule.add_arguments(parser)
    return parser


def _check_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, names: Sequence[str]) -> None:
    """``parser.error`` naming the first flag in ``names`` whose value is not > 0."""
    for name in names:
        value = getattr(args, name)
        if not value > 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")


def validate_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """argparse errors naming the flag for bad values; also resolves ``args.test_set_paths``."""
    if args.iter < 0:
        parser.error(f"--iter must be >= 0, got {args.iter}")
    if args.iter == 0:
        _check_positive(parser, args, ["epoch"])
    _check_positive(parser, args, ["avg", "beam_size", "beam", "max_contexts", "max_states",
                                   "max_sym_per_frame", "max_duration"])
    if args.num_workers < 0:
        parser.error(f"--num-workers must be >= 0, got {args.num_workers}")
    if not Path(args.bpe_model).is_file():
        parser.error(f"--bpe-model {args.bpe_model} does not exist; run prepare.sh (stage 4) first")
    try:
        model_config_from_args(args, vocab_size=2)
    except ValueError as e:
        parser.error(str(e))
    try:
        args.test_set_paths = resolve_test_sets(args.test_sets, Path(args.manifest_dir))
    except ValueError as e:
        parser.error(f"--test-sets: {e}")


def _is_manifest_path(spec: str) -> bool:
    return spec.endswith(MANIFEST_SUFFIXES)


def name_of_test_set(spec: str) -> str:
    """Name of a test set given by part name or manifest path.

    ``data/fbank/librispeech_cuts_dev-clean.jsonl.gz`` -> ``dev-clean``,
    ``my/cuts.jsonl.gz`` -> ``cuts``, ``test-clean`` -> ``test-clean``.
    """
    if not _is_manifest_path(spec):
        return spec
    name = Path(spec).name
    for suffix in MANIFEST_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return name[len(MANIFEST_PREFIX):] if name.startswith(MANIFEST_PREFIX) and len(name) > len(MANIFEST_PREFIX) else name


def resolve_test_sets(specs: Sequence[str], manifest_dir: Path) -> List[Tuple[str, Path]]:
    """``[(name, manifest path)]`` for ``--test-sets``; ValueError for a missing manifest or a repeated name."""
    resolved: List[Tuple[str, Path]] = []
    for spec in specs:
        path = Path(spec) if _is_manifest_path(spec) else manifest_dir / f"{MANIFEST_PREFIX}{spec}.jsonl.gz"
        if not path.is_file():
            raise ValueError(
                f"no cut manifest {path} for test set {spec!r}: run prepare.sh, check --manifest-dir, "
                "or pass the path of a cut manifest (.jsonl.gz)"
            )
        name = name_of_test_set(spec)
        if name in [n for n, _ in resolved]:
            raise ValueError(f"test set name {name!r} given twice ({spec!r}); result files would overwrite each other")
        resolved.append((name, path))
    return resolved


# --------------------------------------------------------------------------
# icefall's result naming
# --------------------------------------------------------------------------


def make_suffix(params: AttributeDict) -> str:
    """icefall's file-name suffix, e.g. ``epoch-8-avg-3-context-2-max-sym-per-frame-1-use-averaged-model``."""
    suffix = checkpoint_suffix(params.epoch, params.iter, params.avg)
    if "fast_beam_search" in params.decoding_method:
        suffix += f"-beam-{params.beam}-max-contexts-{params.max_contexts}-max-states-{params.max_states}"
    elif "beam_search" in params.decoding_method:
        suffix += f"-{params.decoding_method}-beam-size-{params.beam_size}"
    else:
        suffix += f"-context-{params.context_size}-max-sym-per-frame-{params.max_sym_per_frame}"
    if params.use_averaged_model:
        suffix += "-use-averaged-model"
    return suffix


def result_key(params: AttributeDict) -> str:
    """icefall's settings key: ``greedy_search``, ``beam_size_4`` or ``beam_20.0_max_contexts_8_max_states_64``."""
    if params.decoding_method == "greedy_search":
        return "greedy_search"
    if params.decoding_method == "fast_beam_search":
        return f"beam_{params.beam}_max_contexts_{params.max_contexts}_max_states_{params.max_states}"
    return f"beam_size_{params.beam_size}"


# --------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------


def pad_tail(feature: torch.Tensor, feature_lens: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Append ``NUM_TAIL_PADDED_FRAMES`` frames of log(1e-10) (icefall's fix for tail deletions)."""
    feature = nn.functional.pad(feature, (0, 0, 0, NUM_TAIL_PADDED_FRAMES), mode="constant", value=LOG_EPS)
    return feature, feature_lens + NUM_TAIL_PADDED_FRAMES


def search_tokens(
    params: AttributeDict, model: nn.Module, encoder_out: torch.Tensor, encoder_out_lens: torch.Tensor
) -> List[List[int]]:
    """Token ids of every utterance, by ``params.decoding_method``."""
    if params.decoding_method == "fast_beam_search":
        return fast_beam_search_one_best(
            model, encoder_out, encoder_out_lens,
            beam=params.beam, max_states=params.max_states, max_contexts=params.max_contexts,
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
    """Decode one batch: ``{result_key(params): [hypothesis words per utterance]}``."""
    device = next(model.parameters()).device
    feature = batch["inputs"]
    if feature.ndim != 3:
        raise ValueError(f"batch['inputs'] must be (N, T, C), got shape {tuple(feature.shape)}")
    feature_lens = batch["supervisions"]["num_frames"].to(device)
    feature, feature_lens = pad_tail(feature.to(device), feature_lens)
    encoder_out, encoder_out_lens, _ = model.encoder(x=feature, x_lens=feature_lens)
    hyp_tokens = search_tokens(params, model, encoder_out, encoder_out_lens)
    return {result_key(params): [sp.decode(tokens).split() for tokens in hyp_tokens]}


@dataclass
class DecodeStats:
    """Size and speed of one decoded test set."""

    num_cuts: int = 0
    audio_seconds: float = 0.0
    wall_seconds: float = 0.0

    @property
    def rtf(self) -> float:
        """Real-time factor: decoding wall time / audio duration."""
        return self.wall_seconds / self.audio_seconds if self.audio_seconds > 0 else float("nan")


def decode_dataset(
    dl: torch.utils.data.DataLoader,
    params: AttributeDict,
    model: nn.Module,
    sp: spm.SentencePieceProcessor,
    test_set: str,
) -> Tuple[Dict[str, List[Result]], DecodeStats]:
    """Decode every batch of ``dl``; results ``{key: [(cut_id, ref words, hyp words)]}`` and timing.

    The reference is the supervision text split into words. The wall time
    covers loading features, the encoder and the search.
    """
    log_interval = 50 if params.decoding_method == "greedy_search" else 20
    results: Dict[str, List[Result]] = {}
    stats = DecodeStats()
    start = time.perf_counter()
    for batch_idx, batch in enumerate(tqdm(dl, desc=f"{test_set} {params.decoding_method}", unit="batch")):
        texts = batch["supervisions"]["text"]
        cuts = batch["supervisions"]["cut"]
        for key, hyps in decode_one_batch(params, model, sp, batch).items():
            results.setdefault(key, []).extend(
                (cut.id, text.split(), hyp) for cut, text, hyp in zip(cuts, texts, hyps)
            )
        stats.num_cuts += len(texts)
        stats.audio_seconds += sum(cut.duration for cut in cuts)
        if batch_idx % log_interval == 0:
            logging.info(f"batch {batch_idx}, cuts processed until now is {stats.num_cuts}")
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    stats.wall_seconds = time.perf_counter() - start
    logging.info(
        f"{test_set}: decoded {stats.num_cuts} cuts, {stats.audio_seconds:.2f} s of audio in "
        f"{stats.wall_seconds:.2f} s, RTF {stats.rtf:.4f}"
    )
    return results, stats


def format_summary_table(rows: Sequence[Tuple[str, str, float, DecodeStats]]) -> str:
    """The printed table: test set, setting, WER, RTF, cuts and audio duration per row."""
    header = ("test set", "setting", "WER", "RTF", "cuts", "audio (s)")
    body = [(name, key, f"{wer:.2f}", f"{st.rtf:.4f}", str(st.num_cuts), f"{st.audio_seconds:.1f}")
            for name, key, wer, st in rows]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [header, *body])


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def get_params(args: argparse.Namespace) -> AttributeDict:
    """Flags plus derived settings (result dir, suffix)."""
    params = AttributeDict(vars(args))
    params.exp_dir = Path(args.exp_dir)
    params.res_dir = params.exp_dir / params.decoding_method
    params.suffix = make_suffix(params)
    return params


def build_model(params: AttributeDict, args: argparse.Namespace, sp: spm.SentencePieceProcessor) -> nn.Module:
    """The transducer of the model-size flags, with ``unk_id`` set for the searches."""
    params.blank_id = sp.piece_to_id("<blk>")
    params.unk_id = sp.piece_to_id("<unk>")
    params.vocab_size = sp.get_piece_size()
    model = build_transducer(**model_config_from_args(args, vocab_size=params.vocab_size, blank_id=params.blank_id))
    model.unk_id = params.unk_id
    return model


def decode_test_sets(
    params: AttributeDict, args: argparse.Namespace, model: nn.Module, sp: spm.SentencePieceProcessor
) -> List[Tuple[str, str, float, DecodeStats]]:
    """Decode and save every test set; ``[(set, key, WER, stats)]``."""
    args.return_cuts = True  # cut ids name the utterances in the result files
    datamodule = LibriSpeechAsrDataModule(args)
    rows = []
    for name, path in params.test_set_paths:
        logging.info(f"Decoding {name} ({path})")
        cuts: CutSet = load_manifest_lazy(path)
        results, stats = decode_dataset(datamodule.test_dataloaders(cuts), params, model, sp, name)
        if not results:
            raise ValueError(f"test set {name} ({path}) has no cuts")
        wers = save_results(params.res_dir, name, params.suffix, results)
        rows.extend((name, key, wer, stats) for key, wer in wers.items())
    return rows


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = get_parser()
    args = parser.parse_args(argv)
    validate_args(parser, args)
    params = get_params(args)
    setup_logger(params.res_dir / f"log-decode-{params.suffix}")
    logging.info("Decoding started")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    logging.info(f"Device: {device}")
    sp = spm.SentencePieceProcessor()
    sp.load(str(params.bpe_model))
    try:
        model = build_model(params, args, sp)
        logging.info(params)
        plan = load_averaged_weights(
            model, params.exp_dir, epoch=params.epoch, iter=params.iter, avg=params.avg,
            use_averaged_model=params.use_averaged_model, device=device,
        )
    except CheckpointError as e:
        logging.error(str(e))
        print(f"decode.py: error: {e}", file=sys.stderr)
        sys.exit(1)
    params.checkpoints = [str(f) for f in plan.filenames]
    model.to(device)
    model.eval()
    logging.info(f"Number of model parameters: {count_parameters(model)}")
    rows = decode_test_sets(params, args, model, sp)
    table = format_summary_table(rows)
    logging.info(f"Results ({params.decoding_method}, {params.suffix}):\n{table}")
    print(table)
    logging.info("Done!")


if __name__ == "__main__":
    main()
