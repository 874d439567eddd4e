"""Every Markdown table in the repository's committed *.md files has rows exactly as wide as its header.

GitHub splits a table row on every unescaped ``|`` (inside code spans too), so a cell that holds a
``|`` must write it as ``\\|``. Generated sections are checked like the rest (the ablation's report writes
its tables through studies.ablation.markdown, which refuses a row of another width).
"""

import re
import subprocess
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
_SEPARATOR = re.compile(r"^\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$")


def markdown_files() -> List[Path]:
    """The *.md files git tracks (outside a git checkout: every *.md outside hidden folders)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "*.md"], cwd=ROOT, capture_output=True, check=True, text=True
        ).stdout
        return sorted(ROOT / name for name in out.split("\0") if name)
    except (OSError, subprocess.CalledProcessError):
        found = ROOT.rglob("*.md")
        return sorted(p for p in found if not any(part.startswith(".") for part in p.relative_to(ROOT).parts))


def cell_count(row: str) -> int:
    """Cells of a table row: split on unescaped pipes, outer pipes dropped."""
    parts = re.split(r"(?<!\\)\|", row.strip())
    if parts and parts[0].strip() == "":
        parts = parts[1:]
    if parts and parts[-1].strip() == "":
        parts = parts[:-1]
    return len(parts)


def tables(text: str) -> Iterator[Tuple[int, List[Tuple[int, str]]]]:
    """(line number of the header, [(line number, row), ...]) for each table outside code fences."""
    lines = text.splitlines()
    fence = None
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped.startswith("```") or stripped.startswith("~~~"):
            marker = stripped[:3]
            fence = None if fence == marker else (marker if fence is None else fence)
            i += 1
            continue
        if fence is None and stripped.startswith("|") and i + 1 < len(lines) and _SEPARATOR.match(lines[i + 1].strip()):
            rows = [(i + 1, line), (i + 2, lines[i + 1])]
            j = i + 2
            while j < len(lines) and lines[j].strip().startswith("|"):
                rows.append((j + 1, lines[j]))
                j += 1
            yield i + 1, rows
            i = j
            continue
        i += 1


def test_cell_count_splits_on_unescaped_pipes_only():
    assert cell_count("| a | b |") == 2
    assert cell_count("| `x \\| y` | b |") == 2
    assert cell_count("| |x| | b |") == 4


def test_tables_skip_code_fences_but_not_generated_sections():
    fenced = "```\n| a | b |\n|---|---|\n| 1 |\n```\n"
    assert list(tables(fenced)) == []
    generated = "<!-- ablation:begin (x) -->\n| a |\n|---|\n| 1 | 2 |\n<!-- ablation:end -->\n"
    assert [n for n, _ in tables(fenced + generated)] == [7]
    assert [n for n, _ in tables("text\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")] == [3]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_table_rows_as_wide_as_header(path):
    bad = []
    for header_line, rows in tables(path.read_text(encoding="utf-8")):
        width = cell_count(rows[0][1])
        for number, row in rows[1:]:
            if cell_count(row) != width:
                bad.append(f"line {number}: {cell_count(row)} cells, header (line {header_line}) has {width}")
    assert not bad, f"{path.relative_to(ROOT)}:\n" + "\n".join(bad)
