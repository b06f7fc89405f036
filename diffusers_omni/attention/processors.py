"""Pieces shared by every omni attention processor.

A processor replaces a Diffusers processor on one attention module. It keeps the original (restored by
``remove_attention``) and holds one ``RoleAttention`` per attention call it makes, each bound to the backend
resolved for that role. The per-architecture processors live with their model declarations in
``diffusers_omni.models``; they mirror Diffusers' operation order exactly so that ``TORCH_SDPA`` output is
bitwise equal to stock Diffusers.
"""

from __future__ import annotations

from typing import Any

import torch

from .backends.base import AttentionBackend
from .selector import Resolution


class RoleAttention:
    """Attention for one role: a resolved backend, called with ``[B, S, H, D]`` tensors."""

    __slots__ = ("resolution", "backend")

    def __init__(self, resolution: Resolution, backend: AttentionBackend) -> None:
        self.resolution = resolution
        self.backend = backend

    @property
    def role(self) -> str:
        return self.resolution.role

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        return self.backend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    def __repr__(self) -> str:
        return f"RoleAttention(role={self.role!r}, backend={self.resolution.backend})"


class OmniAttnProcessor:
    """Base class: marks a processor as ours and keeps the one it replaced."""

    def __init__(self, original: Any, attend: dict[str, RoleAttention]) -> None:
        self.original = original
        self.attend = attend

    def __repr__(self) -> str:
        roles = ", ".join(f"{role}={ra.resolution.backend}" for role, ra in self.attend.items())
        return f"{type(self).__name__}({roles})"


def is_omni_processor(processor: Any) -> bool:
    return isinstance(processor, OmniAttnProcessor)
