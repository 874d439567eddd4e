"""Small helpers shared by the data-preparation code.

* :func:`atomic_output`: write a file under a temporary name, rename on success,
  so an interrupted run never leaves a file that looks finished;
* :func:`parallel_imap`: an ordered, progress-barred map over worker processes;
* :func:`setup_logging`: icefall's timestamped log-line format;
* :func:`script_parser`, :func:`parse_script_args`: the recipe scripts' CLI
  plumbing (docstring as help, configuration logged);
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import os
import shutil
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Tuple, TypeVar, Union

from tqdm import tqdm

T = TypeVar("T")
R = TypeVar("R")

LOG_FORMAT = "%(asctime)s %(levelname)s [%(filename)s:%(lineno)d] %(message)s"


def setup_logging(level: int = logging.INFO) -> None:
    """Log to stderr in icefall's format: ``2026-01-01 12:00:00,000 INFO [f.py:12] msg``."""
    logging.basicConfig(format=LOG_FORMAT, level=level, force=True)


def script_parser(doc: Optional[str]) -> argparse.ArgumentParser:
    """An argument parser for a recipe script whose help text is its docstring."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_nj_argument(parser: argparse.ArgumentParser) -> None:
    """``--nj``: worker processes, default all cores."""
    parser.add_argument("--nj", type=int, default=default_num_jobs(), help="worker processes (default: all cores)")


def parse_script_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse the command line, set up icefall-style logging, log the full configuration."""
    args = parser.parse_args()
    setup_logging()
    logging.info(f"{parser.prog}: {vars(args)}")
    return args


def temp_name(path: Path) -> Path:
    """The temporary sibling of ``path``: ``dir/.tmp-<name>`` (same suffixes)."""
    return path.with_name(f".tmp-{path.name}")


@contextlib.contextmanager
def atomic_output(path: Union[str, Path]) -> Iterator[Path]:
    """Yield a temporary path to write ``path`` to; rename it into place on success.

    The temporary name keeps the suffixes (``.tmp-x.jsonl.gz``) so libraries
    that pick a format by suffix still work.  On error the temporary file or
    directory is removed and the destination is left untouched.
    """
    path = Path(path)
    tmp = temp_name(path)
    remove_path(tmp)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield tmp
    except BaseException:
        remove_path(tmp)
        raise
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    os.replace(tmp, path)


def remove_path(path: Path) -> None:
    """Delete a file, link or directory tree if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def write_text_atomic(path: Union[str, Path], text: str) -> None:
    """Write ``text`` to ``path`` through :func:`atomic_output`."""
    with atomic_output(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def section_markers(name: str, writer: str) -> Tuple[str, str]:
    """The HTML comments around a generated section of a Markdown file."""
    return f"<!-- {name}:begin (written by {writer}) -->", f"<!-- {name}:end -->"


def replace_marked_section(path: Union[str, Path], name: str, section: str, writer: str) -> None:
    """Put ``section`` between the ``name`` markers of the Markdown file ``path``.

    The section replaces what is between the markers, or is appended (to a
    new ``# Results`` file if ``path`` does not exist). Written atomically.
    """
    path = Path(path)
    begin, end = section_markers(name, writer)
    block = f"{begin}\n{section.rstrip()}\n{end}\n"
    text = path.read_text(encoding="utf-8") if path.is_file() else "# Results\n\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        text = head + block + ("\n" + tail if tail else "")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    write_text_atomic(path, text)


def parallel_imap(
    fn: Callable[[T], R],
    items: Iterable[T],
    num_jobs: int,
    desc: str,
    total: Optional[int] = None,
    initializer: Optional[Callable[..., None]] = None,
    initargs: tuple = (),
) -> Iterator[R]:
    """``map(fn, items)`` over ``num_jobs`` processes, in order, with a tqdm bar.

    ``num_jobs <= 1`` runs in this process (``initializer`` is called first).
    ``fn`` and ``initializer`` must be module-level functions (picklable).
    """
    items = list(items)
    total = len(items) if total is None else total
    if num_jobs <= 1:
        if initializer is not None:
            initializer(*initargs)
        yield from tqdm(map(fn, items), total=total, desc=desc)
        return
    ctx = multiprocessing.get_context("fork")
    chunksize = max(1, min(16, len(items) // (num_jobs * 8) or 1))
    with ctx.Pool(num_jobs, initializer=initializer, initargs=initargs) as pool:
        yield from tqdm(pool.imap(fn, items, chunksize=chunksize), total=total, desc=desc)


def default_num_jobs() -> int:
    """All the CPU cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        return os.cpu_count() or 1
