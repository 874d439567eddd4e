"""What the decoding scripts share: test sets, icefall's result naming, tail padding, timing and the summary table.

Used by ``decode.py`` (offline), ``streaming_decode.py`` (PyTorch, chunk by
chunk) and ``sherpa_onnx_decode.py`` (the exported files in sherpa-onnx), so
that all three take test sets the same way, name their result files as
icefall does and report WER and real-time factor (RTF: decoding wall time /
audio duration) in the same table.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Sequence, Tuple

import sentencepiece as spm
import torch
from lhotse.cut import Cut
from torch import Tensor

from icefall_lite.data.bpe import DEFAULT_BPE_MODEL
from icefall_lite.data.datamodule import EmptyCutSetError, LibriSpeechAsrDataModule
from icefall_lite.data.features import NUM_MEL_BINS, NUM_TAIL_PADDED_FRAMES, pad_tail
from icefall_lite.data.layout import CUTS_PREFIX, MINI_DEV_PART, librispeech_cuts_path
from icefall_lite.decoding.constants import TEST_SETS
from icefall_lite.decoding.metrics import Result, save_results
from icefall_lite.nn.model import (
    Transducer,
    add_model_arguments,
    build_transducer,
    check_model_args,
    count_parameters,
    model_config_from_args,
)
from icefall_lite.recipe_defaults import DECODE_MAX_DURATION
from icefall_lite.train.averaging import checkpoint_suffix, load_weights_from_flags
from icefall_lite.train.checkpoint_args import validate_checkpoint_args
from icefall_lite.utils import AttributeDict, check_positive, progress_bar

MANIFEST_SUFFIXES = (".jsonl.gz", ".jsonl")

# {result key: hypothesis words of every utterance of a batch}
BatchHyps = Dict[str, List[List[str]]]
# (test set, result key, WER, stats): one row of the summary table
SummaryRow = Tuple[str, str, float, "DecodeStats"]


# --------------------------------------------------------------------------
# Flags and test sets
# --------------------------------------------------------------------------


def add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the PyTorch decoding scripts besides checkpoint selection (the scripts add that with
    :func:`~icefall_lite.train.checkpoint.add_checkpoint_arguments` and their recipe's defaults):
    ``--bpe-model``, ``--beam-size``, ``--test-sets``, the model sizes and the datamodule's flags
    (``--manifest-dir``, ``--max-duration``, ...)."""
    parser.add_argument(
        "--bpe-model",
        type=str,
        default=DEFAULT_BPE_MODEL,
        help=f"Path to the BPE model. (default: {DEFAULT_BPE_MODEL})",
    )
    parser.add_argument(
        "--beam-size", type=int, default=4, help="Hypotheses kept per frame by modified_beam_search. (default: 4)"
    )
    add_test_sets_argument(parser)
    add_model_arguments(parser)
    LibriSpeechAsrDataModule.add_arguments(parser, max_duration=DECODE_MAX_DURATION)


def validate_decoding_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """argparse errors naming the flag for bad values of :func:`add_decoding_arguments`' flags;
    also resolves ``args.test_set_paths``."""
    validate_checkpoint_args(parser, args)
    check_positive(parser, args, ["beam_size"])
    LibriSpeechAsrDataModule.check_args(parser, args)
    if not Path(args.bpe_model).is_file():
        parser.error(f"--bpe-model {args.bpe_model} does not exist; run prepare.sh (stage 4) first")
    check_model_args(parser, args)
    validate_test_sets(parser, args)


def add_decoding_method_argument(
    parser: argparse.ArgumentParser, methods: Sequence[str], what: str = "Search to decode with."
) -> None:
    """``--decoding-method`` (default ``greedy_search``) among ``methods``; ``what`` starts its help."""
    parser.add_argument(
        "--decoding-method", type=str, default="greedy_search", choices=methods, help=f"{what} (default: greedy_search)"
    )


def add_test_sets_argument(parser: argparse.ArgumentParser) -> None:
    """``--test-sets``: part names in ``--manifest-dir`` or cut manifest paths."""
    parser.add_argument(
        "--test-sets",
        nargs="+",
        default=None,
        help="Parts to decode: names of parts in --manifest-dir (librispeech_cuts_<part>.jsonl.gz) "
        f"or paths to cut manifests (.jsonl.gz). (default: test-clean test-other; {MINI_DEV_PART} with "
        "--mini-libri true)",
    )


def add_num_threads_argument(parser: argparse.ArgumentParser) -> None:
    """``--num-threads``: CPU threads of the streaming decoders (torch's for streaming_decode.py, sherpa-onnx's
    for sherpa_onnx_decode.py), so that their real-time factors compare."""
    parser.add_argument("--num-threads", type=int, default=1, help="CPU threads used for decoding. (default: 1)")


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
    return name[len(CUTS_PREFIX) :] if name.startswith(CUTS_PREFIX) and len(name) > len(CUTS_PREFIX) else name


