"""``--cuda-graphs`` (issue 74 item 5), proven on the CPU: the training step captured once per static batch
shape and replayed (tests/graph_replay.py: a CUDA graph's semantics, the ops replayed and nothing else) trains
as the eager step does, bit for bit, with a skipped step among the replays; and the flag refuses what it
cannot capture, by name."""

from __future__ import annotations

import argparse
import math
from typing import Dict, List, Sequence

import pytest
import torch
from graph_replay import HostReadInCapture, RecordedGraphs

from benchmarks.train_setup import TokenTable, Trainer
from icefall_lite.nn import mutual_information, scaling
from icefall_lite.train.cli import get_parser, validate_args
from icefall_lite.train.cuda_graphs import WARMUP_STEPS, StepGraphs, refusals, use_cuda_graphs
from icefall_lite.train.loop import LayerFilterStats, filter_stats
from icefall_lite.train.step import train_step
from icefall_lite.train.step_log import read_metrics, read_scalars

TINY = ["--num-encoder-layers", "2", "--encoder-dim", "32", "--rnn-hidden-size", "32", "--dim-feedforward", "64"]
TINY += ["--decoder-dim", "32", "--joiner-dim", "32"]
VOCAB = 50
# Two bucket shapes, each with its own utterance lengths (frames, tokens): the CPU's loss recursion reads
# the lengths for its loop bounds, so a shape's batches keep the lengths of its capture (on CUDA the Triton
# kernel does not read them).
SHAPES = [([60, 48], [6, 4]), ([100, 90, 70], [8, 5, 7])]
STEPS = 10
NAN_STEP = 7  # a batch of the second shape, replayed: every loss NaN, so the step is skipped


def _batches(tokens: TokenTable) -> List[dict]:
    gen = torch.Generator().manual_seed(4)
    out = []
    for b in range(STEPS):
        frames, lengths = SHAPES[b % 2]
        feats = torch.full((len(frames), max(frames), 80), -23.0)
        texts = []
        for i, (n, u) in enumerate(zip(frames, lengths)):
            feats[i, :n] = torch.randn(n, 80, generator=gen) * 3.0 - 8.0
            tokens.ids[f"b{b}-u{i}"] = torch.randint(3, VOCAB, (u,), generator=gen).tolist()
            texts.append(f"b{b}-u{i}")
        if b == NAN_STEP:
            feats[:] = math.nan
        out.append({"inputs": feats, "supervisions": {"num_frames": torch.tensor(frames), "text": texts}})
    return out


def _train(graphs: StepGraphs, flags: Sequence[str] = ()) -> Dict[str, object]:
    """STEPS steps of the tiny model (layer dropout and the balancers' draws on), each step's outputs read
    after it, and the state at the end."""
    tokens = TokenTable()
    batches = _batches(tokens)
    trainer = Trainer([*TINY, *flags], vocab_size=VOCAB)
    # --use-fp16: the loss scaler train.py makes (a CPU one here), from a small scale so that steps overflow
    # and back off as well as step.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3) if trainer.args.use_fp16 else None
    t = trainer.training(tokens, graphs=graphs, scaler=scaler)
    steps = []
    for batch in batches:
        trainer.params.batch_idx_train += 1
        info, grad_norm, clip_scale = train_step(t, batch)
        # What the loop reads of the modules after a step: the filters' statistics, the clips' counts.
        stats = [getattr(s, k) for s in filter_stats(trainer.model) for k in LayerFilterStats.STATS]
        counts = [layer.lstm.recurrent_clip_stats.fraction_clipped for layer in trainer.model.encoder.encoder.layers]
        counts += [c.fraction_clipped for c in trainer.grad_control.error_clip_counts]
        steps.append((dict(read_metrics(info)), read_scalars([grad_norm, clip_scale, *stats, *filter(None, counts)])))
    t.flush_log()
    optimizer = trainer.optimizer
    threshold = getattr(optimizer, "_clip_threshold", None)  # ScaledAdam's clipping rule
    return {
        "steps": steps,
        "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        "optimizer": [{k: v.clone() for k, v in s.items()} for s in optimizer.state.values()],
        "clipping": None if threshold is None else (threshold.state_dict(), optimizer.num_clipped),
        "skipped": trainer.params.skipped_steps,
        "scaler": None if scaler is None else (scaler.state_dict(), trainer.params.scaler_backoffs),
    }


