"""A run's summary in two files: ``seed-<n>.json``, small and greppable (its key, WERs, decoding, wall and CPU
time, machine, commands: every field of :class:`~studies.ablation.records.RunResult` but the per-step series),
and ``seed-<n>.series.xz`` beside it, the per-step series (the scalars and the per-layer filter statistics)
packed and compressed. The JSON names its series file (``"series"``); a summary in the full form (the series
inline, as every summary was written before) has no such field and still reads as it did.

The series file is an xz stream: one line of JSON (the layout: per series, its name, its length, its steps
and how its values are stored), then the arrays, each little-endian with its bytes split into planes (every
value's first byte, then every second, ...: the planes of the slowly varying sign and exponent bytes compress
to almost nothing). Steps that run ``first, first + 1, ...`` are stored as ``first`` alone. Values are stored
as what the full form holds, exactly: ``i4`` integers (the batch digests), ``f4`` float32 read back to 7
significant digits (:func:`studies.tb_reader.seven_digits`: the full form's values are TensorBoard's float32
scalars at 7 digits, and the nearest float32 to such a value rounds back to it), or ``f8`` where a series has a
value ``f4`` would not give back. The writer checks every value read back before it keeps the file.
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import struct
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from icefall_lite.utils import write_text_atomic
from studies.ablation.records import EXACT_SCALARS, RunResult
from studies.runner import read_json
from studies.tb_reader import Series, seven_digits

SERIES_SUFFIX = ".series.xz"
_DTYPES = {"i4": "<i4", "f4": "<f4", "f8": "<f8"}


def series_path(summary: Path) -> Path:
    """The series file beside a run's summary: ``seed-42.json`` -> ``seed-42.series.xz``."""
    return summary.with_name(summary.stem + SERIES_SUFFIX)


def _same(a: Sequence[float], b: Sequence[float]) -> bool:
    """Equal value for value, bit for bit (nan equals nan; 0.0 is not -0.0)."""
    return len(a) == len(b) and all(struct.pack("<d", x) == struct.pack("<d", y) for x, y in zip(a, b))


def _read_back(array: np.ndarray, dtype: str) -> List[float]:
    values = array.astype(np.float64).tolist()
    return [seven_digits(v) for v in values] if dtype == "f4" else values


def _packed(values: Sequence[float], exact: bool) -> Tuple[str, np.ndarray]:
    """The smallest of the dtypes that gives ``values`` back exactly, and the array."""
    if exact and all(math.isfinite(v) and v == int(v) and abs(v) < 2**31 for v in values):
        return "i4", np.asarray(values, dtype="<i4")
    single = np.asarray(values, dtype="<f4")
    if _same(_read_back(single, "f4"), values):
        return "f4", single
    return "f8", np.asarray(values, dtype="<f8")


def _planes(array: np.ndarray) -> bytes:
    """The array's bytes, plane by plane: ``[n, itemsize]`` bytes transposed to ``[itemsize, n]``."""
    return array.view(np.uint8).reshape(-1, array.itemsize).T.tobytes()


def _unplanes(data: bytes, dtype: str, n: int) -> np.ndarray:
    size = np.dtype(dtype).itemsize
    return np.frombuffer(data, dtype=np.uint8).reshape(size, n).T.copy().view(dtype).reshape(n)


def pack_series(scalars: Dict[str, Series], filters: Dict[Tuple[int, str], Series]) -> bytes:
    """The series file's bytes (xz, deterministic) for a run's ``scalars`` and ``filters``."""
    layout: List[Dict] = []
    body: List[bytes] = []
    named = [({"scalar": k}, v) for k, v in scalars.items()]
    named += [({"layer": layer, "stat": stat}, v) for (layer, stat), v in filters.items()]
    for name, series in named:
        steps = [s for s, _ in series]
        values = [v for _, v in series]
        dtype, array = _packed(values, name.get("scalar") in EXACT_SCALARS)
        consecutive = bool(steps) and steps == list(range(steps[0], steps[0] + len(steps)))
        entry = {**name, "n": len(series), "dtype": dtype, "first": steps[0] if consecutive else None}
        layout.append(entry)
        if not consecutive:
            body.append(_planes(np.asarray(steps, dtype="<i4")))
        body.append(_planes(array))
    header = json.dumps({"format": 1, "series": layout}, separators=(",", ":")).encode() + b"\n"
    return lzma.compress(header + b"".join(body), preset=9)