def resolve_test_sets(specs: Sequence[str], manifest_dir: Path) -> List[Tuple[str, Path]]:
    """``[(name, manifest path)]`` for ``--test-sets``; ValueError for a missing manifest or a repeated name."""
    resolved: List[Tuple[str, Path]] = []
    for spec in specs:
        path = Path(spec) if _is_manifest_path(spec) else librispeech_cuts_path(manifest_dir, spec)
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


def validate_test_sets(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Resolve ``--test-sets`` into ``args.test_set_paths``, or ``parser.error`` naming the flag.

    Without ``--test-sets``: test-clean and test-other, or mini LibriSpeech's dev-clean-2 with
    ``--mini-libri true`` (where the script has the datamodule's flags).
    """
    if args.test_sets is None:
        args.test_sets = [MINI_DEV_PART] if getattr(args, "mini_libri", False) else list(TEST_SETS)
    try:
        args.test_set_paths = resolve_test_sets(args.test_sets, Path(args.manifest_dir))
    except ValueError as e:
        parser.error(f"--test-sets: {e}")


# --------------------------------------------------------------------------
# icefall's result naming
# --------------------------------------------------------------------------


def make_suffix(params: Mapping[str, Any]) -> str:
    """icefall's file-name suffix, e.g. ``epoch-8-avg-3-context-2-max-sym-per-frame-1-use-averaged-model``.

    ``params`` has ``epoch``, ``iter``, ``avg``, ``decoding_method``,
    ``use_averaged_model`` and the settings of the method: ``context_size``
    and ``max_sym_per_frame`` (greedy), ``beam_size`` (modified beam) or
    ``beam``, ``max_contexts``, ``max_states`` (fast beam). With a
    ``checkpoint`` (``--checkpoint exp/pretrained.pt``) the suffix starts with
    the file's name instead (``pretrained-context-2-max-sym-per-frame-1``).
    """
    method = params["decoding_method"]
    checkpoint = params.get("checkpoint")
    suffix = checkpoint_suffix(params["epoch"], params["iter"], params["avg"], checkpoint)
    if "fast_beam_search" in method:
        suffix += f"-beam-{params['beam']}-max-contexts-{params['max_contexts']}-max-states-{params['max_states']}"
    elif "beam_search" in method:
        suffix += f"-{method}-beam-size-{params['beam_size']}"
    else:
        suffix += f"-context-{params['context_size']}-max-sym-per-frame-{params['max_sym_per_frame']}"
    if params["use_averaged_model"] and checkpoint is None:
        suffix += "-use-averaged-model"
    return suffix


def result_key(params: Mapping[str, Any]) -> str:
    """icefall's settings key: ``greedy_search``, ``beam_size_4`` or ``beam_20.0_max_contexts_8_max_states_64``."""
    if params["decoding_method"] == "greedy_search":
        return "greedy_search"
    if params["decoding_method"] == "fast_beam_search":
        return f"beam_{params['beam']}_max_contexts_{params['max_contexts']}_max_states_{params['max_states']}"
    return f"beam_size_{params['beam_size']}"


# --------------------------------------------------------------------------
# Model and features
# --------------------------------------------------------------------------


def build_decoding_model(args: argparse.Namespace, sp: spm.SentencePieceProcessor) -> Transducer:
    """The transducer of the model-size flags for the BPE model's vocabulary, with ``unk_id`` set for the searches."""
    config = model_config_from_args(
        args, vocab_size=sp.get_piece_size(), blank_id=sp.piece_to_id("<blk>"), num_features=NUM_MEL_BINS
    )
    logging.info(f"Model config: {config}")
    model = build_transducer(**config)
    model.unk_id = sp.piece_to_id("<unk>")
    return model


def load_decoding_model(
    args: argparse.Namespace, params: AttributeDict, device: torch.device
) -> Tuple[Transducer, spm.SentencePieceProcessor]:
    """The sentencepiece model and the transducer with the selected checkpoints' weights, on ``device``.

    Logs ``params`` (with ``blank_id`` set) and the parameter count, sets
    ``params.checkpoints``; a checkpoint problem raises ``CheckpointError``.
    """
    sp = spm.SentencePieceProcessor()
    sp.load(str(params.bpe_model))
    model = build_decoding_model(args, sp)
    params.blank_id = model.decoder.blank_id
    logging.info(params)
    plan = load_weights_from_flags(model, params, device)
    params.checkpoints = [str(f) for f in plan.filenames]
    logging.info(f"Number of model parameters: {count_parameters(model)}")
    return model, sp


def batch_features(batch: dict, device: torch.device) -> Tuple[Tensor, Tensor]:
    """The tail-padded features of a test DataLoader batch: (N, T + 35, C) on ``device`` and lengths (N,)."""
    feature = batch["inputs"]
    if feature.ndim != 3:
        raise ValueError(f"batch['inputs'] must be (N, T, C), got shape {tuple(feature.shape)}")
    return pad_tail(feature.to(device), batch["supervisions"]["num_frames"].to(device), NUM_TAIL_PADDED_FRAMES)


# --------------------------------------------------------------------------
# Decoding loops, timing and the summary
# --------------------------------------------------------------------------


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

    def add_cuts(self, cuts: Sequence[Cut]) -> None:
        """Count ``cuts`` and their audio duration."""
        self.num_cuts += len(cuts)
        self.audio_seconds += sum(cut.duration for cut in cuts)


def _finish_timing(test_set: str, stats: DecodeStats, start: float) -> None:
    """Set the wall time (after the device finished) and log the RTF line."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    stats.wall_seconds = time.perf_counter() - start
    logging.info(
        f"{test_set}: decoded {stats.num_cuts} cuts, {stats.audio_seconds:.2f} s of audio in "
        f"{stats.wall_seconds:.2f} s, RTF {stats.rtf:.4f}"
    )


def decode_batches(
    batches: Iterable[dict],
    decode_batch: Callable[[dict], BatchHyps],
    test_set: str,
    desc: str,
    log_interval: int = 50,
) -> Tuple[Dict[str, List[Result]], DecodeStats]:
    """Decode every batch of a test DataLoader; results ``{key: [(cut_id, ref words, hyp words)]}`` and timing.

    The reference is the supervision text split into words. The wall time
    covers loading features, the encoder and the search.
    """
    results: Dict[str, List[Result]] = {}
    stats = DecodeStats()
    start = time.perf_counter()
    for batch_idx, batch in enumerate(progress_bar(batches, desc=desc, unit="batch")):
        texts = batch["supervisions"]["text"]
        cuts = batch["supervisions"]["cut"]
        for key, hyps in decode_batch(batch).items():
            results.setdefault(key, []).extend((cut.id, text.split(), hyp) for cut, text, hyp in zip(cuts, texts, hyps))
        stats.add_cuts(cuts)
        if batch_idx % log_interval == 0:
            logging.info(f"batch {batch_idx}, cuts processed until now is {stats.num_cuts}")
    _finish_timing(test_set, stats, start)
    return results, stats


def decode_and_save(
    test_set_paths: Sequence[Tuple[str, Path]],
    decode_set: Callable[[str, Path], Tuple[Dict[str, List[Result]], DecodeStats]],
    res_dir: Path,
    suffix: str,
) -> List[SummaryRow]:
    """Decode every test set with ``decode_set(name, manifest)`` and write icefall's files; the summary rows."""
    rows: List[SummaryRow] = []
    for name, path in test_set_paths:
        logging.info(f"Decoding {name} ({path})")
        results, stats = decode_set(name, path)
        if not results:
            raise EmptyCutSetError(f"test set {name} ({path}) has no cuts; check the manifest or rerun prepare.sh")
        wers = save_results(res_dir, name, suffix, results)
        rows.extend((name, key, wer, stats) for key, wer in wers.items())
    return rows


def decode_and_report(
    test_set_paths: Sequence[Tuple[str, Path]],
    decode_set: Callable[[str, Path], Tuple[Dict[str, List[Result]], DecodeStats]],
    res_dir: Path,
    suffix: str,
    title: str,
) -> None:
    """The end of every decoding script: :func:`decode_and_save`, then :func:`report` under ``title``.

    Bad data (NaN/unreadable features or audio, an empty test set) raises
    :class:`CutDataError`; the scripts turn it into an error message and exit status 1.
    """
    rows = decode_and_save(test_set_paths, decode_set, res_dir, suffix)
    report(rows, title)
    logging.info("Done!")


def format_summary_table(rows: Sequence[SummaryRow]) -> str:
    """The printed table: test set, setting, WER, RTF, cuts and audio duration per row."""
    header = ("test set", "setting", "WER", "RTF", "cuts", "audio (s)")
    body = [
        (name, key, f"{wer:.2f}", f"{st.rtf:.4f}", str(st.num_cuts), f"{st.audio_seconds:.1f}")
        for name, key, wer, st in rows
    ]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [header, *body])


def report(rows: Sequence[SummaryRow], title: str) -> None:
    """Log the summary table under ``title`` and print it to stdout."""
    table = format_summary_table(rows)
    logging.info(f"Results ({title}):\n{table}")
    print(table)


__all__ = [
    "add_decoding_arguments",
    "validate_decoding_args",
    "add_decoding_method_argument",
    "add_test_sets_argument",
    "add_num_threads_argument",
    "check_positive",
    "name_of_test_set",
    "resolve_test_sets",
    "validate_test_sets",
    "make_suffix",
    "result_key",
    "build_decoding_model",
    "load_decoding_model",
    "batch_features",
    "DecodeStats",
    "decode_batches",
    "decode_and_save",
    "decode_and_report",
    "format_summary_table",
    "report",
]
