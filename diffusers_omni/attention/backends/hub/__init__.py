"""The Hugging Face Hub family: ``FLASH_ATTN_HUB`` and ``FLASH_ATTN_3_HUB``, FlashAttention kernels loaded through
``kernels`` so that training and rollout run the identical kernel (``backend.py``). Chosen explicitly only.
"""

from __future__ import annotations

from ..family import Alias, BackendFamily, backend_module_getattr

_FA2 = "kernels-community/flash-attn2 through `kernels`"
_FA3 = "kernels-community/flash-attn3 through `kernels`"

FAMILY = BackendFamily(
    "hub",
    backends={
        "FLASH_ATTN_HUB": f"{__name__}.backend:FlashAttentionHubBackend",
        "FLASH_ATTN_3_HUB": f"{__name__}.backend:FlashAttention3HubBackend",
    },
    aliases=(
        Alias("flash_hub", "FLASH_ATTN_HUB", _FA2),
        Alias("flash_varlen_hub", "FLASH_ATTN_HUB", _FA2),
        Alias("_flash_3_hub", "FLASH_ATTN_3_HUB", _FA3),
        Alias("_flash_3_varlen_hub", "FLASH_ATTN_3_HUB", _FA3),
    ),
)


__getattr__ = backend_module_getattr(__name__)
