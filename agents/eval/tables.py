"""Plain-text tables, as the commands and benchmarks print their results."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["text_table"]


def text_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """``head`` and ``rows`` as aligned columns under a rule: the first column left-aligned, the rest right.

    Each column is as wide as its widest cell; columns are two spaces apart. Every row has as many
    cells as ``head``.
    """
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in [head, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
