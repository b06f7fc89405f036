"""Rendering user-supplied values in error messages: short, and never failing on hostile input."""

from __future__ import annotations

import reprlib
from typing import Any

class _Repr(reprlib.Repr):
    def repr_dict(self, x: dict, level: int) -> str:
        # reprlib sorts keys; keep the user's order, as repr() does.
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        items = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}" for k, v in list(x.items())[: self.maxdict]]
        return "{" + ", ".join(items) + (", ...}" if len(x) > self.maxdict else "}")


_REPR = _Repr()
_REPR.maxlevel = 3
_REPR.maxstring = 80
_REPR.maxother = 80
_REPR.maxlong = 40
_REPR.maxdict = _REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxfrozenset = 8


def show(value: Any) -> str:
    """``repr(value)`` for messages; long, deep or huge values are shortened instead of raising.

    ``repr`` itself fails on such input: an int over 4300 digits raises ``ValueError`` and ~1000 nested dicts raise
    ``RecursionError``, either of which would replace the error being reported.
    """
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        digits = value.bit_length() * 0.30103
        if digits > 40:
            return f"<int of about {digits:.0f} digits>"
        return repr(value)
    try:
        return _REPR.repr(value)
    except Exception:  # a user type whose __repr__ raises
        return f"<{type(value).__name__} object>"


def check_int_range(value: int, field_name: str, low: int, high: int, unit: str = "", why: str = "") -> int:
    """``value`` if ``low <= value <= high``; else ``ValueError`` naming the field, the value (abbreviated when
    huge, see ``show``) and the allowed range (``why`` explains the bound)."""
    if low <= value <= high:
        return value
    unit = f" {unit}" if unit else ""
    reason = f" ({why})" if why else ""
    raise ValueError(
        f"{field_name}={show(value)} is out of range; allowed: {low} to {high}{unit}{reason}"
    )


def keys_text(keys: Any) -> str:
    """The keys of a mapping, sorted for stable messages even when they mix types (``'<'`` is not defined
    between ``str`` and ``int``)."""
    return "[" + ", ".join(sorted(show(key) for key in keys)) + "]"