def unpack_series(data: bytes) -> Tuple[Dict[str, Series], Dict[Tuple[int, str], Series]]:
    """``(scalars, filters)`` from a series file's bytes, as :meth:`RunResult.from_json` reads the full form."""
    raw = lzma.decompress(data)
    line_end = raw.index(b"\n")
    layout = json.loads(raw[:line_end])
    if layout.get("format") != 1:
        raise ValueError(f"series file of format {layout.get('format')!r}; this reader knows format 1")
    at = line_end + 1
    scalars: Dict[str, Series] = {}
    filters: Dict[Tuple[int, str], Series] = {}
    for entry in layout["series"]:
        n = int(entry["n"])
        if entry["first"] is None:
            steps = _unplanes(raw[at : at + 4 * n], "<i4", n).tolist()
            at += 4 * n
        else:
            steps = list(range(entry["first"], entry["first"] + n))
        dtype = _DTYPES[entry["dtype"]]
        size = np.dtype(dtype).itemsize * n
        values = _read_back(_unplanes(raw[at : at + size], dtype, n), entry["dtype"])
        at += size
        series = list(zip(steps, values))
        if "scalar" in entry:
            scalars[entry["scalar"]] = series
        else:
            filters[(int(entry["layer"]), entry["stat"])] = series
    if at != len(raw):
        raise ValueError(f"series file: {len(raw) - at} bytes after its last series")
    return scalars, filters


def write_run_summary(path: Path, result: RunResult) -> Path:
    """Write ``result`` as ``path`` (``seed-<n>.json``, without series) and its series file beside it; the
    series first, so that a summary (which marks the run done) never names a file not yet written. The series
    are kept as the full form keeps them (:meth:`RunResult.to_json`: TensorBoard's values to 7 significant
    digits, the digests exact), so that a run reads back the same in either form."""
    kept = RunResult.from_json(result.to_json())
    return _write_pair(path, result.to_json_without_series(), kept.scalars, kept.filters)


def _write_pair(path: Path, fields: Dict, scalars: Dict[str, Series], filters: Dict[Tuple[int, str], Series]) -> Path:
    packed = pack_series(scalars, filters)
    if not _same_series(unpack_series(packed), (scalars, filters)):
        raise ValueError(f"{path}: its series do not read back as written")
    series = series_path(path)
    series.parent.mkdir(parents=True, exist_ok=True)
    tmp = series.with_name(series.name + ".tmp")
    tmp.write_bytes(packed)
    tmp.replace(series)
    write_text_atomic(path, json.dumps({**fields, "series": series.name}, indent=1) + "\n")
    return path


def _same_series(a: Tuple[Dict, Dict], b: Tuple[Dict, Dict]) -> bool:
    """Two ``(scalars, filters)`` alike name for name, step for step and bit for bit (nan equal to nan)."""
    for mine, theirs in zip(a, b):
        if list(mine) != list(theirs):
            return False
        for name in mine:
            if [s for s, _ in mine[name]] != [s for s, _ in theirs[name]]:
                return False
            if not _same([v for _, v in mine[name]], [v for _, v in theirs[name]]):
                return False
    return True


def read_run_summary(path: Path) -> RunResult:
    """A run's summary in either form: the full one, or the one without series with its series file."""
    data = read_json(path)
    if data is None:
        raise FileNotFoundError(path)
    if "series" not in data:
        return RunResult.from_json(data)
    scalars, filters = unpack_series((path.parent / data["series"]).read_bytes())
    return RunResult.from_json(data, scalars, filters)


def compact_summary(path: Path) -> bool:
    """Rewrite a full-form run summary at ``path`` as the JSON without series and its series file (every other
    field kept as it was, in its order); check that it reads back as the same run. False when ``path`` is
    already compact."""
    data = read_json(path)
    if data is None:
        raise FileNotFoundError(path)
    if "series" in data:
        return False
    full = RunResult.from_json(data)
    fields = {k: v for k, v in data.items() if k not in ("scalars", "filters")}
    _write_pair(path, fields, full.scalars, full.filters)
    again = read_run_summary(path)
    same_fields = again.to_json_without_series() == full.to_json_without_series()
    if not (same_fields and _same_series((again.scalars, again.filters), (full.scalars, full.filters))):
        raise ValueError(f"{path}: the compact summary does not read back as the full one")
    return True


def compact_folder(folder: Path) -> List[Path]:
    """:func:`compact_summary` for every run summary (``seed-<n>.json``, not a replay's) under ``folder``; the
    ones rewritten."""
    done = []
    for path in sorted(folder.rglob("seed-*.json")):
        if path.stem[len("seed-") :].isdigit() and compact_summary(path):
            done.append(path)
    return done


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="Rewrite full-form run summaries as compact JSON + series file")
    parser.add_argument("folders", nargs="+", type=Path, help="summaries folders (searched recursively)")
    args = parser.parse_args(argv)
    for folder in args.folders:
        done = compact_folder(folder)
        print(f"{folder}: {len(done)} summaries compacted")


if __name__ == "__main__":
    main()
