"""The contract every attention backend implements.

A backend class declares what it can run as class attributes and answers ``not_supported_reasons(call,
platform)``: an empty list means it can run the call; each reason states the value found and the value
required. An instance is bound to one ``AttentionSpec`` (or ``None`` for a platform default) and is called with
``[batch, seq, heads, head_dim]`` tensors, the layout Diffusers' processors use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ..availability import package_importable, package_reason

if TYPE_CHECKING:
    from ...config.attention import AttentionSpec
    from ..platform import Platform


@dataclass(frozen=True)
class AttentionCall:
    """What is known about an attention call site when its backend is chosen."""

    device_type: str
    dtype: torch.dtype | None = None
    head_dim: int | None = None
    has_mask: bool = False
    gqa: bool = False
    mask_free_path: bool = False
    # Deterministic mode was requested (AttentionConfig.deterministic or DIFFUSERS_OMNI_DETERMINISTIC).
    deterministic: bool = False

    def describe(self) -> str:
        dtype = str(self.dtype).replace("torch.", "") if self.dtype is not None else "any dtype"
        parts = [self.device_type, dtype, f"head_dim={self.head_dim}"]
        if self.has_mask:
            parts.append("masked")
        if self.gqa:
            parts.append("GQA")
        if self.deterministic:
            parts.append("deterministic")
        return ", ".join(parts)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class AttentionBackend:
    """Base class: capabilities as data, reasons as lists of strings, a thin ``__call__``."""

    name: ClassVar[str] = ""
    devices: ClassVar[frozenset[str]] = frozenset({"cuda"})
    dtypes: ClassVar[frozenset[torch.dtype] | None] = None
    max_head_dim: ClassVar[int | None] = None
    head_dim_multiple: ClassVar[int | None] = None
    min_compute_capability: ClassVar[tuple[int, int] | None] = None
    compute_capabilities: ClassVar[frozenset[tuple[int, int]] | None] = None
    supports_mask: ClassVar[bool] = False
    # Quantised or sparse kernels: benchmarks never hold exact kernels to their speed.
    lossy: ClassVar[bool] = False
    supports_gqa: ClassVar[bool] = True
    supports_backward: ClassVar[bool] = True
    # True when the backend has a deterministic mode: under AttentionConfig(deterministic=True) its forward and
    # backward are bitwise reproducible run to run on the same inputs, device and software stack.
    # ``determinism_reasons`` says why not otherwise (or why not on a given platform).
    deterministic: ClassVar[bool] = False
    # (import name, install hint) pairs: each package must be installed and import (``attention.availability``:
    # imported once per process at selection time; in a child interpreter by ``diffusers-omni info``).
    packages: ClassVar[tuple[tuple[str, str], ...]] = ()

    # Set by ``enable_deterministic`` at enable time, never on the hot path.
    deterministic_mode: bool = False

    def __init__(self, spec: "AttentionSpec | None" = None) -> None:
        self.spec = spec

    @classmethod
    def is_lossy(cls, spec: "AttentionSpec | None") -> bool:
        """Whether this backend under ``spec`` approximates attention (quantised or sparse kernels): reports and
        ``explain`` flag such roles, and nothing lossy is ever a platform default."""
        return cls.lossy

    @classmethod
    def determinism_reasons(cls, platform: "Platform") -> list[str]:
        """Why this backend cannot promise bitwise run-to-run reproducibility on ``platform`` (empty: it can)."""
        if cls.deterministic:
            return []
        return [f"{cls.name} declares no deterministic mode (deterministic=False); its kernels may differ run to run"]

    def enable_deterministic(self) -> None:
        """Switch this instance to its deterministic kernel choice (called once, at enable time)."""
        self.deterministic_mode = True

    @classmethod
    def availability_reasons(cls, platform: "Platform") -> list[str]:
        """Reasons independent of any call: platform device, compute capability, packages."""
        reasons = []
        if platform.device_type not in cls.devices:
            reasons.append(
                f"platform device is {platform.device_type!r}; {cls.name} requires one of {sorted(cls.devices)}"
            )
        cc = platform.compute_capability
        if platform.device_type == "cuda" and cc is not None:
            if cls.min_compute_capability is not None and cc < cls.min_compute_capability:
                reasons.append(
                    f"compute capability is {platform.sm}; {cls.name} requires sm_"
                    f"{cls.min_compute_capability[0]}{cls.min_compute_capability[1]} or newer"
                )
            if cls.compute_capabilities is not None and cc not in cls.compute_capabilities:
                allowed = ", ".join(f"sm_{a}{b}" for a, b in sorted(cls.compute_capabilities))
                reasons.append(f"compute capability is {platform.sm}; {cls.name} requires one of {allowed}")
        for module, hint in cls.packages:
            if not package_importable(module):  # installed and imports (imported once per process)
                reasons.append(package_reason(module, hint) or f"package {module!r} is not importable; to install: {hint}")
        reasons.extend(cls.extra_availability_reasons(platform))
        return reasons

    @classmethod
    def extra_availability_reasons(cls, platform: "Platform") -> list[str]:
        return []

    @classmethod
    def not_supported_reasons(cls, call: AttentionCall, platform: "Platform") -> list[str]:
        reasons = cls.availability_reasons(platform)
        if call.device_type not in cls.devices and call.device_type != platform.device_type:
            reasons.append(f"device is {call.device_type!r}; {cls.name} requires one of {sorted(cls.devices)}")
        if cls.dtypes is not None and call.dtype is not None and call.dtype not in cls.dtypes:
            allowed = ", ".join(sorted(_dtype_name(d) for d in cls.dtypes))
            reasons.append(f"dtype is {_dtype_name(call.dtype)}; {cls.name} requires one of {allowed}")
        if call.head_dim is not None:
            if cls.max_head_dim is not None and call.head_dim > cls.max_head_dim:
                reasons.append(f"head_dim is {call.head_dim}; {cls.name} requires head_dim <= {cls.max_head_dim}")
            if cls.head_dim_multiple is not None and call.head_dim % cls.head_dim_multiple:
                reasons.append(
                    f"head_dim is {call.head_dim}; {cls.name} requires a multiple of {cls.head_dim_multiple}"
                )
        if call.has_mask and not cls.supports_mask:
            reasons.append(f"the call passes an attention mask; {cls.name} accepts no mask")
        if call.gqa and not cls.supports_gqa:
            reasons.append(f"the call uses grouped-query attention; {cls.name} requires equal Q and KV heads")
        if call.deterministic:
            reasons.extend(f"deterministic mode is requested; {r}" for r in cls.determinism_reasons(platform))
        reasons.extend(cls.extra_call_reasons(call, platform))
        return reasons

    @classmethod
    def extra_call_reasons(cls, call: AttentionCall, platform: "Platform") -> list[str]:
        return []

    def describe(self) -> dict:
        """Identity of the kernel this instance runs, for reports and kernel fingerprints.

        Keys every backend fills: ``backend``, ``implementation`` (what is called), ``version`` (of the package
        providing it), ``kernel_repo`` and ``kernel_revision`` (hub kernels; ``None`` otherwise) and
        ``deterministic`` (whether deterministic mode is on). Subclasses extend the dict.
        """
        return {
            "backend": self.name,
            "implementation": f"{type(self).__module__}.{type(self).__qualname__}",
            "version": None,
            "kernel_repo": None,
            "kernel_revision": None,
            "deterministic": self.deterministic_mode,
        }

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
        raise NotImplementedError


def key_padding_mask(attn_mask: torch.Tensor, batch: int, kv_len: int) -> torch.Tensor | None:
    """``attn_mask`` as a ``[B, Skv]`` boolean key-padding mask, or ``None`` when it is any other kind of mask."""
    if attn_mask.dtype != torch.bool:
        return None
    if attn_mask.ndim == 2 and tuple(attn_mask.shape) == (batch, kv_len):
        return attn_mask
    if attn_mask.ndim == 4 and tuple(attn_mask.shape) == (batch, 1, 1, kv_len):
        return attn_mask[:, 0, 0, :]
    return None
