"""Registered backend names whose implementations have not landed yet.

Each is selectable by name so that configs validate, and each says why it cannot run; the platform default
therefore never picks one.
"""

from __future__ import annotations

from .base import UnavailableBackend
