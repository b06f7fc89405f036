"""FlashAttention: implementation discovery now; the kernel wrapper lands with the dense-backend issue."""

from __future__ import annotations

from typing import ClassVar

from .base import UnavailableBackend, package_importable

# Preference order: FlashAttention-4 (CuTe DSL), FlashAttention-3, FlashAttention-2.
_IMPLEMENTATIONS = (
    ("FA4", "flash_attn.cute"),
    ("FA3", "flash_attn_interface"),
    ("FA2", "flash_attn"),
)


def flash_attention_implementations() -> list[str]:
    """FlashAttention implementations importable here, best first (``["FA3", "FA2"]``…), without importing them."""
    found = []
    for label, module in _IMPLEMENTATIONS:
        if package_importable(module):
            found.append(label)
    return found


class FlashAttentionBackend(UnavailableBackend):
    name: ClassVar[str] = "FLASH_ATTN"
    pending = "FlashAttention, FlashInfer and Hub kernel backends"
