"""Graph safety of the training step, proven on the CPU (issue 74): around training steps of the tiny model,
(a) which ops hand a device value to Python (host reads) and (b) which Python values change between two steps
of one batch shape at different step numbers (a CUDA graph would freeze them), each by its place in the code.

The remaining sites are listed by name below (:data:`REMAINING_READS`, :data:`REMAINING_CHANGING` and each
configuration's own): the tests assert that the probe finds exactly those, so the lists can only shrink.
The probed steps are not log steps: :func:`device_step` is probed alone (its inputs made on the host before
it, as the training loop makes them), and the training loop reads the step's device outputs only at
--log-interval, outside it.
"""

from __future__ import annotations

import os
from typing import Dict, List, Sequence, Set, Tuple

import pytest
import torch

from benchmarks.graph_safety import GraphSafetyProbe, Site, changing_values
from benchmarks.train_setup import TokenTable, Trainer
from icefall_lite.nn import mutual_information, scaling
from icefall_lite.train.step import device_step, prepare_step, train_step
from icefall_lite.train.step_log import read_scalars

TINY = ["--num-encoder-layers", "2", "--encoder-dim", "32", "--rnn-hidden-size", "32", "--dim-feedforward", "64"]
TINY += ["--decoder-dim", "32", "--joiner-dim", "32"]
VOCAB = 50

# Host reads left in the step at the default flags (CUDA's path: the Triton recursion), each ``place (kind)``
# (a place is ``path:function``): none. The step's inputs are made on the host before it (loss_inputs: the
# token ids from Python lists, the pruned loss's window from the host's lengths), outside the probe.
REMAINING_READS: Dict[str, str] = {}
# Places where a Python value that changes from step to step (or batch to batch) reaches an op.
REMAINING_CHANGING: Dict[str, str] = {}
# The PyTorch recursion is the CPU path (CUDA runs the Triton kernel): it reads its boundary on the host for
# its loop bounds. The configurations below run it for speed, with these places left out.
CPU_RECURSION = ("icefall_lite/nn/mutual_information_pytorch.py:", "icefall_lite/nn/boundary.py:")


