"""train.py --log-sequence-gradients (icefall_lite/train/sequence_log.py): each step's cut ids in batch order
and each layer's per-sequence gradient RMS over the batch median, without changing the run."""

import json
import re
import subprocess
import zlib

import pytest
import torch

from conftest import train_command, train_env
from icefall_lite.nn.clip import GradientFilter
from icefall_lite.train.sequence_log import FILE, SequenceLog, log_path, read_sequence_log
from studies.tb_reader import read_scalars


def test_filter_ratio_is_each_sequences_rms_over_the_median():
    # (T=2, N=3, C=2) gradients whose per-sequence RMS is 1, 2 and 10 by construction: median 2.
    g = torch.zeros(2, 3, 2)
    g[:, 0, :] = 1.0
    g[:, 1, :] = 2.0
    g[0, 2, :], g[1, 2, :] = 10.0, -10.0
    f = GradientFilter(batch_dim=1, threshold=float("inf"))
    x = torch.zeros(2, 3, 2, requires_grad=True)
    (y,) = f(x)
    y.backward(g)
    torch.testing.assert_close(f.stats.ratio, torch.tensor([0.5, 1.0, 5.0]))
    torch.testing.assert_close(x.grad, g)  # observing: unchanged


def test_log_flushes_in_order_and_a_resumed_step_keeps_its_last_record(tmp_path):
    log = SequenceLog(log_path(tmp_path))
    log.add(1, ["a", "b"], [torch.tensor([1.0, 2.0]), torch.tensor([0.5, 30.123456])])
    log.add(2, ["c"], [torch.tensor([1.0]), torch.tensor([1.0])])
    assert not (tmp_path / FILE).exists(), "nothing written before a flush"
    log.flush()
    log.add(2, ["d"], [torch.tensor([7.0]), torch.tensor([8.0])])  # a resumed run repeats step 2
    log.flush()
    lines = (tmp_path / FILE).read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 1, "cuts": ["a", "b"], "ratio": [[1.0, 2.0], [0.5, 30.12]]}
    assert read_sequence_log(tmp_path / FILE) == {
        1: (["a", "b"], [[1.0, 2.0], [0.5, 30.12]]),
        2: (["d"], [[7.0], [8.0]]),
    }
    with pytest.raises(ValueError, match="layer 1 measured 1 sequences for 2 cuts"):
        log.add(3, ["a", "b"], [torch.tensor([1.0, 2.0]), torch.tensor([1.0])])
    assert log_path(tmp_path, rank=1, world_size=2).name == "sequence-gradients.rank1.jsonl"


def test_training_logs_every_steps_batch_and_its_ratios_without_changing_the_run(tiny_data, tmp_path):
    flags = ["--max-batches", "6", "--tensorboard", "true", "--grad-filter-threshold", "inf"]

    def train(name, *extra):
        cmd = train_command(tmp_path / name, *flags, *extra)
        proc = subprocess.run(cmd, cwd=tiny_data, capture_output=True, text=True, env=train_env())
        assert proc.returncode == 0, proc.stderr[-3000:]
        return re.search(r"Model checksum \(rank 0\): (\w+)", proc.stderr).group(1)

    assert train("logged", "--log-sequence-gradients", "true") == train("plain")
    assert not (tmp_path / "plain" / FILE).exists()
    records = read_sequence_log(tmp_path / "logged" / FILE)
    assert sorted(records) == list(range(1, 7))
    scalars = read_scalars(tmp_path / "logged" / "tensorboard")
    digests = dict(scalars["train/batch_digest"])
    for step, (cuts, ratios) in records.items():
        # The cut ids in batch order: the digest train.py logs of the batch (crc32 of the ids, 24 bits).
        assert zlib.crc32("\n".join(cuts).encode()) & 0xFFFFFF == digests[step]
        assert len(ratios) == 2 and all(len(r) == len(cuts) for r in ratios)
        for layer, r in enumerate(ratios):
            assert max(r) == pytest.approx(dict(scalars[f"grad_filter/layer{layer}/max_over_median"])[step], rel=1e-3)
            assert sorted(r)[(len(r) - 1) // 2] == pytest.approx(1.0, rel=1e-3), "the median sequence is 1"


def test_the_flag_needs_a_filter(tiny_data, tmp_path):
    cmd = train_command(tmp_path / "x", "--grad-filter-threshold", "0", "--log-sequence-gradients", "true")
    proc = subprocess.run(cmd, cwd=tiny_data, capture_output=True, text=True, env=train_env())
    assert proc.returncode == 2 and "--log-sequence-gradients reads the GradientFilter's measurements" in proc.stderr
