"""Terminal tables: aligned columns like `kubectl get`, plus CSV for the same rows.

Cells are plain strings; numbers are right-aligned so digits line up. No colours and no box
drawing, so the output pastes cleanly into tickets and greps well.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

_NUMBER = re.compile(r"^[-+]?[0-9][0-9,]*(\.[0-9]+)?%?$")
GAP = "   "  # kubectl uses three spaces between columns


@dataclass(frozen=True)
class Table:
    """Column headers and rows of cells (each row as long as the header)."""

    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for number, row in enumerate(self.rows, start=1):
            if len(row) != len(self.headers):
                raise ValueError(f"row {number} has {len(row)} cells, the table has "
                                 f"{len(self.headers)} columns")


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> Table:
    """A Table from any cell values (None becomes '-', everything else str())."""
    return Table(tuple(h.upper() for h in headers),
                 tuple(tuple(cell_text(c) for c in row) for row in rows))


def cell_text(value: object) -> str:
    """None is shown as '-' (unknown); an empty string stays blank (same as the row above)."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _numeric_column(cells: Sequence[str]) -> bool:
    values = [c for c in cells if c not in ("-", "")]
    return bool(values) and all(_NUMBER.match(c) for c in values)


def render(t: Table) -> str:
    """The table as aligned text, one line per row, header first; no trailing spaces."""
    columns = list(zip(t.headers, *t.rows, strict=True))
    widths = [max(len(c) for c in col) for col in columns]
    right = [_numeric_column(col[1:]) for col in columns]
    lines = []
    for row in (t.headers, *t.rows):
        cells = [cell.rjust(w) if r else cell.ljust(w)
                 for cell, w, r in zip(row, widths, right, strict=True)]
        lines.append(GAP.join(cells).rstrip())
    return "\n".join(lines)


def render_csv(t: Table) -> str:
    """The same rows as CSV (header row first; '-' cells become empty)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([h.lower() for h in t.headers])
    for row in t.rows:
        writer.writerow(["" if c == "-" else c for c in row])
    return out.getvalue()
