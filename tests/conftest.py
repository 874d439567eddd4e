"""Shared fixtures and checks. ``tiny_data``: the tiny synthetic corpus, prepared once per
test session by ``prepare.sh --size tiny``; tests treat it as read-only.
``run_train``/``train_command``: train.py with the tiny model on the tiny corpus; ``six_batches``: a 6-batch run of it,
made once per session (the reference of the resume tests).
``assert_flag_error``: a script's flag check exits as argparse does.
``isolated_logging``: undoes a script's ``setup_logger`` after an in-process ``main()``.
``check_wer_files``: the icefall result files of one decoded test set agree with each other and the manifest.
``reference_streaming_greedy``: what chunk-by-chunk greedy search must give, computed without chunks."""

import argparse
import ast
import gzip
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Sequence, Tuple

import kaldialign
import pytest
import sentencepiece as spm
import torch
import torch.nn as nn
from filelock import FileLock

from icefall_lite.nn.model import Transducer, build_transducer
from icefall_lite.train.cli import get_params, get_parser
from icefall_lite.train.setup import training_model_config

# One OpenMP thread for the test session and every script it starts, unless OMP_NUM_THREADS is set: the tests'
# matrices are tiny, and a second thread mostly spins: on a 2-core machine shared with other jobs (an AMD EPYC)
# the suite took 7 min (6 min of CPU) with one thread, 47 min (10 min 51 s of CPU) with two.
if not os.environ.get("OMP_NUM_THREADS", "").strip():
    os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
# Triton kernels run in Triton's interpreter where no GPU is (read when a kernel is defined, so set before any
# test imports one); with a GPU they compile for it and the tests give them CUDA tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "egs" / "librispeech" / "ASR"
RECIPE_SCRIPTS = RECIPE / "lstm_transducer_stateless"

# The tests' small model as recipe-script flags (train.py, decode.py, ...); one of 2 x 32 LSTM layers.
TINY_MODEL = [
    *("--encoder-dim", "32", "--rnn-hidden-size", "32", "--dim-feedforward", "64"),
    *("--num-encoder-layers", "2", "--decoder-dim", "32", "--joiner-dim", "32"),
]


def tiny_training_setup(bpe_model: str, *flags: str):
    """``(params, model, sp)`` as train.py makes them from ``flags`` for the tiny model (built after
    ``torch.manual_seed(0)``): for tests that call ``compute_loss`` themselves."""
    args = get_parser().parse_args(["--bpe-model", bpe_model, *TINY_MODEL, *flags])
    params = get_params()
    params.update(vars(args))
    sp = spm.SentencePieceProcessor()
    sp.load(bpe_model)
    torch.manual_seed(0)
    model = build_transducer(**training_model_config(args, vocab_size=sp.get_piece_size(), blank_id=0))
    return params, model, sp


def recipe_env() -> dict:
    """Environment for recipe scripts: the venv's python first on PATH."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """A read-only folder ``name`` that ``make(folder)`` fills once per test session: under pytest-xdist once for
    all its workers (a session fixture is otherwise made by each: the tiny corpus took 20-50 s a worker), in
    their common base folder, the first worker making it under a file lock while the others wait."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.mktemp(name)
        make(folder)
        return folder
    root = tmp_path_factory.getbasetemp().parent
    folder, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a worker that failed to make it left this
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


