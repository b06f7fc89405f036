"""Backend registry: stable names mapped to backend classes, imported on first use.

This is the one list of backends: a new backend is its file under ``backends/`` plus one line here. The names
registered here are the names ``AttentionSpec`` accepts (the config layer asks ``registered_backend_names``
through ``use_backend_names``, installed below, so that it imports nothing above itself). Importing this module
loads no backend and not even torch.
"""

from __future__ import annotations

import importlib
import threading
from typing import TYPE_CHECKING

from ..config.attention import use_backend_names

if TYPE_CHECKING:
    from .backends.base import AttentionBackend

_PKG = "diffusers_omni.attention.backends"

_DEFAULT_PATHS: dict[str, str] = {
    "TORCH_SDPA": f"{_PKG}.sdpa:TorchSDPABackend",
    "FLASH_ATTN": f"{_PKG}.flash:FlashAttentionBackend",
    "CUDNN_ATTN": f"{_PKG}.sdpa:CudnnAttentionBackend",
    "FLASHINFER_ATTN": f"{_PKG}.flashinfer:FlashInferBackend",
    "TRTLLM_ATTN": f"{_PKG}.trtllm:TrtllmAttentionBackend",
    "SAGE_ATTN": f"{_PKG}.sage:SageAttentionBackend",
    "SAGE_ATTN_3": f"{_PKG}.sage:SageAttention3Backend",
    "FLASH_ATTN_HUB": f"{_PKG}.hub:FlashAttentionHubBackend",
    "FLASH_ATTN_3_HUB": f"{_PKG}.hub:FlashAttention3HubBackend",
    "RAINFUSION_ATTN": f"{_PKG}.rainfusion:RainFusionBackend",
}

_entries: dict[str, "str | type[AttentionBackend]"] = dict(_DEFAULT_PATHS)
_lock = threading.Lock()
# Bumped by every change of an entry; cached resolutions of an older generation are stale (selector.resolve).
_generation = 0


def registered_backend_names() -> tuple[str, ...]:
    return tuple(_entries)


def is_registered(name: str) -> bool:
    return name in _entries


def registry_generation() -> int:
    """A number that changes whenever a backend is registered or reset (for caches of resolutions)."""
    return _generation


use_backend_names(registered_backend_names)


def _load(path: str) -> type[AttentionBackend]:
    module_name, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"backend path {path!r} must look like 'package.module:ClassName'")
    return getattr(importlib.import_module(module_name), attr)


def get_backend_class(name: str) -> "type[AttentionBackend]":
    """The backend class registered under ``name`` (imported on first use)."""
    try:
        entry = _entries[name]
    except KeyError:
        raise ValueError(
            f"backend={name!r} is not registered; registered: {', '.join(registered_backend_names())}"
        ) from None
    if isinstance(entry, str):
        with _lock:
            entry = _entries[name]
            if isinstance(entry, str):
                entry = _load(entry)
                _entries[name] = entry
    return entry


def register_backend(name: str, backend: "type[AttentionBackend] | str") -> None:
    """Add or replace the backend behind ``name``.

    Args:
        name (`str`): the configuration name, e.g. ``"MY_ATTN"`` (upper case by convention).
        backend (`type[AttentionBackend]` or `str`): a subclass of ``AttentionBackend`` or a lazy
            ``"package.module:ClassName"`` path.
    """
    if not isinstance(name, str) or not name.strip() or name.strip().lower() == "auto":
        raise ValueError(f"register_backend: name={name!r} must be a non-empty backend name other than 'auto'")
    from .backends.base import AttentionBackend

    if isinstance(backend, str):
        if ":" not in backend:
            raise ValueError(f"register_backend: backend={backend!r} must look like 'package.module:ClassName'")
    elif not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
        raise TypeError(
            f"register_backend: backend must be an AttentionBackend subclass or a 'module:Class' path, got {backend!r}"
        )
    global _generation
    canonical = name.strip().upper()
    with _lock:
        _entries[canonical] = backend
        _generation += 1


def reset_backend(name: str) -> None:
    """Restore the built-in entry for ``name`` (or drop a name that was only registered at run time)."""
    global _generation
    canonical = name.strip().upper()
    with _lock:
        if canonical in _DEFAULT_PATHS:
            _entries[canonical] = _DEFAULT_PATHS[canonical]
        else:
            _entries.pop(canonical, None)
        _generation += 1
