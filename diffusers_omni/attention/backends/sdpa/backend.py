"""PyTorch SDPA backends: ``TORCH_SDPA`` (PyTorch's dispatcher) and ``CUDNN_ATTN`` (cuDNN, pinned)."""

from __future__ import annotations

import logging
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..base import AttentionBackend

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


# Deterministic mode on CUDA: PyTorch's dispatcher picks among these, in this order, never cuDNN. Flash and
# memory-efficient forwards have no atomics; their backwards switch to deterministic variants when
# ``torch.use_deterministic_algorithms(True)`` is on (flash: FA2's deterministic dQ accumulation; efficient: one
# key split). cuDNN attention is left out because PyTorch itself refuses it under deterministic algorithms
# (``check_cudnn_deterministic`` in sdp_utils.cpp). None of these kernels is chosen by ``requires_grad`` on sm_80+
# (except head_dim > 192 on sm_86/89), so a training-mode forward runs the same kernel as inference.
_DETERMINISTIC_CUDA_KERNELS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
_DETERMINISTIC_DEVICES = frozenset({"cpu", "cuda"})


def _needs_grad(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)


class SDPAFallback:
    """For kernels that leave some calls to ``TORCH_SDPA`` (a dtype or feature they lack): ``_fallback`` runs the
    call there and warns once per kind of call (``signature``)."""

    name: ClassVar[str]

    def _fallback(self, signature: tuple, why: str, args: tuple) -> torch.Tensor:
        warned = self.__dict__.setdefault("_warned", set())
        if signature not in warned:
            warned.add(signature)
            logging.getLogger(type(self).__module__).warning(
                "%s: %s; this call and its like run on TORCH_SDPA", self.name, why
            )
        return sdpa_bshd(*args)


class TorchSDPABackend(AttentionBackend):
    """PyTorch SDPA with PyTorch's own kernel choice: always available, the correctness reference.

    Deterministic mode (``AttentionConfig(deterministic=True)``): on CPU the call is unchanged (PyTorch's CPU flash
    and math kernels reduce in a fixed order; reproducible at a fixed thread count). On CUDA the kernel set is
    pinned to flash → memory-efficient → math (no cuDNN), and a call that will need gradients raises unless
    ``torch.use_deterministic_algorithms(True)`` is on, because only then are those backwards deterministic.
    """

    name: ClassVar[str] = "TORCH_SDPA"
    devices = frozenset({"cuda", "cpu", "mps", "xpu", "npu"})
    supports_mask = True
    supports_gqa = True
    supports_backward = True
    deterministic = True

    _pinned: tuple | None = None

    @classmethod
    def determinism_reasons(cls, platform) -> list[str]:
        reasons = super().determinism_reasons(platform)  # subclasses may declare deterministic = False
        if not reasons and platform.device_type not in _DETERMINISTIC_DEVICES:
            reasons.append(
                f"platform device is {platform.device_type!r}; {cls.name} has a deterministic mode only on "
                f"{sorted(_DETERMINISTIC_DEVICES)}"
            )
        return reasons

    def enable_deterministic(self) -> None:
        super().enable_deterministic()
        from torch.nn.attention import SDPBackend

        self._pinned = tuple(getattr(SDPBackend, k) for k in _DETERMINISTIC_CUDA_KERNELS)

    def _deterministic_cuda(self, args) -> torch.Tensor:
        query, key, value = args[:3]
        if _needs_grad(query, key, value) and not torch.are_deterministic_algorithms_enabled():
            raise RuntimeError(
                f"{self.name} deterministic mode: this CUDA attention call needs gradients, and PyTorch's flash and "
                "memory-efficient SDPA backwards are deterministic only under torch.use_deterministic_algorithms("
                "True) (set CUBLAS_WORKSPACE_CONFIG=:4096:8 as well); call it before training, or turn deterministic "
                "mode off"
            )
        with torch.nn.attention.sdpa_kernel(list(self._pinned)):
            return sdpa_bshd(*args)

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if self._pinned is not None and query.device.type == "cuda":
            return self._deterministic_cuda((query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa))
        return sdpa_bshd(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    def describe(self) -> dict:
        return {
            **super().describe(),
            "implementation": "torch.nn.functional.scaled_dot_product_attention",
            "version": torch.__version__,
            "cuda_kernels": list(_DETERMINISTIC_CUDA_KERNELS) if self._pinned is not None else "dispatcher",
        }


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
    def determinism_reasons(cls, platform) -> list[str]:
        return [
            f"{cls.name} calls cuDNN fused attention, whose backward gives no run-to-run determinism guarantee "
            "(PyTorch's own SDPA dispatcher refuses cuDNN attention under torch.use_deterministic_algorithms(True)); "
            "use TORCH_SDPA, which pins deterministic kernels in this mode"
        ]

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
        return {
            **super().describe(),
            "implementation": "torch.ops.aten._scaled_dot_product_cudnn_attention",
            "version": torch.__version__,
            "cudnn_version": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        }