def _assert_same(a: Dict[str, object], b: Dict[str, object]) -> None:
    assert a["skipped"] == b["skipped"] == 1
    for i, ((info_a, norm_a), (info_b, norm_b)) in enumerate(zip(a["steps"], b["steps"])):
        assert info_a == info_b, i
        # NaN where a step has no finite gradient (the NaN batch without a loss scaler; an overflow), alike.
        assert len(norm_a) == len(norm_b) and all(
            x == y or math.isnan(x) and math.isnan(y) for x, y in zip(norm_a, norm_b)
        )
    assert a["params"].keys() == b["params"].keys()
    assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
    assert len(a["optimizer"]) == len(b["optimizer"])
    assert all(torch.equal(x[k], y[k]) for x, y in zip(a["optimizer"], b["optimizer"]) for k in x)
    assert a["clipping"] == b["clipping"] and a["scaler"] == b["scaler"]


@pytest.fixture(autouse=True)
def _draws_on_the_device(monkeypatch):
    """The training draws kept on the device, as on a GPU (on the CPU the host reads them: scaling.HOST_DRAWS)."""
    monkeypatch.setattr(scaling, "HOST_DRAWS", ())


@pytest.fixture(autouse=True)
def _pytorch_recursion():
    """The PyTorch loss recursion (the CPU's): the recorder replays aten ops, not Triton's interpreter."""
    previous = mutual_information.BACKEND
    mutual_information.BACKEND = "pytorch"
    yield
    mutual_information.BACKEND = previous


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--zclip-z-threshold", "2.5"],
        ["--use-bf16", "true"],
        ["--error-clip", "0.001", "--recurrent-grad-clip", "1"],
        ["--optimizer", "scaled-adam", "--clip-grad-norm", "0"],
        ["--use-fp16", "true"],
    ],
    ids=str,
)
def test_the_replayed_step_trains_as_the_eager_step_bit_for_bit(flags):
    """Both runs pad every batch to its static shape; the eager one runs step_on_device every time, the
    graphed one captures each shape after WARMUP_STEPS eager steps and replays it (2 captures, 6 replays).
    Parameters, the optimizer's state (Eve's; ScaledAdam's with its clipping history), every step's sums,
    gradient norm, clip scale, filter statistics and clip counts agree exactly (the two shapes' graphs replayed
    in turn), the NaN batch is skipped in both (not counted twice), and the random draws (layer dropout, the
    balancers) follow."""
    device = torch.device("cpu")
    eager = _train(StepGraphs(device, start_batch=0, backend=RecordedGraphs(), warmup_steps=STEPS), flags)
    backend = RecordedGraphs()
    graphed = _train(StepGraphs(device, start_batch=0, backend=backend), flags)
    assert backend.captures == 2 and backend.replays == STEPS - 2 * (WARMUP_STEPS + 1)
    _assert_same(graphed, eager)
    if graphed["scaler"] is not None:
        assert graphed["scaler"][1] > 0, "the loss scaler backed off (overflows replayed too)"


def test_the_replay_is_not_the_eager_step_again():
    """The recorder replays ops only: a Python counter in the captured function runs once, its tensor
    updates every replay, and a host read in a capture is an error (so the tests above could fail)."""
    calls, x = [], torch.zeros(3)

    def step():
        calls.append(1)
        x.add_(torch.ones(3))
        return x * 2

    backend = RecordedGraphs()
    out, graph = backend.capture(step)
    backend.replay(graph)
    backend.replay(graph)
    assert len(calls) == 1 and x.tolist() == [3.0, 3.0, 3.0] and out.tolist() == [6.0, 6.0, 6.0]
    with pytest.raises(HostReadInCapture, match="item at tests/test_cuda_graphs.py|outside icefall_lite"):
        backend.capture(lambda: float(x.sum()))