def _batches(tokens: TokenTable, count: int) -> List[dict]:
    """``count`` batches of one bucket shape (2 utterances padded to 60 frames, transcripts of at most 6
    tokens) with different features, lengths and tokens."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for b in range(count):
        frames = [60, 48] if b % 2 == 0 else [52, 60]
        lengths = [6, 4] if b % 2 == 0 else [5, 6]
        feats = torch.full((2, 60, 80), -23.0)
        texts = []
        for i, (n, u) in enumerate(zip(frames, lengths)):
            feats[i, :n] = torch.randn(n, 80, generator=gen) * 3.0 - 8.0
            key = f"b{b}-u{i}"
            tokens.ids[key] = torch.randint(3, VOCAB, (u,), generator=gen).tolist()
            texts.append(key)
        out.append({"inputs": feats, "supervisions": {"num_frames": torch.tensor(frames), "text": texts}})
    return out


def _probe_steps(
    flags: Sequence[str], backend: str, scaler: bool = False, in_warmup: bool = False
) -> Tuple[Set[str], Set[str]]:
    """One eager step, then two probed steps (batches of one shape, consecutive step numbers past the warm-up,
    or ``in_warmup`` in its first tenth): the host-read sites of the probed steps and the places where their
    traces differ."""
    tokens = TokenTable()
    batches = _batches(tokens, 3)
    trainer = Trainer([*TINY, *flags], vocab_size=VOCAB)
    extra = {"scaler": torch.amp.GradScaler("cpu", init_scale=256.0)} if scaler else {}
    t = trainer.training(tokens, **extra)
    if in_warmup:
        trainer.params.batch_idx_train = trainer.params.model_warm_step // 10
    reads: Set[Site] = set()
    traces = []
    previous = mutual_information.BACKEND
    mutual_information.BACKEND = backend
    try:
        for i, batch in enumerate(batches):
            trainer.params.batch_idx_train += 1
            if i == 0:
                train_step(t, batch)
                continue
            inputs = prepare_step(t, batch)  # on the host, before the step
            with GraphSafetyProbe() as probe:
                device_step(t, inputs)
            reads |= set(probe.host_reads)
            traces.append(probe.trace)
    finally:
        mutual_information.BACKEND = previous
    return {str(s) for s in reads}, set(changing_values(*traces))


def _outside_cpu_recursion(places: Set[str]) -> Set[str]:
    return {p for p in places if not p.startswith(CPU_RECURSION)}


def _matches(place: str, entry: str) -> bool:
    """Whether a found place (``path:function`` or ``path:function (kind)``) is the listed ``entry``: the same,
    ``path (kind)`` for that kind anywhere in the file, or ``path`` for anything in it."""
    if place == entry:
        return True
    path, _, rest = entry.partition(" ")
    where, _, kind = place.partition(" ")
    return ":" not in path and where.startswith(path + ":") and rest in ("", kind)


def _assert_exactly(found: Set[str], listed: Sequence[str]) -> None:
    """Every found place is listed and every listed entry is found (the list can only shrink)."""
    unlisted = sorted(p for p in found if not any(_matches(p, e) for e in listed))
    gone = sorted(e for e in listed if not any(_matches(p, e) for p in found))
    assert (unlisted, gone) == ([], []), f"found but not listed: {unlisted}; listed but not found: {gone}"


@pytest.fixture(autouse=True)
def _draws_on_the_device(monkeypatch):
    """The training draws kept on the device, as on a GPU (on the CPU the host reads them: scaling.HOST_DRAWS)."""
    monkeypatch.setattr(scaling, "HOST_DRAWS", ())


INTERPRETER = "the kernel on CPU tensors needs TRITON_INTERPRET=1 (conftest sets it where no GPU is)"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason=INTERPRETER)
def test_the_step_on_cudas_path_has_exactly_the_remaining_sites():
    """The default flags, the recursion by the Triton kernel (CUDA's path; in the interpreter here)."""
    pytest.importorskip("triton")
    reads, changing = _probe_steps([], backend="triton")
    _assert_exactly(reads, list(REMAINING_READS))
    _assert_exactly(changing, list(REMAINING_CHANGING))


# Each gradient control, optimizer and precision: its flags and the sites it adds to the default's (reads,
# changing values). The norm-history rules (relative, ZClip, AutoClip) keep their histories on the device;
# float16 is the GradScaler's path on the CPU (autocast float16, a CPU GradScaler).
CONFIGURATIONS: Dict[str, Tuple[List[str], Dict[str, str], Dict[str, str]]] = {
    "defaults": ([], {}, {}),
    "no-clip": (["--clip-grad-norm", "0"], {}, {}),
    "grad-filter-off": (["--grad-filter-threshold", "0"], {}, {}),
    "grad-filter-uniform": (
        ["--grad-filter-mode", "uniform"],
        {"icefall_lite/nn/clip/filter.py:backward (item)": "if float(cutoff) > 0 (item 2's file)"},
        {},
    ),
    "grad-filter-hard-mask": (
        ["--grad-filter-mode", "hard-mask"],
        {"icefall_lite/nn/clip/filter.py:backward (item)": "if bool(drop.any()) (item 2's file)"},
        {},
    ),
    "recurrent-grad-clip": (["--recurrent-grad-clip", "1"], {}, {}),
    "clip-grad-value": (["--clip-grad-value", "0.01"], {}, {}),
    "agc": (["--agc-clipping", "0.01"], {}, {}),
    "relative": (["--clip-grad-norm-relative", "2"], {}, {}),
    "zclip": (["--zclip-z-threshold", "2.5"], {}, {}),
    "autoclip": (["--autoclip-percentile", "10"], {}, {}),
    "scaled-adam-clipping": (
        ["--scaled-adam-clipping-scale", "2"],
        {
            "icefall_lite/nn/clip/history.py:scale (item)": "the weighted norm and its median on the host",
            "icefall_lite/nn/clip/history.py:scale (from-python)": "the norm history as a tensor of floats",
            "icefall_lite/train/grad_control.py:_history_scale (item)": "ScaledAdam's rule runs on finite norms",
        },
        {"icefall_lite/nn/clip/history.py:scale": "the history's floats reach ops"},
    ),
    "error-clip": (["--error-clip", "0.001"], {}, {}),
    "scaled-adam": (["--optimizer", "scaled-adam"], {}, {}),
    "bf16": (["--use-bf16", "true"], {}, {}),
    "fp16": (["--use-fp16", "true"], {}, {}),
    "in-warm-up": (
        [],
        {},
        {
            "icefall_lite/nn/encoder.py:forward": "the warm-up's bypass scale as a Python float",
        },
    ),
}


def _with(base: Dict[str, str], added: Dict[str, str]) -> List[str]:
    """``base``'s entries and ``added``'s."""
    return list({**base, **added})


@pytest.mark.parametrize("name", sorted(CONFIGURATIONS))
def test_each_configuration_has_exactly_its_remaining_sites(name):
    """The PyTorch recursion (fast here), its own places left out (:data:`CPU_RECURSION`)."""
    flags, reads_added, changing_added = CONFIGURATIONS[name]
    reads, changing = _probe_steps(flags, backend="pytorch", scaler=name == "fp16", in_warmup=name == "in-warm-up")
    _assert_exactly(_outside_cpu_recursion(reads), _with(REMAINING_READS, reads_added))
    _assert_exactly(_outside_cpu_recursion(changing), _with(REMAINING_CHANGING, changing_added))


def _every_kind_of_host_read() -> None:
    x = torch.tensor([1.0, -2.0, 3.0])
    mask = x > 0
    float(x.sum())
    x.tolist()
    x.numpy()
    x.cpu()
    x.nonzero()
    x[mask]
    torch.equal(x, x)


def test_the_probe_finds_each_kind_of_host_read_at_its_place():
    """A probe that sees nothing passes every test above: here each kind is made on purpose."""
    with GraphSafetyProbe(package="tests") as probe:
        _every_kind_of_host_read()
    where = "tests/test_graph_safety.py:_every_kind_of_host_read"
    kinds = ["from-python", "item", "tolist", "numpy", "cpu", "nonzero", "bool-index", "equal"]
    assert probe.host_reads == [Site(kind, where) for kind in kinds]
    with GraphSafetyProbe() as probe:  # the library's probe: code outside icefall_lite is not recorded
        _every_kind_of_host_read()
        read_scalars([torch.ones(())])
    assert probe.host_reads == [Site("tolist", "icefall_lite/train/step_log.py:read_scalars")]
