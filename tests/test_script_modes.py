"""A fresh clone runs the README's commands as written (``./lstm_transducer_stateless/train.py``): every tracked
file that starts with a ``#!`` line is executable in git's index, which is the mode a clone gets."""

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _starts_with_shebang(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"#!"


def test_every_tracked_script_with_a_shebang_is_executable_in_git():
    listed = subprocess.run(["git", "ls-files", "-s"], cwd=REPO, capture_output=True, text=True, check=True)
    modes = {}
    for line in listed.stdout.splitlines():
        meta, path = line.split("\t", 1)
        modes[path] = meta.split()[0]
    scripts = [p for p, mode in modes.items() if mode in ("100644", "100755") and _starts_with_shebang(REPO / p)]
    assert "egs/librispeech/ASR/lstm_transducer_stateless/train.py" in scripts
    not_executable = [p for p in scripts if modes[p] != "100755"]
    assert not not_executable, f"run `git update-index --chmod=+x` on: {not_executable}"
