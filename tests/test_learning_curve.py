"""The learning curve (studies/learning_speed/curve.py): training minutes from the checkpoints, the CSV of
curves, a run's curve from decoded epochs, and the committed curves re-rendered."""

from pathlib import Path

import pytest
import torch

from icefall_lite.train.checkpoint import save_checkpoint
from studies.learning_speed.curve import (
    HERE,
    epoch_training_minutes,
    main,
    plot_learning_curves,
    read_curve_csv,
    run_curve,
    wer_summary,
)


def test_epoch_training_minutes_and_curve_csv(tmp_path):
    model = torch.nn.Linear(2, 2)
    for epoch, seconds in ((1, 90.0), (2, 210.0)):
        save_checkpoint(tmp_path / f"epoch-{epoch}.pt", model, params={"train_seconds": seconds, "cur_epoch": epoch})
    assert epoch_training_minutes(tmp_path) == {1: 1.5, 2: 3.5}
    save_checkpoint(tmp_path / "epoch-3.pt", model, params={"cur_epoch": 3})
    with pytest.raises(KeyError, match="epoch-3.pt has no train_seconds"):
        epoch_training_minutes(tmp_path)
    csv = tmp_path / "curve.csv"
    csv.write_text("# a comment\nlabel,minutes,wer\nold,8.0,95.5\nold,16.0,71.2\nnew,5.0,30.0\n")
    curves = read_curve_csv(csv)
    assert curves == {"old": [(8.0, 95.5), (16.0, 71.2)], "new": [(5.0, 30.0)]}
    png = tmp_path / "curve.png"
    plot_learning_curves(curves, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    csv.write_text("label,minutes\nold,8.0\n")
    with pytest.raises(ValueError, match="header"):
        read_curve_csv(csv)


def test_a_runs_curve_takes_every_nth_epoch_and_the_last_from_their_wer_summaries(tmp_path):
    """Epochs 1-5 at 60 s each, decoded before (so decode.py is not run): every 2nd epoch and the last, 5."""
    model = torch.nn.Linear(2, 2)
    for epoch in range(1, 6):
        save_checkpoint(tmp_path / f"epoch-{epoch}.pt", model, params={"train_seconds": 60.0 * epoch})
        summary = wer_summary(tmp_path, epoch, "test-clean")
        summary.parent.mkdir(exist_ok=True)
        summary.write_text(f"settings\tWER\ngreedy_search\t{100 - 10 * epoch}\n")
    assert run_curve("run", tmp_path, "test-clean", [], every=2) == [(2.0, 80.0), (4.0, 60.0), (5.0, 50.0)]
    with pytest.raises(FileNotFoundError, match="no epoch"):
        run_curve("empty", tmp_path / "none", "test-clean", [])


def test_the_committed_curves_re_render_their_csv_byte_for_byte(tmp_path, isolated_logging):
    committed = HERE / "learning-curve.csv"
    png = tmp_path / "learning-curve.png"
    assert main(["--csv", str(committed), "--output", str(png)]) == 0
    assert png.with_suffix(".csv").read_bytes() == committed.read_bytes()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_learning_curve_refuses_a_label_its_csv_could_not_hold(tmp_path: Path, capsys, isolated_logging) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--run", f"10 h, 288 voices={tmp_path}", "--output", str(tmp_path / "curve.png")])
    assert exit_.value.code == 2 and "must not contain a comma" in capsys.readouterr().err
    assert not (tmp_path / "curve.png").exists() and not (tmp_path / "curve.csv").exists()
