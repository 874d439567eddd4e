#!/usr/bin/env python3
"""Benchmark 9: float32 against bfloat16 autocast on the corpus's own batches, where a batch's shape seen for
the first time costs the kernels made for it.

Benchmark 8 times the step on four batch shapes, cycled; a real epoch's
bucketing sampler gives nearly every batch a shape of its own (utterances x
frames). oneDNN, which runs the bfloat16 matrix products and LSTMs on a CPU,
makes a kernel per operation and shape; float32 goes to BLAS, which makes
none. So this benchmark takes the first ``--num-batches`` batches of the
training dataloader of a prepared corpus (train.py's defaults: bucketing,
``--max-duration``, noise mixing off so that the arms see identical inputs),
and runs train.py's ``train_step`` on each, once per arm, every arm in its own
process: float32, bf16 autocast, and bf16 with the frames of every batch
padded up to a multiple of ``--pad-multiple`` (which bounds the number of
shapes; lhotse already pads to the longest utterance with log(1e-10), so this
only adds frames of the same padding). Reported per arm: total and median
step time, the number of distinct shapes, and the mean time of a step whose
shape is new against one whose shape was seen before.

Usage (from the repository root, on a corpus made by prepare.sh; make bench runs it on the recipe's):
  python -m benchmarks.bench_real_batches --work-dir DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from benchmarks.common import RECIPE, Section, add_common_arguments, fmt_ms, markdown_table, median, setup_threads
from icefall_lite.data.bpe import load_bpe_model
from icefall_lite.data.datamodule import LibriSpeechAsrDataModule
from icefall_lite.train import cli as train_cli
from icefall_lite.train.grad_control import GradientControl
from icefall_lite.train.optim import Eden
from icefall_lite.train.setup import build_models, load_training_data, make_optimizer
from icefall_lite.train.step import train_step
from icefall_lite.train.training import Training
from icefall_lite.utils import script_parser

ARMS: Dict[str, List[str]] = {"float32": [], "bf16": ["--use-bf16", "true"], "bf16, padded": ["--use-bf16", "true"]}


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=RECIPE,
        help="A folder prepared by prepare.sh (its data/). (default: the recipe's, where make demo prepares)",
    )
    parser.add_argument("--num-batches", type=int, default=300, help="Batches per arm. (default: 300)")
    parser.add_argument("--pad-multiple", type=int, default=64, help="The padded arm's frame multiple. (default: 64)")
    parser.add_argument(
        "--arm",
        choices=list(ARMS),
        default=None,
        help="Run only this arm, in this process, and write its times to --result (the script runs every arm "
        "so, one process each). (default: all arms)",
    )
    parser.add_argument("--result", type=Path, default=None, help="Where --arm writes its times (JSON).")
    add_common_arguments(parser)
    return parser


def run_arm(args: argparse.Namespace) -> Dict[str, List]:
    """One arm in this process: the step time and the shape of every batch."""
    work = args.work_dir.resolve()
    os.chdir(work)  # the manifests name their feature files relative to the work dir
    parser = train_cli.get_parser()
    flags = ["--enable-musan", "false", "--num-workers", "0", *ARMS[args.arm]]
    flags += ["--bpe-model", str(work / "data/lang_bpe_100/bpe.model"), "--manifest-dir", str(work / "data/fbank")]
    targs = train_cli.parse_args(parser, flags)
    params = train_cli.get_params()  # train.py's fixed settings
    params.update(vars(targs))
    params.batch_idx_train = 3 * params.model_warm_step  # past the warm-up: the pruned loss on
    torch.manual_seed(0)
    sp = load_bpe_model(params.bpe_model)
    model, _ = build_models(params, targs, sp, rank=1)  # rank 1: no model average
    optimizer = make_optimizer(params, model)
    t = Training(
        params=params,
        model=model,
        optimizer=optimizer,
        scheduler=Eden(optimizer, params.lr_batches, params.lr_epochs),
        grad_control=GradientControl.from_params(params),
        sp=sp,
    )
    datamodule = LibriSpeechAsrDataModule(targs)
    train_cuts, _ = load_training_data(datamodule, sp)
    loader = datamodule.train_dataloaders(train_cuts)
    loader.sampler.set_epoch(0)
    times, shapes = [], []
    for i, batch in enumerate(loader):
        if i == args.num_batches:
            break
        if args.arm == "bf16, padded":
            frames = batch["inputs"].shape[1]
            extra = -frames % args.pad_multiple
            batch["inputs"] = torch.nn.functional.pad(batch["inputs"], (0, 0, 0, extra), value=-23.0259)
        shapes.append(list(batch["inputs"].shape[:2]))
        start = time.perf_counter()
        train_step(t, batch)
        times.append(time.perf_counter() - start)
    return {"times": times, "shapes": shapes}


def summarise(name: str, result: Dict[str, List]) -> List[str]:
    seen, new, repeat = set(), [], []
    for shape, seconds in zip(result["shapes"], result["times"]):
        (repeat if tuple(shape) in seen else new).append(seconds)
        seen.add(tuple(shape))
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return [
        name,
        f"{sum(result['times']):.1f}",
        fmt_ms(median(result["times"])),
        str(len(seen)),
        fmt_ms(mean(new)),
        fmt_ms(mean(repeat)) if repeat else "-",
    ]


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = get_parser().parse_args(argv)
    setup_threads(args.threads)
    if args.arm is not None:
        if args.result is None:
            raise SystemExit("bench_real_batches: --arm needs --result FILE")
        args.result.write_text(json.dumps(run_arm(args)))
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ARMS:
            out = Path(tmp) / "result.json"
            command = [sys.executable, "-m", "benchmarks.bench_real_batches", "--work-dir", str(args.work_dir)]
            command += ["--num-batches", str(args.num_batches), "--pad-multiple", str(args.pad_multiple)]
            command += ["--threads", str(args.threads), "--arm", name, "--result", str(out)]
            print(f"== {name}", flush=True)
            subprocess.run(command, check=True)
            results[name] = json.loads(out.read_text())
    rows = [summarise(name, result) for name, result in results.items()]
    total = {name: sum(r["times"]) for name, r in results.items()}
    rows.append(["float32 / bf16 (total)", f"{total['float32'] / total['bf16']:.2f}x", "", "", "", ""])
    rows.append(["float32 / bf16, padded (total)", f"{total['float32'] / total['bf16, padded']:.2f}x", "", "", "", ""])
    header = ["arm", "total s", "median step (ms)", "distinct shapes", "mean step, new shape (ms)"]
    header += ["mean step, seen shape (ms)"]
    Section(
        title="9. float32 against bf16 on the corpus's own batches (new shapes, padding)",
        threads=args.threads,
        tables=[markdown_table(header, rows)],
        notes=[
            f"The first {args.num_batches} batches of train.py's training dataloader on {args.work_dir} (default "
            "flags, noise mixing off, one epoch's order), the default model past warm-up, each arm in its own "
            "process in turn; a step = train.py's train_step (forward, backward, clipping, Eve).",
            f"'bf16, padded': every batch's frames padded up to a multiple of {args.pad_multiple} with the loader's "
            "own padding value; the utterances' lengths are unchanged.",
        ],
    ).emit(args.markdown_out)


if __name__ == "__main__":
    main()
