"""Plain-text rendering shared by the CLI and the alignment reports."""

from __future__ import annotations

import io
from typing import Sequence


def table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """``rows`` restricted to ``columns`` as a plain-text table (rendered by ``rich``, no colour codes)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    grid = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for column in columns:
        grid.add_column(column, overflow="fold")
    for row in rows:
        grid.add_row(*(str(row.get(c, "")) for c in columns))
    buffer = io.StringIO()
    Console(file=buffer, width=200, no_color=True, force_terminal=False).print(grid)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines() if line.strip())