def test_a_step_with_a_host_read_cannot_be_captured():
    """--grad-filter-mode hard-mask reads a flag in its backward (refused by name below): its capture fails
    with an error naming the read and the way out."""
    tokens = TokenTable()
    batches = _batches(tokens)[:NAN_STEP]
    trainer = Trainer([*TINY, "--grad-filter-mode", "hard-mask"], vocab_size=VOCAB)
    graphs = StepGraphs(torch.device("cpu"), start_batch=0, backend=RecordedGraphs())
    t = trainer.training(tokens, graphs=graphs)
    with pytest.raises(RuntimeError, match="icefall_lite/nn/clip/filter.py:backward.*--cuda-graphs false"):
        for batch in batches:
            trainer.params.batch_idx_train += 1
            train_step(t, batch)


def _args(tiny_data, *flags: str) -> argparse.Namespace:
    return get_parser().parse_args(["--bpe-model", str(tiny_data / "data/lang_bpe_100/bpe.model"), *flags])


def test_true_on_a_cpu_is_refused_naming_the_gpu(tiny_data, capsys, monkeypatch):
    """No CUDA device (as in CI; made so on a machine with one too): true is an argparse error naming the
    missing GPU; auto turns graphs off."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    parser = get_parser()
    args = _args(tiny_data, "--cuda-graphs", "true")
    with pytest.raises(SystemExit):
        validate_args(parser, args)
    assert "--cuda-graphs true needs a CUDA GPU; this run trains on cpu" in capsys.readouterr().err
    assert not use_cuda_graphs(_args(tiny_data), torch.device("cpu"), 1)


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--grad-filter-mode", "uniform"], "--grad-filter-mode uniform"),
        (["--autoclip-percentile", "10"], "--autoclip-percentile"),
        (["--scaled-adam-clipping-scale", "2"], "--scaled-adam-clipping-scale"),
        (["--log-sequence-gradients", "true"], "--log-sequence-gradients"),
        (["--print-diagnostics", "true"], "--print-diagnostics"),
        (["--inf-check", "true"], "--inf-check"),
    ],
)
def test_each_configuration_that_reads_is_refused_by_name(flags, named):
    """On a CUDA device (asked of the rule, not run): true raises naming the flag; auto turns graphs off."""
    args = get_parser().parse_args(["--bpe-model", "unused", *flags])
    assert [r for r in refusals(args, 1) if r.startswith(named)] and len(refusals(args, 1)) == 1
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match=f"--cuda-graphs true cannot capture this configuration's step: {named}"):
        use_cuda_graphs(argparse.Namespace(**{**vars(args), "cuda_graphs": "true"}), cuda, 1)
    assert not use_cuda_graphs(args, cuda, 1)
    assert refusals(get_parser().parse_args(["--bpe-model", "unused"]), 2)[0].startswith("--world-size 2")
    assert refusals(get_parser().parse_args(["--bpe-model", "unused"]), 1) == []
    assert use_cuda_graphs(get_parser().parse_args(["--bpe-model", "unused"]), cuda, 1)


def test_the_cpus_host_read_draws_train_as_the_devices_masks(monkeypatch):
    """On the CPU the balancers and layer dropout read their draws and skip work (scaling.HOST_DRAWS); on a GPU
    they mask it. Both train alike, bit for bit: the same draws, the same gradients."""
    device = torch.device("cpu")
    masked = _train(StepGraphs(device, start_batch=0, backend=RecordedGraphs(), warmup_steps=STEPS))
    monkeypatch.setattr(scaling, "HOST_DRAWS", ("cpu",))
    read = _train(StepGraphs(device, start_batch=0, backend=RecordedGraphs(), warmup_steps=STEPS))
    _assert_same(read, masked)
