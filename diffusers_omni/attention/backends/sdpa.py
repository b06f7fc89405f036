"""PyTorch SDPA backends: ``TORCH_SDPA`` (PyTorch's dispatcher) and ``CUDNN_ATTN`` (cuDNN, pinned)."""

from __future__ import annotations

import logging
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import AttentionBackend

logger = logging.getLogger(__name__)


def _expand_key_padding_mask(attn_mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor):
    # Diffusers passes [batch, kv_len] padding masks; SDPA wants them broadcastable to [B, H, Sq, Skv].
    if (
        attn_mask is not None
        and attn_mask.ndim == 2
        and attn_mask.shape[0] == query.shape[0]
        and attn_mask.shape[1] == key.shape[1]
    ):
        return attn_mask[:, None, None, :]
    return attn_mask


def sdpa_bshd(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on ``[B, S, H, D]`` tensors, exactly as Diffusers' native backend."""
    attn_mask = _expand_key_padding_mask(attn_mask, query, key)
    query, key, value = (x.permute(0, 2, 1, 3) for x in (query, key, value))
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )
    return out.permute(0, 2, 1, 3)


class TorchSDPABackend(AttentionBackend):
    """PyTorch SDPA with PyTorch's own kernel choice: always available, the correctness reference."""

    name: ClassVar[str] = "TORCH_SDPA"
    devices = frozenset({"cuda", "cpu", "mps", "xpu", "npu"})
    supports_mask = True
    supports_gqa = True
    supports_backward = True
    # The math and flash kernels are deterministic in forward; PyTorch decides which one runs.
    deterministic = False

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return sdpa_bshd(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


_CUDNN_DTYPES = frozenset({torch.float16, torch.bfloat16})


class CudnnAttentionBackend(AttentionBackend):
    """SDPA pinned to cuDNN's fused attention.

    Unmasked calls go straight to ``aten._scaled_dot_product_cudnn_attention`` (no ``sdpa_kernel`` context
    manager on the hot path); masked calls use SDPA restricted to cuDNN. When cuDNN rejects a call, one warning
    is logged and that call and its like go to PyTorch's default dispatcher.
    """

    name: ClassVar[str] = "CUDNN_ATTN"
    devices = frozenset({"cuda"})
    dtypes = _CUDNN_DTYPES
    max_head_dim = 256
    head_dim_multiple = 8
    min_compute_capability = (8, 0)
    supports_mask = True
    supports_gqa = True
    supports_backward = True
    deterministic = False

    def __init__(self, spec=None) -> None:
        super().__init__(spec)
        self._rejected: set[tuple] = set()

    @classmethod
    def extra_availability_reasons(cls, platform) -> list[str]:
        if platform.device_type == "cuda" and platform.cudnn_version is None:
            return ["cuDNN is not available in this torch build; CUDNN_ATTN requires cuDNN"]
        return []

    def _fallback(self, signature: tuple, error: str, *args, **kwargs) -> torch.Tensor:
        if signature not in self._rejected:
            self._rejected.add(signature)
            logger.warning("CUDNN_ATTN: cuDNN rejected a call (%s); using PyTorch's default SDPA dispatcher", error)
        return sdpa_bshd(*args, **kwargs)

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        signature = (query.dtype, query.device.type, query.shape[-1], attn_mask is not None, enable_gqa)
        args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if signature in self._rejected:
            return sdpa_bshd(*args)
        if query.device.type != "cuda" or query.dtype not in _CUDNN_DTYPES:
            return self._fallback(signature, f"{query.device.type} {query.dtype}", *args)
        if attn_mask is not None or enable_gqa or dropout_p:
            try:
                with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.CUDNN_ATTENTION]):
                    return sdpa_bshd(*args)
            except RuntimeError as exc:
                return self._fallback(signature, str(exc).splitlines()[0], *args)
        q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
        needs_lse = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        try:
            out = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, needs_lse, 0.0, is_causal, False, scale=scale
            )[0]
        except RuntimeError as exc:
            return self._fallback(signature, str(exc).splitlines()[0], *args)
        return out.permute(0, 2, 1, 3)

    def describe(self) -> dict:
        return {"backend": self.name, "cudnn_version": torch.backends.cudnn.version()}
