"""Shared fixtures. ``tiny_data``: the tiny synthetic corpus, prepared once per
test session by ``prepare.sh --size tiny``; tests treat it as read-only.
``isolated_logging``: undoes a script's ``setup_logger`` after an in-process ``main()``."""

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "egs" / "librispeech" / "ASR"


def recipe_env() -> dict:
    """Environment for recipe scripts: the venv's python first on PATH."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Work dir holding data/fbank, data/lang_bpe_100 (and download/) of the tiny corpus."""
    work = tmp_path_factory.mktemp("tiny_data")
    proc = subprocess.run(
        ["bash", str(RECIPE / "prepare.sh"), "--size", "tiny", "--work-dir", str(work)],
        capture_output=True,
        text=True,
        env=recipe_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return work


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
