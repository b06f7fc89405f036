"""The FlashAttention family: ``FLASH_ATTN`` runs FlashAttention-4, -3, -3 forward-only or -2, whichever is installed,
best first (``backend.py``), and FP8 e4m3 attention on Hopper FlashAttention-3 (``quant``; ``fp8_quant.py`` quantises
Q, K and V; ``backend.fp8_rule`` decides per call shape from the committed routing table).
"""

from __future__ import annotations

import importlib

from ..family import Alias, BackendFamily, Route, backend_module_getattr, choice

_FA = "FLASH_ATTN runs the best installed FlashAttention (FA4, FA3, FA3 forward-only, FA2); key-padding masks go through varlen"
# FLASH_ATTN FP8 (an extension of the contract, Hopper FA3): Q, K and V all in e4m3, one scale per (batch, head).
FP8_DTYPES = ("fp8_e4m3",)
FP8_BLOCKS = (1, 16)


def check_quant(backend: str, quant) -> None:
    """``quant`` with FLASH_ATTN: FP8 e4m3 for Q, K and V, one scale per (batch, head)."""
    for name in ("dtype_qk", "dtype_vo"):
        value = getattr(quant, name)
        if value is None:
            raise ValueError(f"quant.{name} is required with {backend}; allowed: {FP8_DTYPES}")
        choice("quant", name, value, FP8_DTYPES, f"with {backend}")
    if (quant.q_block_size, quant.k_block_size) != FP8_BLOCKS:
        raise ValueError(
            f"quant.q_block_size={quant.q_block_size!r}, quant.k_block_size={quant.k_block_size!r} are not "
            f"allowed with {backend} (one FP8 scale per batch and head); allowed: the defaults "
            f"q_block_size={FP8_BLOCKS[0]}, k_block_size={FP8_BLOCKS[1]}"
        )


def _flash_attn_3_or_4_importable(platform, call) -> bool:
    backend = importlib.import_module(f"{__name__}.backend")
    return any(impl in ("FA3", "FA4") for impl in backend.flash_attention_implementations())


FAMILY = BackendFamily(
    "flash",
    backends={"FLASH_ATTN": f"{__name__}.backend:FlashAttentionBackend"},
    aliases=tuple(Alias(name, "FLASH_ATTN", _FA) for name in ("flash", "flash_varlen", "_flash_3", "_flash_varlen_3")),
    options={"quant": check_quant},
    routes=(
        Route("FLASH_ATTN", platforms=("blackwell_datacenter", "blackwell_workstation"), priority=40),
        Route("FLASH_ATTN", when=("flash_attn_3_or_4_importable",), platforms=("ada", "ampere"), priority=40),
    ),
    conditions={"flash_attn_3_or_4_importable": _flash_attn_3_or_4_importable},
)


__getattr__ = backend_module_getattr(__name__)
