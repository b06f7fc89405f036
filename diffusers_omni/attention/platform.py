"""The platform we run on, and its default-routing tables as data.

A platform is detected once (device type, GPU name, compute capability, cuDNN version) and classified into a
family. Each family has an ordered list of candidate backends; a candidate may carry conditions, named by the
predicates in ``ROUTE_CONDITIONS``. The selector walks the list and takes the first candidate whose conditions
hold and which reports no ``not_supported_reasons`` for the call.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import torch

if TYPE_CHECKING:
    from .backends.base import AttentionCall

_FAMILY_LABELS = {
    "blackwell_datacenter": "Blackwell",
    "blackwell_workstation": "Blackwell",
    "hopper": "Hopper",
    "ada": "Ada",
    "ampere": "Ampere",
    "cuda": "CUDA",
    "cpu": "CPU",
    "mps": "MPS",
}


@dataclass(frozen=True)
class Platform:
    """What the attention selector needs to know about where attention runs."""

    device_type: str
    device_name: str = ""
    compute_capability: tuple[int, int] | None = None
    cudnn_version: int | None = None

    @property
    def family(self) -> str:
        if self.device_type != "cuda" or self.compute_capability is None:
            return self.device_type if self.device_type in _FAMILY_LABELS else "cpu"
        major, minor = self.compute_capability
        if major == 10:
            return "blackwell_datacenter"
        if major == 12:
            return "blackwell_workstation"
        if major == 9:
            return "hopper"
        if (major, minor) == (8, 9):
            return "ada"
        if major == 8:
            return "ampere"
        return "cuda"

    @property
    def sm(self) -> str | None:
        if self.compute_capability is None:
            return None
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"

    def describe(self) -> str:
        """Short label used in logs, e.g. ``Hopper sm_90, cuDNN 91900``."""
        parts = [_FAMILY_LABELS.get(self.family, self.family)]
        if self.sm:
            parts[0] += f" {self.sm}"
        if self.cudnn_version is not None:
            parts.append(f"cuDNN {self.cudnn_version}")
        return ", ".join(parts)

    def to_dict(self) -> dict:
        return {
            "device_type": self.device_type,
            "device_name": self.device_name,
            "compute_capability": list(self.compute_capability) if self.compute_capability else None,
            "sm": self.sm,
            "family": self.family,
            "cudnn_version": self.cudnn_version,
            "description": self.describe(),
        }


@functools.lru_cache(maxsize=None)
def _detect_platform() -> Platform:
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        return Platform(
            device_type="cuda",
            device_name=torch.cuda.get_device_name(index),
            compute_capability=tuple(torch.cuda.get_device_capability(index)),
            cudnn_version=cudnn,
        )
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return Platform(device_type="mps", device_name="Apple MPS")
    return Platform(device_type="cpu", device_name="CPU")


_platform_override: contextvars.ContextVar[Platform | None] = contextvars.ContextVar(
    "diffusers_omni_platform", default=None
)


def current_platform() -> Platform:
    """The detected platform, or the one set by ``use_platform`` in this context."""
    return _platform_override.get() or _detect_platform()


@contextlib.contextmanager
def use_platform(platform: Platform) -> Iterator[Platform]:
    """Resolve as if running on ``platform`` (routing tests, ``explain --platform``)."""
    token = _platform_override.set(platform)
    try:
        yield platform
    finally:
        _platform_override.reset(token)


@dataclass(frozen=True)
class Route:
    """One candidate in a platform's default list, taken only when every named condition holds."""

    backend: str
    when: tuple[str, ...] = ()
    why: str = ""


def _flash_attn_3_or_4_importable(platform: Platform, call: "AttentionCall") -> bool:
    from .backends.flash import flash_attention_implementations

    return any(impl in ("FA3", "FA4") for impl in flash_attention_implementations())


ROUTE_CONDITIONS: dict[str, Callable[[Platform, "AttentionCall"], bool]] = {
    "model_declares_mask_free_path": lambda platform, call: call.mask_free_path and not call.has_mask,
    "head_dim_128": lambda platform, call: call.head_dim == 128,
    "cudnn_at_least_9_5": lambda platform, call: (platform.cudnn_version or 0) >= 90500,
    "flash_attn_3_or_4_importable": _flash_attn_3_or_4_importable,
}

_BLACKWELL_TAIL = (
    Route("CUDNN_ATTN", when=("cudnn_at_least_9_5",)),
    Route("FLASHINFER_ATTN"),
    Route("FLASH_ATTN"),
    Route("TORCH_SDPA"),
)

# Hopper's route is TORCH_SDPA (unpinned SDPA lands on cuDNN: benchmarks/results/attention_h200.md), and no single
# kernel wins every shape there: FlashAttention-3 leads on long unmasked self-attention, FlashInfer on short masked
# sequences, SDPA at head_dim 64. Those per-shape choices come from routing_table.json (selector._shape_routes →
# routing.ShapeRouter), derived from committed H200 results, not from this list.
_HOPPER_WHY = "the reference kernel; measured shape classes are routed per routing_table.json"

PLATFORM_ROUTES: dict[str, tuple[Route, ...]] = {
    "blackwell_datacenter": (
        Route(
            "TRTLLM_ATTN",
            when=("model_declares_mask_free_path", "head_dim_128"),
            why="trtllm-gen FMHA on datacenter Blackwell for mask-free head_dim 128 paths",
        ),
        *_BLACKWELL_TAIL,
    ),
    "blackwell_workstation": _BLACKWELL_TAIL,
    "hopper": (Route("TORCH_SDPA", why=_HOPPER_WHY),),
    "ada": (
        Route("FLASH_ATTN", when=("flash_attn_3_or_4_importable",)),
        Route("TORCH_SDPA"),
    ),
    "ampere": (
        Route("FLASH_ATTN", when=("flash_attn_3_or_4_importable",)),
        Route("TORCH_SDPA"),
    ),
    "cuda": (Route("TORCH_SDPA"),),
    "cpu": (Route("TORCH_SDPA"),),
    "mps": (Route("TORCH_SDPA"),),
}


def platform_routes(platform: Platform) -> tuple[Route, ...]:
    return PLATFORM_ROUTES.get(platform.family, PLATFORM_ROUTES["cpu"])


def failed_conditions(route: Route, platform: Platform, call: "AttentionCall") -> list[str]:
    return [name for name in route.when if not ROUTE_CONDITIONS[name](platform, call)]