def prepare_tiny(work: Path) -> None:
    proc = subprocess.run(
        ["bash", str(RECIPE / "prepare.sh"), "--size", "tiny", "--work-dir", str(work)],
        capture_output=True,
        text=True,
        env=recipe_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Work dir holding data/fbank, data/lang_bpe_100 (and download/) of the tiny corpus."""
    return made_once(tmp_path_factory, "tiny_data", prepare_tiny)


TRAIN = RECIPE_SCRIPTS / "train.py"


def train_command(exp_dir: Path, *extra: str) -> List[str]:
    """train.py on the tiny corpus (run in its work dir) with the tiny model, one epoch, logging every batch."""
    flags = "--bpe-model data/lang_bpe_100/bpe.model --max-duration 30 --num-workers 0 --num-epochs 1"
    flags += " --log-interval 1 --tensorboard false"
    return [sys.executable, str(TRAIN), "--exp-dir", str(exp_dir), *flags.split(), *TINY_MODEL, *extra]


def train_env() -> dict:
    """The environment of the tests' train.py runs: :func:`recipe_env` with one OpenMP thread whatever
    OMP_NUM_THREADS says (a run's weights depend on its thread count, and runs that are compared use this).
    The tiny model's matrices are too small for a second thread, which only spins: 6 batches took 4 s of CPU
    with one thread and 14-43 s with two on a busy 2-core machine."""
    return {**recipe_env(), "OMP_NUM_THREADS": "1"}


def run_train(work: Path, exp_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    args = train_command(exp_dir, *extra)
    return subprocess.run(args, cwd=work, capture_output=True, text=True, env=train_env(), timeout=600)


def batch_losses(exp_dir: Path) -> Dict[int, str]:
    """{global batch: 'loss[...]' text} from the training logs in exp_dir/log."""
    out = {}
    for log in sorted((exp_dir / "log").glob("log-train-*")):
        for m in re.finditer(r"global batch (\d+), loss\[([^\]]*)\]", log.read_text()):
            out[int(m.group(1))] = m.group(2)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def six_batches(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted reference run of the resume tests (test_train, test_faults_train): an exp dir of
    ``train.py --max-batches 6 --save-every-n 1`` on the tiny corpus (checkpoint-6.pt, the per-batch losses
    in its log); read-only."""

    def make(folder: Path) -> None:
        proc = run_train(tiny_data, folder / "exp", "--max-batches", "6", "--save-every-n", "1")
        assert proc.returncode == 0, proc.stderr
        assert sorted(batch_losses(folder / "exp")) == [1, 2, 3, 4, 5, 6]

    return made_once(tmp_path_factory, "six_batches", make) / "exp"


@pytest.fixture
def isolated_logging() -> Iterator[None]:
    """Undo setup_logger's changes to the root logger (handlers, level) after an in-process script main()."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


def assert_flag_error(
    parser: argparse.ArgumentParser,
    validate: Callable[[argparse.ArgumentParser, argparse.Namespace], None],
    argv: Sequence[str],
    message: str,
    capsys: pytest.CaptureFixture,
) -> None:
    """Parsing ``argv`` and checking it with a script's ``validate(parser, args)`` ends as argparse does for a bad
    flag: exit status 2, ``message`` in the error on stderr."""
    with pytest.raises(SystemExit) as exc:
        validate(parser, parser.parse_args(argv))
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def with_features(cut, feats, storage: Path):
    """``cut`` (a lhotse Cut) whose features are the array ``feats``, stored as a
    .npy file under ``storage`` with an absolute path."""
    from lhotse.features.io import NumpyFilesWriter
    from lhotse.utils import fastcopy

    with NumpyFilesWriter(storage) as writer:
        key = writer.write(cut.id, feats)
    features = fastcopy(cut.features, storage_type=writer.name, storage_path=str(storage), storage_key=key)
    return fastcopy(cut, features=features)


def read_recogs(path: Path) -> Dict[str, Tuple[List[str], List[str]]]:
    """{cut_id: (ref words, hyp words)} parsed from an icefall recogs file."""
    out: Dict[str, Dict[str, List[str]]] = {}
    for line in path.read_text().splitlines():
        m = re.fullmatch(r"(.+):\t(ref|hyp)=(\[.*\])", line)
        assert m, f"unexpected line in {path.name}: {line!r}"
        out.setdefault(m.group(1), {})[m.group(2)] = ast.literal_eval(m.group(3))
    return {cut_id: (d["ref"], d["hyp"]) for cut_id, d in out.items()}


def manifest_texts(path: Path) -> Dict[str, str]:
    """{cut_id: supervision text} of a cut manifest."""
    with gzip.open(path, "rt") as f:
        cuts = [json.loads(line) for line in f]
    return {c["id"]: " ".join(s["text"] for s in c["supervisions"]) for c in cuts}


def check_wer_files(res_dir: Path, test_set: str, suffix: str, key: str, manifest: Path) -> Dict[str, List[str]]:
    """Assert that ``recogs/errs/wer-summary-<test_set>-<suffix>.txt`` in ``res_dir`` are icefall's and agree:
    the references are the manifest's supervision words (every cut once), the errs header and the summary
    row (``key``) hold the kaldialign recount of the recogs. Returns {cut_id: hyp words}."""
    recogs = read_recogs(res_dir / f"recogs-{test_set}-{suffix}.txt")
    texts = manifest_texts(manifest)
    assert sorted(recogs) == sorted(texts)
    assert all(recogs[cut_id][0] == text.split() for cut_id, text in texts.items())
    counts = [kaldialign.edit_distance(ref, hyp) for ref, hyp in recogs.values()]
    ins, dels, subs = (sum(c[k] for c in counts) for k in ("ins", "del", "sub"))
    ref_words = sum(len(ref) for ref, _ in recogs.values())
    wer = "%.2f" % (100.0 * (ins + dels + subs) / ref_words)
    errs = (res_dir / f"errs-{test_set}-{suffix}.txt").read_text().splitlines()
    assert errs[0] == f"%WER = {wer}"
    assert errs[1].startswith(
        f"Errors: {ins} insertions, {dels} deletions, {subs} substitutions, over {ref_words} reference words"
    )
    summary = (res_dir / f"wer-summary-{test_set}-{suffix}.txt").read_text().splitlines()
    assert summary == ["settings\tWER", f"{key}\t{float(wer)}"]
    return {cut_id: hyp for cut_id, (_, hyp) in recogs.items()}


def reference_streaming_greedy(model: nn.Module, feats: torch.Tensor, unk_id: int = -1) -> List[int]:
    """Independent reference for streaming greedy search (9-frame windows every 4 frames, as sherpa-onnx):
    the original (scaled) transducer's encoder on the whole utterance (N=1), cut to the output frames that
    the windows sherpa-onnx runs produce (one per window ``start + 9 < num_frames``), then one plain loop per
    frame with sherpa-onnx's first context ``[-1] * (context_size - 1) + [blank]``; blank (0) and ``unk_id``
    emit nothing.

    Args:
      feats: (num_frames, 80) features.
    """
    num_out = max(0, (feats.size(0) - 9 + 3) // 4)  # starts 0, 4, ... < num_frames - 9
    with torch.no_grad():
        enc, _, _ = model.encoder(feats.unsqueeze(0), torch.tensor([feats.size(0)]))
        enc = model.joiner.encoder_proj(enc[0, :num_out])
        hyp = [-1] * (model.decoder.context_size - 1) + [0]
        for frame in enc:
            context = torch.tensor([hyp[-model.decoder.context_size :]])
            dec = model.joiner.decoder_proj(model.decoder(context, need_pad=False)[0, 0])
            y = int(model.joiner(frame, dec, project_input=False).argmax())
            if y not in (0, unk_id):
                hyp.append(y)
    return hyp[model.decoder.context_size :]


# build_transducer takes every size without a default; the tests' small model gives them all
# and a test states only what it varies.
TINY_TRANSDUCER = dict(
    vocab_size=12,
    num_features=80,
    encoder_dim=16,
    rnn_hidden_size=16,
    dim_feedforward=32,
    num_encoder_layers=2,
    decoder_dim=16,
    joiner_dim=16,
    context_size=2,
    blank_id=0,
    grad_filter_threshold=25.0,
    dropout=0.1,
    layer_dropout=0.075,
    use_ctc=False,
)


def tiny_transducer(**overrides) -> Transducer:
    """:func:`build_transducer` with :data:`TINY_TRANSDUCER`'s arguments, ``overrides`` on top."""
    return build_transducer(**{**TINY_TRANSDUCER, **overrides})
