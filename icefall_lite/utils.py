"""Helpers shared by the whole library and the recipe scripts (icefall's ``icefall/utils.py``).

* :class:`AttributeDict`, :class:`MetricsTracker`, :func:`setup_logger`, :func:`str2bool`:
  icefall's training helpers;
* :func:`atomic_output`, :func:`write_text_atomic`, :func:`atomic_write`: write a file under
  the temporary name :func:`temp_name` (``.tmp-<name>``), rename on success, so an interrupted
  run never leaves a file that looks finished (the one temporary-file scheme of the library);
* :func:`progress_bar`: every tqdm bar: a live bar on a terminal, one refresh a minute in a log file;
* :func:`replace_marked_section`: rewrite one generated section of a Markdown file;
* :func:`parallel_imap`: an ordered, progress-barred map over worker processes;
* :func:`setup_logging`, :func:`script_parser`, :func:`parse_script_args`, :func:`check_positive`:
  the recipe scripts' logging and CLI plumbing (docstring as help, configuration logged).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import os
import shutil
import sys
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, TextIO, Tuple, TypeVar, Union

import torch
from tqdm import tqdm


class AttributeDict(dict):
    """A dict whose keys are also attributes (icefall's params object)."""

    def __getattr__(self, key):
        if key in self:
            return self[key]
        raise AttributeError(f"No such attribute '{key}'")

    def __setattr__(self, key, value):
        self[key] = value

    def __delattr__(self, key):
        if key in self:
            del self[key]
            return
        raise AttributeError(f"No such attribute '{key}'")

    def __str__(self) -> str:
        return "\n".join(f"  {k}: {v}" for k, v in self.items())


def str2bool(value: Union[str, bool]) -> bool:
    """argparse type for true/false flags (``--use-fp16 true``)."""
    if isinstance(value, bool):
        return value
    lowered = value.lower()
    if lowered in ("yes", "true", "t", "y", "1"):
        return True
    if lowered in ("no", "false", "f", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {value!r}")


class MetricsTracker(defaultdict):
    """Sums of loss terms and counts (``frames``, ``utterances``) that add and decay.

    Keys ending in ``loss`` are reported per frame.
    """

    def __init__(self) -> None:
        super().__init__(float)

    def __add__(self, other: "MetricsTracker") -> "MetricsTracker":
        out = MetricsTracker()
        for key in set(self) | set(other):
            out[key] = self.get(key, 0.0) + other.get(key, 0.0)
        return out

    def __mul__(self, alpha: float) -> "MetricsTracker":
        out = MetricsTracker()
        for key, value in self.items():
            out[key] = value * alpha
        return out

    def per_frame(self, key: str) -> float:
        frames = self.get("frames", 0.0)
        return self.get(key, 0.0) / frames if frames > 0 else float("nan")

    def per_frame_str(self) -> str:
        parts = [f"{k}={self.per_frame(k):.4g}" for k in sorted(self) if k.endswith("loss")]
        parts += [f"{k}={self[k]:.6g}" for k in sorted(self) if not k.endswith("loss")]
        return ", ".join(parts)

    def reduce(self, device: torch.device) -> None:
        """Sum over DDP ranks in place."""
        keys = sorted(self)
        values = torch.tensor([self[k] for k in keys], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(values)
        for k, v in zip(keys, values.tolist()):
            self[k] = v


def setup_logger(log_prefix: Union[str, Path], rank: int = 0, world_size: int = 1, level: int = logging.INFO) -> Path:
    """Log to ``<log_prefix>-<date>[-<rank>]`` and to the console (rank 0 only), icefall's format."""
    date = datetime.now().strftime("%Y-%m-%d-%H-%M-%S")
    log_file = Path(f"{log_prefix}-{date}" + (f"-{rank}" if world_size > 1 else ""))
    log_file.parent.mkdir(parents=True, exist_ok=True)
    fmt = (
        "%(asctime)s %(levelname)s [%(filename)s:%(lineno)d]"
        + (f" ({rank}/{world_size})" if world_size > 1 else "")
        + " %(message)s"
    )
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(level)
    file_handler = logging.FileHandler(log_file, mode="w")
    file_handler.setFormatter(logging.Formatter(fmt))
    root.addHandler(file_handler)
    if rank == 0:
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter(fmt))
        root.addHandler(console)
    return log_file


# --- atomic files, generated sections, worker pools, script plumbing ---------

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


def check_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, names: Sequence[str]) -> None:
    """``parser.error`` naming the first flag in ``names`` whose value is not > 0."""
    for name in names:
        value = getattr(args, name)
        if not value > 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")


def parse_script_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse the command line, set up icefall-style logging, log the full configuration."""
    args = parser.parse_args()
    setup_logging()
    logging.info(f"{parser.prog}: {vars(args)}")
    return args


@contextlib.contextmanager
def script_errors(prog: str, *errors: type) -> Iterator[None]:
    """For a script's ``main``: an expected error of ``errors`` (the library raises them with a message naming
    the file and the fix) is logged and ends the program with ``<prog>: error: <message>`` and exit status 1."""
    try:
        yield
    except errors as e:
        logging.error(str(e))
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(1)


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


@contextlib.contextmanager
def atomic_write(path: Union[str, Path]) -> Iterator[TextIO]:
    """Open a UTF-8 text file to write ``path`` through :func:`atomic_output`.

    The file is renamed into place when the block ends normally; on an
    exception it is removed and ``path`` is left as it was.
    """
    with atomic_output(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            yield f


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
    """``map(fn, items)`` over ``num_jobs`` processes, in order, with a :func:`progress_bar`.

    ``num_jobs <= 1`` runs in this process (``initializer`` is called first).
    ``fn`` and ``initializer`` must be module-level functions (picklable).
    """
    items = list(items)
    total = len(items) if total is None else total
    if num_jobs <= 1:
        if initializer is not None:
            initializer(*initargs)
        yield from progress_bar(map(fn, items), total=total, desc=desc)
        return
    ctx = multiprocessing.get_context("fork")
    chunksize = max(1, min(16, len(items) // (num_jobs * 8) or 1))
    with ctx.Pool(num_jobs, initializer=initializer, initargs=initargs) as pool:
        yield from progress_bar(pool.imap(fn, items, chunksize=chunksize), total=total, desc=desc)


def default_num_jobs() -> int:
    """All the CPU cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        return os.cpu_count() or 1


