"""DDP on CPU (gloo, loopback only): train.py under torchrun on one node and on two "nodes" of one process
(c10d rendezvous on 127.0.0.1) trains exactly as ``--world-size 2`` does; a rank killed under
``torchrun --max-restarts 1`` is restarted and the job resumes from the newest checkpoint; ranks that
resumed from different checkpoints and impossible launches are refused; the DDP step skip and the
--max-minutes stop are decided jointly (2-process tests that fail without the fixes)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import RECIPE, TINY_MODEL, assert_flag_error, free_port, recipe_env, tiny_training_setup
from icefall_lite.nn.model import build_transducer
from icefall_lite.nn.scaling import ActivationBalancer
from icefall_lite.train.cli import get_params, get_parser, validate_args
from icefall_lite.train.distributed import (
    Placement,
    check_launch,
    shared_store_restart_problem,
    threads_per_rank,
    torchrun_placement,
)
from icefall_lite.train.grad_control import GradientControl
from icefall_lite.train.loop import budget_spent
from icefall_lite.train.loss import compute_loss
from icefall_lite.train.optim import Eden, Eve
from icefall_lite.train.setup import model_checksum, training_model_config
from icefall_lite.train.step import train_step
from icefall_lite.train.training import Training
from icefall_lite.utils import AttributeDict

TRAIN = RECIPE / "lstm_transducer_stateless" / "train.py"
# tests/test_train.py's small model and tiny-corpus flags: a run takes seconds.
FLAGS = "--bpe-model data/lang_bpe_100/bpe.model --max-duration 30 --num-workers 0 --num-epochs 1"
FLAGS += " --log-interval 1 --tensorboard false"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TIMEOUT = 300


def _env(**extra: str) -> dict:
    """The recipe's environment without any launcher variables, one thread per process (2 ranks on 2 cores;
    torchrun would set OMP_NUM_THREADS=1 for its 2 processes on one node but not for 1 per node, and the
    spawn path must run with the same threads to give the same floats)."""
    env = {k: v for k, v in recipe_env().items() if not k.startswith(("TORCHELASTIC_", "TORCH_DISABLE_SHARE"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _train_args(exp_dir: Path, *extra: str) -> List[str]:
    return [str(TRAIN), "--exp-dir", str(exp_dir), *FLAGS.split(), *TINY_MODEL, *extra]


def _run(cmd: List[str], work: Path, env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, env=env, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _start(cmd: List[str], work: Path, env: dict, output: Path) -> subprocess.Popen:
    """``cmd`` started in ``work``, its stdout and stderr into the file ``output`` (a pipe nobody reads while
    the test waits could fill and stop the process)."""
    with open(output, "w") as f:
        return subprocess.Popen(cmd, cwd=work, env=env, stdout=f, stderr=subprocess.STDOUT)


def _wait(procs: List[subprocess.Popen]) -> List[int]:
    """The exit codes of ``procs`` (all killed if one outlives :data:`TIMEOUT`)."""
    try:
        return [p.wait(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _rank_logs(exp_dir: Path) -> Dict[int, str]:
    """{global rank: text} of the newest training log of every rank in exp_dir/log."""
    logs: Dict[int, str] = {}
    for path in sorted((exp_dir / "log").glob("log-train-*")):
        rank = int(path.name.rsplit("-", 1)[1])
        logs[rank] = path.read_text()  # sorted by date: a later attempt's log replaces an earlier one
    return logs


def _checksums(logs: Dict[int, str]) -> Dict[int, str]:
    out = {}
    for rank, text in logs.items():
        m = re.search(r"Model checksum \(rank (\d)\): ([0-9a-f]{64})", text)
        assert m and int(m.group(1)) == rank, text[-2000:]
        out[rank] = m.group(2)
    return out


def _batch_losses(text: str) -> Dict[int, str]:
    """{global batch: 'loss[...]' text} of one rank's log: which data the rank trained on, and to what."""
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"global batch (\d+), loss\[([^\]]*)\]", text)}


