"""Plain-text rendering shared by the CLI and the alignment reports."""

from __future__ import annotations

from typing import Sequence


def table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """A plain-text table of ``rows`` restricted to ``columns``."""
    widths = {c: max([len(c), *(len(str(r.get(c, ""))) for r in rows)]) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns), "  ".join("-" * widths[c] for c in columns)]
    lines += ["  ".join(str(r.get(c, "")).ljust(widths[c]) for c in columns) for r in rows]
    return "\n".join(lines)
