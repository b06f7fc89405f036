"""Backend registry: stable names mapped to backend classes, imported on first use."""

from __future__ import annotations

import importlib
import threading

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

_entries: dict[str, str | type[AttentionBackend]] = dict(_DEFAULT_PATHS)
_lock = threading.Lock()


def registered_backend_names() -> tuple[str, ...]:
    return tuple(_entries)


def _load(path: str) -> type[AttentionBackend]:
    module_name, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"backend path {path!r} must look like 'package.module:ClassName'")
    return getattr(importlib.import_module(module_name), attr)


def get_backend_class(name: str) -> type[AttentionBackend]:
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


def register_backend(name: str, backend: type[AttentionBackend] | str) -> None:
    """Add or replace the backend behind ``name``.

    Args:
        name (`str`): the configuration name, e.g. ``"MY_ATTN"`` (upper case by convention).
        backend (`type[AttentionBackend]` or `str`): a subclass of ``AttentionBackend`` or a lazy
            ``"package.module:ClassName"`` path.
    """
    if not isinstance(name, str) or not name.strip() or name.strip().lower() == "auto":
        raise ValueError(f"register_backend: name={name!r} must be a non-empty backend name other than 'auto'")
    if isinstance(backend, str):
        if ":" not in backend:
            raise ValueError(f"register_backend: backend={backend!r} must look like 'package.module:ClassName'")
    elif not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
        raise TypeError(
            f"register_backend: backend must be an AttentionBackend subclass or a 'module:Class' path, got {backend!r}"
        )
    canonical = name.strip().upper()
    with _lock:
        _entries[canonical] = backend
    from .selector import clear_resolution_cache

    clear_resolution_cache()


def reset_backend(name: str) -> None:
    """Restore the built-in entry for ``name`` (or drop a name that was only registered at run time)."""
    canonical = name.strip().upper()
    with _lock:
        if canonical in _DEFAULT_PATHS:
            _entries[canonical] = _DEFAULT_PATHS[canonical]
        else:
            _entries.pop(canonical, None)
    from .selector import clear_resolution_cache

    clear_resolution_cache()