@pytest.fixture(scope="module")
def spawn_run(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Tuple[Path, Dict[int, str]]:
    """The exp-dir and the logs by rank of ``train.py --world-size 2 --max-batches 2`` (the spawn path), the
    reference."""
    exp_dir = tmp_path_factory.mktemp("spawn") / "exp"
    args = _train_args(exp_dir, "--world-size", "2", "--master-port", str(free_port()), "--max-batches", "2")
    _run([sys.executable, *args], tiny_data, _env())
    logs = _rank_logs(exp_dir)
    assert sorted(logs) == [0, 1]
    assert "Rank 1 of 2 (spawn), local rank 1 of 2" in logs[1]
    return exp_dir, logs


def _assert_same_training(logs: Dict[int, str], reference: Dict[int, str]) -> None:
    """Both ranks trained on the reference's data shares to its losses, and end with its weights."""
    assert sorted(logs) == [0, 1]
    for rank in (0, 1):
        assert _batch_losses(logs[rank]) == _batch_losses(reference[rank]), rank
        assert sorted(_batch_losses(logs[rank])) == [1, 2]
    assert _batch_losses(logs[0]) != _batch_losses(logs[1])  # each rank its own share of the data
    checksums = _checksums(logs)
    assert checksums[0] == checksums[1] == _checksums(reference)[0]


def test_torchrun_one_node_trains_as_world_size(tiny_data, tmp_path, spawn_run):
    """torchrun --nproc-per-node 2 = --world-size 2: same shares, losses and weights; one TensorBoard writer."""
    exp_dir = tmp_path / "exp"
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2"]
    _run([*cmd, *_train_args(exp_dir, "--max-batches", "2", "--tensorboard", "true")], tiny_data, _env())
    logs = _rank_logs(exp_dir)
    _assert_same_training(logs, spawn_run[1])
    for rank in (0, 1):
        assert f"Rank {rank} of 2 (torchrun), local rank {rank} of 2" in logs[rank]
    assert len(list((exp_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert sorted(p.name for p in exp_dir.glob("*.pt")) == ["checkpoint-2.pt"]


def test_torchrun_two_nodes_train_as_world_size(tiny_data, tmp_path, spawn_run):
    """Two torchrun commands of one process each, joined by a c10d rendezvous on 127.0.0.1 (two "nodes"):
    global ranks 0 and 1, local rank 0 on each, trained as --world-size 2."""
    exp_dir = tmp_path / "exp"
    endpoint = f"127.0.0.1:{free_port()}"
    procs = []
    for node in (0, 1):
        cmd = [*TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1"]
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes"]
        args = _train_args(exp_dir, "--max-batches", "2")
        procs.append(_start([*cmd, *args], tiny_data, _env(), tmp_path / f"node{node}.out"))
    outputs = [(tmp_path / f"node{node}.out") for node in (0, 1)]
    assert _wait(procs) == [0, 0], "\n".join(o.read_text()[-4000:] for o in outputs)
    logs = _rank_logs(exp_dir)
    _assert_same_training(logs, spawn_run[1])
    for rank in (0, 1):
        assert f"Rank {rank} of 2 (torchrun), local rank 0 of 1" in logs[rank]


def test_ranks_resumed_from_different_checkpoints_are_refused(tiny_data, tmp_path, spawn_run):
    """Two "nodes" whose --exp-dir differ (no shared filesystem): one finds a checkpoint, the other none."""
    with_checkpoint, empty = tmp_path / "a", tmp_path / "b"
    shutil.copytree(spawn_run[0], with_checkpoint)
    endpoint = f"127.0.0.1:{free_port()}"
    procs = []
    for node, exp_dir in enumerate((with_checkpoint, empty)):
        cmd = [*TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1"]
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "unshared"]
        args = _train_args(exp_dir, "--max-batches", "4")
        procs.append(_start([*cmd, *args], tiny_data, _env(), tmp_path / f"node{node}.out"))
    codes = _wait(procs)
    outputs = [(tmp_path / f"node{node}.out").read_text() for node in (0, 1)]
    assert codes == [1, 1], outputs
    assert sorted(p.name for p in with_checkpoint.glob("*.pt")) == ["checkpoint-2.pt"]  # nothing trained
    assert list(empty.glob("*.pt")) == []
    errors = "".join(outputs)
    assert errors.count("did not all resume from the same checkpoint") == 2, errors


def _pid_of_rank(exp_dir: Path, rank: int) -> int:
    text = _rank_logs(exp_dir)[rank]
    m = re.search(rf"Rank {rank} of 2 \(torchrun\).* process id (\d+)", text)
    assert m, text
    return int(m.group(1))


def test_killed_rank_restarts_and_resumes_from_the_newest_checkpoint(tiny_data, tmp_path):
    """Rank 1 is killed (SIGKILL) once checkpoint-2.pt exists; torchrun --max-restarts 1 restarts both ranks,
    which resume from the newest checkpoint, train the rest of the epoch and end with identical weights, the
    weights of the same run never killed.

    torchrun runs with --standalone (c10d) and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with the store shared
    (torch's default) the restarted ranks read the killed attempt's addresses and cannot connect."""
    exp_dir = tmp_path / "exp"
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.1"]
    out = tmp_path / "torchrun.out"
    args = _train_args(exp_dir, "--save-every-n", "2")
    proc = _start([*cmd, *args], tiny_data, _env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"), out)
    try:
        deadline = time.time() + TIMEOUT
        while not (exp_dir / "checkpoint-2.pt").exists():  # saved atomically by rank 0
            assert proc.poll() is None and time.time() < deadline, out.read_text()[-4000:]
            time.sleep(0.05)
        first_logs = _rank_logs(exp_dir)
        os.kill(_pid_of_rank(exp_dir, 1), signal.SIGKILL)
        newest = max(int(p.stem.split("-")[1]) for p in exp_dir.glob("checkpoint-*.pt"))
        code = proc.wait(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = out.read_text()
    assert code == 0, output[-5000:]
    assert re.search(r"exitcode: -9\) local_rank: 1", output)  # torchrun saw rank 1 killed, and restarted
    logs = _rank_logs(exp_dir)
    for rank in (0, 1):
        assert logs[rank] != first_logs[rank]  # the restarted attempt's own log
        assert f"Loading checkpoint {exp_dir}/checkpoint-{newest}.pt" in logs[rank]
        # Nothing checkpointed is trained again, nothing after it is lost: batches newest+1 .. 4 of the epoch.
        assert sorted(_batch_losses(logs[rank])) == list(range(newest + 1, 5))
        assert "Epoch 1 done" in logs[rank]
    checksums = _checksums(logs)
    assert checksums[0] == checksums[1]
    assert (exp_dir / "epoch-1.pt").is_file()
    # Exact: the same run never killed ends with the same weights (every rank resumed its own generators).
    whole = tmp_path / "uninterrupted"
    _run(
        [*TORCHRUN, "--standalone", "--nproc-per-node", "2", *_train_args(whole, "--save-every-n", "2")],
        tiny_data,
        _env(),
    )
    assert _checksums(_rank_logs(whole)) == checksums


# --------------------------------------------------------------------------
# Launch errors (in-process: validate_args)
# --------------------------------------------------------------------------

TORCHRUN_ENV = dict(
    RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"
)


@pytest.mark.parametrize(
    "env, argv, gpus, message",
    [
        (TORCHRUN_ENV, ["--world-size", "2"], 0, "--world-size 2 under torchrun (WORLD_SIZE=2 in the environment)"),
        (TORCHRUN_ENV, ["--master-port", "1234"], 0, "under torchrun leave it out and use torchrun's --master-port"),
        ({"RANK": "0"}, [], 0, "the environment sets RANK=0 but not WORLD_SIZE, LOCAL_RANK"),
        ({}, ["--world-size", "4"], 2, "--world-size 4 asks for one GPU per process but 2 GPU(s) are visible"),
        (
            {**TORCHRUN_ENV, "LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8"},
            [],
            2,
            "torchrun started 4 processes on this machine (LOCAL_WORLD_SIZE) but 2 GPU(s) are visible: use "
            "torchrun --nproc-per-node 2",
        ),
        (
            {
                **TORCHRUN_ENV,
                "TORCHELASTIC_RESTART_COUNT": "1",
                "TORCHELASTIC_MAX_RESTARTS": "1",
                "TORCHELASTIC_USE_AGENT_STORE": "True",
            },
            [],
            0,
            "this is a restart (TORCHELASTIC_RESTART_COUNT=1) but torchrun shares its rendezvous store",
        ),
    ],
)
def test_impossible_launches_are_refused(monkeypatch, capsys, env, argv, gpus, message):
    for name in list(os.environ):
        if name in TORCHRUN_ENV or name.startswith("TORCHELASTIC_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert_flag_error(get_parser(), validate_args, argv, message, capsys)


def test_launches_that_work_are_accepted():
    """The refusals' complements: torchrun with a GPU per local process, spawn on CPUs, a first attempt or a
    restart without the shared store, one process."""
    check_launch(1, TORCHRUN_ENV, num_gpus=2)
    check_launch(8, {}, num_gpus=0)
    restart = {**TORCHRUN_ENV, "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "1"}
    check_launch(1, {**restart, "TORCHELASTIC_USE_AGENT_STORE": "False"})
    first = {**restart, "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    check_launch(1, first)
    assert shared_store_restart_problem(first) is not None  # logged as a warning on the first attempt
    assert shared_store_restart_problem({**first, "WORLD_SIZE": "1"}) is None
    placement = torchrun_placement({**TORCHRUN_ENV, "RANK": "3", "WORLD_SIZE": "4"})
    assert (placement.rank, placement.world_size, placement.local_rank, placement.local_world_size) == (3, 4, 1, 2)


# --------------------------------------------------------------------------
# DDP decisions taken jointly (2 gloo processes calling the real train_step / budget_spent)
# --------------------------------------------------------------------------


def _join(rank: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=30)
    )


def _batch(nan: bool) -> dict:
    gen = torch.Generator().manual_seed(3)
    inputs = torch.randn(3, 120, 80, generator=gen)
    if nan:
        inputs[:, 10:20] = float("nan")  # every utterance's loss is non-finite
    return {
        "inputs": inputs,
        "supervisions": {"text": ["HELLO THERE", "A CAT", "THE END"], "num_frames": torch.tensor([120, 100, 90])},
    }


NAN_RANKS = {"rank 1": [1], "every rank": [0, 1]}


def _step_worker(rank: int, port: int, bpe_model: str, out: str) -> None:
    """For each case of :data:`NAN_RANKS`: one train_step of a fresh DDP-wrapped model where the batches of
    the ranks listed have no utterance with a finite loss."""
    torch.set_num_threads(1)
    _join(rank, port)
    args = get_parser().parse_args(["--bpe-model", bpe_model, *TINY_MODEL])
    sp = spm.SentencePieceProcessor()
    sp.load(bpe_model)
    results = {}
    for case, nan_ranks in NAN_RANKS.items():
        params = get_params()
        params.update(vars(args))
        params.batch_idx_train = 1
        torch.manual_seed(0)
        model = build_transducer(**training_model_config(args, vocab_size=sp.get_piece_size(), blank_id=0))
        before = model_checksum(model)
        model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = Eve(model.parameters(), lr=params.base_lr)
        t = Training(
            params=params,
            model=model,
            optimizer=optimizer,
            scheduler=Eden(optimizer, params.lr_batches, params.lr_epochs),
            grad_control=GradientControl.from_params(params),
            sp=sp,
            world_size=2,
            rank=rank,
        )
        train_step(t, _batch(nan=rank in nan_ranks))
        t.flush_log()  # the device's count of skipped steps into params
        results[case] = {"before": before, "after": model_checksum(model), "skipped": params.skipped_steps}
    Path(out, f"{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def test_step_skip_is_decided_on_all_ranks(tiny_data, tmp_path):
    """Rank 1's batch has no finite loss: with rank 0's finite one, both ranks step (to the same weights);
    with no finite loss on any rank, both skip. (Decided per rank, rank 1 skipped while rank 0 stepped.)"""
    bpe_model = str(tiny_data / "data/lang_bpe_100/bpe.model")
    mp.spawn(_step_worker, args=(free_port(), bpe_model, str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    for case in NAN_RANKS:
        r0, r1 = results[0][case], results[1][case]
        assert r0["before"] == r1["before"], case
        assert r0["after"] == r1["after"], case
        everywhere = case == "every rank"
        assert [r0["skipped"], r1["skipped"]] == ([1, 1] if everywhere else [0, 0]), case
        assert (r0["after"] == r0["before"]) == everywhere, case


def _budget_worker(rank: int, port: int, out: str) -> None:
    """Ten batches with a 1-minute --max-minutes; rank 0's clock runs 4x as fast as rank 1's (as a rank 0
    busy with logging and checkpoints). Each batch ends in an all-reduce (DDP's), the stop in another
    (validation's)."""
    torch.set_num_threads(1)
    _join(rank, port)
    params = AttributeDict(max_batches=0, max_minutes=1.0, batch_idx_train=0, train_seconds=0.0)
    stopped_at = None
    for _ in range(10):
        params.batch_idx_train += 1
        dist.all_reduce(torch.ones(4))  # the step's gradient all-reduce
        params.train_seconds += 20.0 if rank == 0 else 5.0
        if budget_spent(params):
            stopped_at = params.batch_idx_train
            break
    validation = torch.ones(2)
    dist.all_reduce(validation)  # the validation loss all-reduce after the stop
    Path(out, f"{rank}.json").write_text(json.dumps({"stopped_at": stopped_at, "validation": validation.tolist()}))
    dist.destroy_process_group()


def test_max_minutes_stops_all_ranks_at_the_same_batch(tmp_path):
    """Rank 0 crosses --max-minutes at batch 3, rank 1's own clock would at batch 12: both stop at batch 3 and
    meet in the validation all-reduce. (Each deciding alone, rank 0's validation met rank 1's next step.)"""
    mp.spawn(_budget_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["stopped_at"] for r in results] == [3, 3]
    assert [r["validation"] for r in results] == [[2.0, 2.0], [2.0, 2.0]]


@pytest.mark.parametrize(
    "environ, local_world_size, cores, expected",
    [
        ({}, 8, 64, 8),  # 8 ranks on a 64-core host: 8 threads each, not 64
        ({}, 2, 2, 1),
        ({}, 4, 2, 1),  # never below one
        ({"OMP_NUM_THREADS": "3"}, 8, 64, 3),  # the user's (or torchrun's) setting wins
    ],
)
def test_threads_per_rank_share_the_host(environ, local_world_size, cores, expected):
    placement = Placement(0, local_world_size, 0, local_world_size, "spawn")
    assert threads_per_rank(placement, environ, cores) == expected


# --------------------------------------------------------------------------
# One process at N x the batch against N ranks (what one large GPU does in place of icefall's 4)
# --------------------------------------------------------------------------


def _utterances() -> dict:
    """Six utterances of one length (padding is not what this compares), each with its own text."""
    gen = torch.Generator().manual_seed(5)
    texts = ["HELLO THERE", "A CAT", "THE END", "THERE IS A CAT", "HELLO", "THE CAT AT THE END"]
    return {
        "inputs": torch.randn(6, 110, 80, generator=gen),
        "supervisions": {"text": texts, "num_frames": torch.full((6,), 110)},
    }


def _half(batch: dict, rank: int) -> dict:
    part = slice(3 * rank, 3 * rank + 3)
    sup = batch["supervisions"]
    return {"inputs": batch["inputs"][part], "supervisions": {k: v[part] for k, v in sup.items()}}


def _loss_and_model(bpe_model: str):
    # The filter observing only (threshold inf): where it acts, its median is over each process's own batch.
    return tiny_training_setup(bpe_model, "--grad-filter-threshold", "inf")


def _gradients(params, model, sp, batch: dict) -> Dict[str, torch.Tensor]:
    loss, _ = compute_loss(params, model, sp, batch, is_training=True)
    loss.backward()
    named = model.module.named_parameters() if hasattr(model, "module") else model.named_parameters()
    return {n: p.grad for n, p in named}


def _without_balancers(monkeypatch) -> None:
    """The ActivationBalancers as identities: they change the gradient from their batch's statistics."""
    monkeypatch.setattr(ActivationBalancer, "forward", lambda self, x, mask=None: x)


def _gradient_worker(rank: int, port: int, bpe_model: str, out: str) -> None:
    """Rank ``rank``'s half of the six utterances through the DDP-wrapped model, with the model's
    ActivationBalancers and without: the all-reduced gradients."""
    torch.set_num_threads(1)
    _join(rank, port)
    grads = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        for case in ("balancers", "no balancers"):
            if case == "no balancers":
                _without_balancers(monkeypatch)
            params, model, sp = _loss_and_model(bpe_model)
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            grads[case] = _gradients(params, ddp, sp, _half(_utterances(), rank))
    torch.save(grads, Path(out, f"{rank}.pt"))
    dist.destroy_process_group()


def test_one_process_at_twice_the_batch_sums_what_two_ranks_average(tiny_data, tmp_path, monkeypatch):
    """The loss is summed over utterances (icefall's way) and DDP averages the ranks' gradients, so one
    process on all six utterances computes twice the gradient two ranks of three each end with (to rounding):
    an Adam-type update does not see that factor, a --clip-grad-norm threshold does. Exactly so only without
    the ActivationBalancers, which push the gradient from statistics of their own batch."""
    bpe_model = str(tiny_data / "data/lang_bpe_100/bpe.model")
    mp.spawn(_gradient_worker, args=(free_port(), bpe_model, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"{rank}.pt") for rank in (0, 1)]
    torch.set_num_threads(1)
    one = {"balancers": _gradients(*_loss_and_model(bpe_model), _utterances())}
    _without_balancers(monkeypatch)
    one["no balancers"] = _gradients(*_loss_and_model(bpe_model), _utterances())
    for case, grads in one.items():
        for name in grads:
            assert torch.equal(ranks[0][case][name], ranks[1][case][name]), name  # one gradient after all-reduce

    def off(case: str, name: str) -> float:  # one process's gradient against 2x the ranks', relative (norms)
        g = one[case][name]
        return float((g - 2 * ranks[0][case][name]).norm() / g.norm().clamp(min=1e-30))

    assert max(off("no balancers", name) for name in one["no balancers"]) < 2e-5  # rounding (3e-6 seen)
    # With them, the first layers' gradients differ by far more than rounding (about 2e-3 here).
    assert off("balancers", "encoder.encoder_embed.conv.0.weight") > 2e-4


def test_eve_takes_the_same_steps_on_a_gradient_and_on_twice_it():
    """Why the factor of the test above leaves training alone where no clip acts: Eve (Adam's update divided
    by the root of its second moment) moves the weights alike on g and on 2g, but for its eps (1e-8)."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(50, 40, generator=gen) * 0.05  # RMS below Eve's target 0.1: no weight decay, Adam alone
    grads = [torch.randn(50, 40, generator=gen) * 1e-2 for _ in range(5)]
    moved = []
    for factor in (1.0, 2.0):
        weight = torch.nn.Parameter(start.clone())
        optimizer = Eve([weight], lr=0.003)
        for g in grads:
            weight.grad = factor * g
            optimizer.step()
        moved.append(weight.detach() - start)
    assert float(moved[0].norm()) > 1e-3  # the steps moved the weights
    # Relative over the whole tensor: an element whose gradients are near 0 meets eps, and rounding.
    assert float((moved[1] - moved[0]).norm() / moved[0].norm()) < 1e-4
