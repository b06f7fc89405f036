"""Plain-text rendering shared by the CLI and the alignment reports, fitted to the terminal.

On a terminal, output fits its width (``COLUMNS`` when set, as ``shutil.get_terminal_size`` reads it): table
cells wrap inside their columns and long lines wrap under their own indent. Piped to a file or another program,
nothing is wrapped: lines stay whole, as long as they need to be.
"""

from __future__ import annotations

import io
import shutil
import sys
import textwrap
from typing import Literal, Sequence, TextIO, Union

# Narrower terminals still get lines this long: below it a table column cannot hold a backend name.
MIN_WIDTH = 40
# Continuation lines of a wrapped line are indented this much more than the line itself.
HANG = "  "
# ``width`` of ``table`` and ``fit``: a number of columns, ``None`` (no limit) or "terminal" (``output_width()``).
Width = Union[int, None, Literal["terminal"]]


def output_width(stream: TextIO | None = None) -> int | None:
    """Columns output to ``stream`` (default ``sys.stdout``) must fit: the terminal's width when it is a terminal
    (``COLUMNS`` wins when set; at least ``MIN_WIDTH``), ``None`` (no limit) when it is not."""
    stream = sys.stdout if stream is None else stream
    try:
        interactive = stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        interactive = False
    if not interactive:
        return None
    return max(shutil.get_terminal_size().columns, MIN_WIDTH)


# Spaces between two columns (rich's padding of one on each side, collapsed).
GAP = 2


def _column_widths(cells: Sequence[Sequence[str]], width: int, keep: Sequence[int] = (0,)) -> list[int] | None:
    """Widths for columns of ``cells`` (header first) within ``width``: ``None`` when every column fits whole or when
    even the squeezed columns below cannot fit. Where the longest words fit, each column gets its longest word and
    the room left is shared in proportion to what each still needs, so that no word is split. Where they do not, the
    columns of ``keep`` (indices; the first column, which names the row) keep their longest word and the others are
    narrowed, the widest first, down to a common width (their words are then broken after a separator:
    ``_break_words``)."""
    longest = [max((len(line) for text in column for line in text.split("\n")), default=0) for column in cells]
    shortest = [max((len(word) for text in column for word in text.split()), default=0) for column in cells]
    room = width - GAP * (len(cells) - 1)
    if sum(longest) <= room:
        return None
    if sum(shortest) > room:
        return _squeezed(shortest, room, keep)
    spare, needs = room - sum(shortest), [high - low for high, low in zip(longest, shortest)]
    widths = [low + spare * need // sum(needs) for low, need in zip(shortest, needs)]
    for index in sorted(range(len(cells)), key=lambda i: widths[i] - longest[i])[: room - sum(widths)]:
        widths[index] += 1  # what the rounding down left over, to the columns furthest from whole
    return widths


# Narrowest a squeezed column may get; below it rich folds every word as it likes.
_MIN_SQUEEZED = 4
# Characters a word too long for its column is broken after (names such as "transformer.blocks.0.attn").
_SEPARATORS = "._/-=,:['"


def _squeezed(shortest: list[int], room: int, keep: Sequence[int]) -> list[int] | None:
    others = [i for i in range(len(shortest)) if i not in keep]
    left = room - sum(shortest[i] for i in range(len(shortest)) if i in keep)
    cap = max((shortest[i] for i in others), default=0)
    while cap >= _MIN_SQUEEZED and sum(min(shortest[i], cap) for i in others) > left:
        cap -= 1
    if cap < _MIN_SQUEEZED:
        return None
    return [shortest[i] if i in keep else min(shortest[i], cap) for i in range(len(shortest))]


def _break_words(text: str, width: int) -> str:
    """``text`` with every word longer than ``width`` broken into lines, each after the last separator that fits
    (``_SEPARATORS``), mid-word only where a piece has none."""
    lines = []
    for line in text.split("\n"):
        words = []
        for word in line.split(" "):
            pieces = []
            while len(word) > width:
                cut = max(word.rfind(sep, 0, width) for sep in _SEPARATORS) + 1
                cut = cut if cut > 0 else width
                pieces.append(word[:cut])
                word = word[cut:]
            words.append("\n".join([*pieces, word]))
        lines.append(" ".join(words))
    return "\n".join(lines)


def table(rows: Sequence[dict], columns: Sequence[str], *, width: Width = "terminal", row_gap: bool = False,
          keep: Sequence[str] = ()) -> str:
    """``rows`` restricted to ``columns`` as a plain-text table (rendered by ``rich``, no colour codes).

    ``width``: the most columns a line may take; ``None``: no limit, each column as wide as its widest cell;
    ``"terminal"`` (default): ``output_width()``, the terminal's width or no limit when not on a terminal. Cells
    that do not fit wrap inside their column at spaces; where the longest words of all columns together do not fit,
    the first column and those named in ``keep`` (names such as roles and backends) stay whole and the other
    columns' long words are broken after a separator (``.``, ``_``, ``/`` ...). ``row_gap``: a blank line between
    rows (for cells of several lines).
    """
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    cells = [[str(column)] + [str(row.get(column, "")) for row in rows] for column in columns]
    width = output_width() if width == "terminal" else width
    kept = [0] + [index for index, column in enumerate(columns) if column in keep]
    widths = _column_widths(cells, width, kept) if width is not None else None
    if widths is not None:
        cells = [[_break_words(text, size) for text in column] for column, size in zip(cells, widths)]
    grid = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True, show_lines=row_gap)
    for index in range(len(columns)):
        grid.add_column(cells[index][0], overflow="fold", width=widths[index] if widths else None)
    for row in zip(*(column[1:] for column in cells)):
        # Text, not markup: a cell such as "per_role['cross']" is printed as it is.
        grid.add_row(*(Text(value) for value in row))
    if width is None:
        width = Console(file=io.StringIO(), width=1_000_000).measure(grid).maximum
    buffer = io.StringIO()
    Console(file=buffer, width=width, no_color=True, force_terminal=False).print(grid)
    lines = [line.rstrip() for line in buffer.getvalue().splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def fit(text: str, width: Width = "terminal") -> str:
    """``text`` with each line longer than ``width`` (default ``"terminal"``: ``output_width()``; ``None``: no limit)
    wrapped at spaces; continuation lines keep the line's indent plus two spaces, so a ``- item`` continues under
    its text. A word longer than the width is broken."""
    width = output_width() if width == "terminal" else width
    if width is None:
        return text
    lines = []
    for line in text.split("\n"):
        if len(line) <= width:
            lines.append(line)
            continue
        indent = line[: min(len(line) - len(line.lstrip()), width // 2)]
        hang = indent + HANG if len(indent) + len(HANG) < width // 2 else indent
        lines.extend(textwrap.wrap(line.strip(), width=width, initial_indent=indent, subsequent_indent=hang,
                                   break_long_words=True, break_on_hyphens=False) or [""])
    return "\n".join(lines)