# --- progress bars ------------------------------------------------------------

# Seconds between two refreshes of a progress bar whose output is not a terminal.
LOG_REFRESH_SECONDS = 60.0


def progress_bar(iterable: Optional[Iterable[T]] = None, **tqdm_kwargs: Any) -> tqdm:
    """A tqdm bar over ``iterable`` (tqdm's keyword arguments) that keeps log files readable.

    On a terminal it is tqdm's live bar. When the bar's stream (``file``,
    default stderr) is a file or a pipe (``make demo > log``), the bar is
    redrawn at most every :data:`LOG_REFRESH_SECONDS` seconds instead of many
    times a second, so the log gets a line a minute rather than thousands of
    carriage-return updates. Callers that update the postfix should pass
    ``refresh=False`` to ``set_postfix`` so that it waits for the next redraw.
    """
    stream = tqdm_kwargs.get("file") or sys.stderr
    if not _is_terminal(stream):
        tqdm_kwargs.setdefault("mininterval", LOG_REFRESH_SECONDS)
        tqdm_kwargs.setdefault("maxinterval", LOG_REFRESH_SECONDS)
    return tqdm(iterable, **tqdm_kwargs)


def _is_terminal(stream: Any) -> bool:
    """Whether ``stream`` writes to a terminal (a closed or odd stream counts as not)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
