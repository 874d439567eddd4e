#!/usr/bin/env python3
"""Print the WER table (test sets x decoding methods) of an experiment dir, from
the newest ``<exp-dir>/<method>/wer-summary-<set>-*.txt`` of each pair, with
the paths of the files behind it.

  ./local/wer_table.py --exp-dir lstm_transducer_stateless/exp
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from icefall_lite.decoding.constants import DECODING_METHODS as METHODS
from icefall_lite.decoding.constants import TEST_SETS
from icefall_lite.decoding.metrics import load_wer_summary


def newest_summary(exp_dir: Path, method: str, test_set: str) -> Optional[Path]:
    files = sorted((exp_dir / method).glob(f"wer-summary-{test_set}-*.txt"), key=lambda p: p.stat().st_mtime)
    return files[-1] if files else None


def collect(exp_dir: Path) -> Tuple[Dict[Tuple[str, str], float], List[Path]]:
    """{(method, test set): best WER in its newest summary} and the files read."""
    table: Dict[Tuple[str, str], float] = {}
    files: List[Path] = []
    for method in METHODS:
        for test_set in TEST_SETS:
            path = newest_summary(exp_dir, method, test_set)
            if path is None:
                continue
            rows = load_wer_summary(path)
            if rows:
                table[(method, test_set)] = rows[0][1]
                files.append(path)
    return table, files


def format_table(table: Dict[Tuple[str, str], float]) -> str:
    width = max(len(m) for m in METHODS)
    lines = [f"{'decoding method':<{width}}  " + "  ".join(f"{s:>10}" for s in TEST_SETS)]
    for method in METHODS:
        cells = [f"{table[(method, s)]:>10.2f}" if (method, s) in table else f"{'-':>10}" for s in TEST_SETS]
        lines.append(f"{method:<{width}}  " + "  ".join(cells))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--exp-dir", type=Path, default=Path("lstm_transducer_stateless/exp"), help="Experiment dir.")
    args = parser.parse_args()
    table, files = collect(args.exp_dir)
    if not table:
        sys.exit(f"wer_table.py: no wer-summary files under {args.exp_dir}/<method>/; run decode.py first")
    print("WER (%)")
    print(format_table(table))
    print("\nFiles behind it (recogs-*/errs-* sit beside each):")
    for path in files:
        print(f"  {path}")


if __name__ == "__main__":
    main()
