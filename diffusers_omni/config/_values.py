"""Rendering user-supplied values in error messages: short, and never failing on hostile input."""

from __future__ import annotations

import reprlib
from typing import Any

_REPR = reprlib.Repr()
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


def keys_text(keys: Any) -> str:
    """The keys of a mapping, sorted for stable messages even when they mix types (``'<'`` is not defined
    between ``str`` and ``int``)."""
    return "[" + ", ".join(sorted(show(key) for key in keys)) + "]"
