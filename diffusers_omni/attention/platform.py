"""The platform we run on: hardware detection only.

A platform is detected once (device type, GPU name, compute capability, cuDNN version) and classified into a
family; ``use_platform`` overrides it in a context (routing tests, ``explain --platform``). What runs on each family
is routing policy, in ``routing.py``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass
from typing import Iterator

import torch

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


def detected_platform() -> Platform:
    """The platform this process really runs on (``use_platform`` overrides do not apply)."""
    return _detect_platform()


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
