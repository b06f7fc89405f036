"""Registered backend names whose implementations have not landed yet.

Each is selectable by name so that configs validate, and each says why it cannot run; the platform default
therefore never picks one.
"""

from __future__ import annotations

from .base import UnavailableBackend

_QUANTIZED = "quantized and sparse attention backends"


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
