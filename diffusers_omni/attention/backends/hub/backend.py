"""``FLASH_ATTN_HUB`` and ``FLASH_ATTN_3_HUB``: FlashAttention kernels from the Hugging Face Hub (``kernels``).

These exist so that training and rollout run the identical kernel: the kernel repository and revision are recorded
in ``describe()`` (and so in ``omni_attention_report()`` and kernel fingerprints).

Where the kernel comes from, first match wins (``NAME`` is ``FLASH_ATTN_HUB`` or ``FLASH_ATTN_3_HUB``):

1. ``DIFFUSERS_OMNI_<NAME>_LOCAL_PATH`` or ``DIFFUSERS_OMNI_HUB_KERNEL_LOCAL_PATH``: a local kernel repository
   (``kernels.get_local_kernel``; works offline).
2. ``kernels.get_kernel(repo, revision=...)`` with the revision from ``DIFFUSERS_OMNI_<NAME>_REVISION`` or
   ``DIFFUSERS_OMNI_HUB_KERNEL_REVISION`` (a branch, tag or commit; unset: the repository's default branch). With
   ``HF_HUB_OFFLINE=1`` the ``kernels`` package reads its local cache only.

When ``kernels`` is missing or the kernel cannot be loaded: one warning, then ``FLASH_ATTN``. ``FLASH_ATTN_3_HUB``
below sm_90 runs ``FLASH_ATTN_HUB`` instead (which itself falls back to ``FLASH_ATTN``).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import ClassVar

from ....utils.versions import installed_version
from ..base import package_importable
from ..flash.backend import FlashAttentionBackend, FlashKernels

logger = logging.getLogger(__name__)

ENV_REVISION = "DIFFUSERS_OMNI_HUB_KERNEL_REVISION"
ENV_LOCAL_PATH = "DIFFUSERS_OMNI_HUB_KERNEL_LOCAL_PATH"

_warned: set[tuple[str, str]] = set()


def _warn_once(backend: str, message: str) -> None:
    if (backend, message) not in _warned:
        _warned.add((backend, message))
        logger.warning("%s: %s", backend, message)


def _env(name: str, generic: str) -> str | None:
    value = os.environ.get(name, "").strip() or os.environ.get(generic, "").strip()
    return value or None


def _snapshot_commit(module) -> str | None:
    match = re.search(r"snapshots[/\\]([0-9a-f]{40})", str(getattr(module, "__file__", "") or ""))
    return match.group(1) if match else None


class FlashAttentionHubBackend(FlashAttentionBackend):
    """FlashAttention-2 from ``kernels-community/flash-attn2`` through the ``kernels`` package."""

    name: ClassVar[str] = "FLASH_ATTN_HUB"
    kernel_repo: ClassVar[str] = "kernels-community/flash-attn2"
    hub_min_compute_capability: ClassVar[tuple[int, int]] = (8, 0)
    below_min_fallback: ClassVar[str] = "FLASH_ATTN"
    # Set when the kernel is loaded; checked by FLASH_ATTN_3_HUB's fallback.
    supports_backward = True

    def __init__(self, spec=None, platform=None) -> None:
        from ...platform import current_platform

        platform = platform or current_platform()
        self.revision = _env(f"DIFFUSERS_OMNI_{self.name}_REVISION", ENV_REVISION)
        self.local_path = _env(f"DIFFUSERS_OMNI_{self.name}_LOCAL_PATH", ENV_LOCAL_PATH)
        self.fallback = None
        self.resolved_revision = None
        self._module = None
        kernels = None
        cc = platform.compute_capability
        if platform.device_type == "cuda" and cc is not None and cc < self.hub_min_compute_capability:
            self._use_fallback(spec, self.below_min_fallback, f"compute capability is {platform.sm}; {self.name} "
                               f"requires sm_{self.hub_min_compute_capability[0]}{self.hub_min_compute_capability[1]}")
        else:
            try:
                self._module = self._load()
                kernels = FlashKernels(
                    func=self._module.flash_attn_func,
                    varlen_func=getattr(self._module, "flash_attn_varlen_func", None),
                    label=self.kernel_repo,
                )
            except Exception as exc:  # kernels missing, hub unreachable, no build for this system
                self._use_fallback(spec, "FLASH_ATTN", f"cannot load {self.kernel_repo} ({type(exc).__name__}: "
                                   f"{str(exc).splitlines()[0] if str(exc) else ''})")
        super().__init__(spec, kernels=kernels if kernels is not None else FlashKernels(None, None, "unloaded"))
        self._impl = None
        if self.fallback is not None:
            self.supports_backward = self.fallback.supports_backward

    def _use_fallback(self, spec, target: str, why: str) -> None:
        from ...registry import get_backend_class

        _warn_once(self.name, f"{why}; using {target}")
        self.fallback = get_backend_class(target)(spec)

    def _load(self):
        if not package_importable("kernels"):
            raise ImportError("package 'kernels' is not importable; install it with pip install 'diffusers-omni[hub]'")
        import kernels

        if self.local_path:
            module = kernels.get_local_kernel(Path(self.local_path))
            self.resolved_revision = f"local:{self.local_path}"
            return module
        module = kernels.get_kernel(self.kernel_repo, revision=self.revision)
        self.resolved_revision = _snapshot_commit(module) or self.revision
        return module

    @classmethod
    def extra_availability_reasons(cls, platform) -> list[str]:
        if platform.device_type != "cuda":
            return []
        if package_importable("kernels") or _env(f"DIFFUSERS_OMNI_{cls.name}_LOCAL_PATH", ENV_LOCAL_PATH):
            return []
        # Without `kernels` the call runs on FLASH_ATTN, so FLASH_ATTN has to be usable.
        from ..flash.backend import FlashAttentionBackend as Flash

        return [f"package 'kernels' is not importable and the FLASH_ATTN fallback cannot run: {r}"
                for r in Flash.extra_availability_reasons(platform)]

    @classmethod
    def extra_call_reasons(cls, call, platform) -> list[str]:
        return []  # hub FlashAttention builds take head dims up to 256 (multiples of 8, checked below)

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if self.fallback is not None:
            return self.fallback(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        return super().__call__(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    def describe(self) -> dict:
        if self.fallback is not None:
            inner = self.fallback.describe()
            return {**inner, "backend": self.name, "fallback": inner["backend"], "kernel_repo": inner.get("kernel_repo"),
                    "kernel_revision": inner.get("kernel_revision")}
        return {
            "backend": self.name,
            "implementation": f"{self.kernel_repo}:flash_attn_func",
            "version": installed_version("kernels"),
            "kernel_repo": self.kernel_repo,
            "kernel_revision": self.resolved_revision,
            "requested_revision": self.revision,
            "deterministic": self.deterministic_mode,
            "fallback": None,
        }


class FlashAttention3HubBackend(FlashAttentionHubBackend):
    """FlashAttention-3 from ``kernels-community/flash-attn3``; below sm_90 it runs ``FLASH_ATTN_HUB``."""

    name: ClassVar[str] = "FLASH_ATTN_3_HUB"
    kernel_repo: ClassVar[str] = "kernels-community/flash-attn3"
    hub_min_compute_capability = (9, 0)
    below_min_fallback = "FLASH_ATTN_HUB"


__all__ = ["FlashAttentionHubBackend", "FlashAttention3HubBackend", "ENV_REVISION", "ENV_LOCAL_PATH"]
