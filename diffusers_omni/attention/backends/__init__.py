"""Attention backends, one package per kernel family (``<family>/__init__.py`` declares it: ``FAMILY``), plus what
every family shares: the backend contract (``base.py``) and the family descriptor (``family.py``).

Backends are looked up through ``diffusers_omni.attention.registry``; importing this package loads no backend and
not even torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import AttentionBackend as AttentionBackend
    from .base import AttentionCall as AttentionCall


def __getattr__(name: str):
    if name in ("AttentionBackend", "AttentionCall"):
        return getattr(importlib.import_module(f"{__name__}.base"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
