"""The per-step TensorBoard log kept on the device: every scalar is written at its own step in the order added,
with float32 values exactly as float() reads them, and written once."""

import torch

from icefall_lite.train.step_log import StepLog, read_scalars


class _Writer:
    def __init__(self) -> None:
        self.rows = []

    def add_scalar(self, tag, value, step) -> None:
        assert isinstance(value, float)
        self.rows.append((tag, value, step))


def test_flush_writes_each_scalar_at_its_step_in_order() -> None:
    writer = _Writer()
    log = StepLog(writer)
    log.add("a", torch.tensor(0.1, dtype=torch.float32), 1)
    log.add("b", 3, 1)
    log.add("a", torch.tensor(1.1, dtype=torch.float32), 2)
    log.add("c", torch.tensor(2.5, dtype=torch.float64), 2)
    assert writer.rows == []
    log.flush()
    assert writer.rows == [
        ("a", float(torch.tensor(0.1, dtype=torch.float32)), 1),
        ("b", 3.0, 1),
        ("a", float(torch.tensor(1.1, dtype=torch.float32)), 2),
        ("c", 2.5, 2),
    ]
    log.flush()
    assert len(writer.rows) == 4, "flushed scalars are written once"


def test_without_a_writer_nothing_is_kept() -> None:
    log = StepLog(None)
    log.add("a", torch.tensor(1.0), 1)
    assert log.pending == []
    log.flush()


def test_read_scalars_keeps_order_and_float32_values_exactly() -> None:
    values = [torch.tensor(1 / 3), 7, torch.tensor(float("nan")), 0.25, torch.tensor(2.0, dtype=torch.float64)]
    out = read_scalars(values)
    assert out[0] == float(torch.tensor(1 / 3)) and out[1] == 7.0 and out[3] == 0.25 and out[4] == 2.0
    assert out[2] != out[2]
