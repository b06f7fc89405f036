"""Registered backend names whose implementations have not landed yet.

Each is selectable by name so that configs validate, and each says why it cannot run; the platform default
therefore never picks one.
"""

from __future__ import annotations

from .base import UnavailableBackend

_DENSE = "FlashAttention, FlashInfer and Hub kernel backends"
_QUANTIZED = "quantized and sparse attention backends"


class FlashInferBackend(UnavailableBackend):
    name = "FLASHINFER_ATTN"
    pending = _DENSE


class FlashAttentionHubBackend(UnavailableBackend):
    name = "FLASH_ATTN_HUB"
    pending = _DENSE


class FlashAttention3HubBackend(UnavailableBackend):
    name = "FLASH_ATTN_3_HUB"
    pending = _DENSE


class TrtllmBackend(UnavailableBackend):
    name = "TRTLLM_ATTN"
    pending = _QUANTIZED


class SageAttentionBackend(UnavailableBackend):
    name = "SAGE_ATTN"
    pending = _QUANTIZED


class SageAttention3Backend(UnavailableBackend):
    name = "SAGE_ATTN_3"
    pending = _QUANTIZED


class RainFusionBackend(UnavailableBackend):
    name = "RAINFUSION_ATTN"
    pending = _QUANTIZED
