"""Markdown tables as the ablation's report writes them: every row exactly as wide as its header (a row of
another width is a ValueError naming the table, not a misaligned table), pipes inside cells escaped."""

from __future__ import annotations

from typing import Optional, Sequence


def escape_cell(text: str) -> str:
    """A cell's text with its pipes escaped (GitHub splits a row on every unescaped ``|``) and no newline."""
    return str(text).replace("\\|", "|").replace("|", "\\|").replace("\n", " ")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: Optional[str] = None) -> str:
    """``header`` and ``rows`` as a Markdown table; ``align``: one of ``l``/``r`` per column (default: all left).

    Raises:
      ValueError: a row (or ``align``) whose width is not the header's, naming the table by its header.
    """
    width = len(header)
    align = align or "l" * width
    if len(align) != width:
        raise ValueError(f"table '{' | '.join(header)}': {len(align)} alignments for {width} columns")
    for i, row in enumerate(rows, 1):
        if len(row) != width:
            raise ValueError(
                f"table '{' | '.join(header)}': row {i} has {len(row)} cells, its header {width}: {list(row)}"
            )
    lines = ["| " + " | ".join(escape_cell(h) for h in header) + " |"]
    lines.append("|" + "|".join("---:" if a == "r" else "---" for a in align) + "|")
    lines += ["| " + " | ".join(escape_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
