"""Pick the one backend an ``OffloadConfig`` asks for, from the registry of offload strategies.

A new strategy is its ``OffloadStrategy`` member (config/offload.py), its backend file in this package and one entry
in ``_BACKENDS`` (or ``register_offload_backend`` at run time).
"""

from __future__ import annotations

import importlib
import logging

from ..config.offload import OffloadConfig, OffloadStrategy
from .base import OffloadBackend

logger = logging.getLogger("diffusers_omni")

_PKG = "diffusers_omni.offload"

# Strategy → its backend class, as a lazy "module:Class" path (imported on first use).
_BACKENDS: dict[OffloadStrategy, str | type[OffloadBackend]] = {
    OffloadStrategy.MODEL_LEVEL: f"{_PKG}.model_level:ModelLevelOffloadBackend",
    OffloadStrategy.LAYERWISE: f"{_PKG}.layerwise:LayerwiseOffloadBackend",
    OffloadStrategy.DISTRIBUTED_LAYERWISE: f"{_PKG}.distributed:DistributedLayerwiseOffloadBackend",
}


def register_offload_backend(strategy: OffloadStrategy | str, backend: type[OffloadBackend] | str) -> None:
    """Serve ``strategy`` with ``backend`` (an ``OffloadBackend`` subclass or a lazy ``"module:Class"`` path)."""
    strategy = OffloadStrategy.parse(strategy)
    if strategy is OffloadStrategy.NONE:
        raise ValueError("register_offload_backend: strategy 'none' installs nothing and takes no backend")
    if isinstance(backend, str) and ":" not in backend:
        raise ValueError(f"register_offload_backend: backend={backend!r} must look like 'package.module:ClassName'")
    if not isinstance(backend, str) and not (isinstance(backend, type) and issubclass(backend, OffloadBackend)):
        raise TypeError(
            f"register_offload_backend: backend must be an OffloadBackend subclass or a 'module:Class' path, got {backend!r}"
        )
    _BACKENDS[strategy] = backend


def offload_backend_class(strategy: OffloadStrategy | str) -> type[OffloadBackend]:
    """The backend class registered for ``strategy``."""
    strategy = OffloadStrategy.parse(strategy)
    entry = _BACKENDS.get(strategy)
    if entry is None:
        allowed = ", ".join(s.value for s in _BACKENDS)
        raise ValueError(f"offload strategy {strategy.value!r} has no backend; registered: {allowed}")
    if isinstance(entry, str):
        module, _, name = entry.partition(":")
        entry = _BACKENDS[strategy] = getattr(importlib.import_module(module), name)
    return entry


def get_offload_backend(config: OffloadConfig | None) -> OffloadBackend | None:
    """The backend for ``config.strategy``, not yet enabled; ``None`` when no offload is requested.

    When several strategies were requested the highest-priority one is used (distributed layerwise > layerwise >
    model level) and the others are logged as dropped.

    Example:
    ```py
    >>> backend = get_offload_backend(OffloadConfig("layerwise", device="cuda"))
    >>> backend.enable(pipe)
    ```
    """
    if config is None:
        logger.info("offload: no config, nothing installed")
        return None
    if not isinstance(config, OffloadConfig):
        raise TypeError(f"config must be an OffloadConfig or None, got {type(config).__name__}: {config!r}")
    if config.dropped:
        logger.info(
            "offload: %s requested; using %s (highest priority), dropping %s",
            [s.value for s in config.requested],
            config.strategy.value,
            [s.value for s in config.dropped],
        )
    strategy = config.strategy
    if strategy is OffloadStrategy.NONE:
        logger.info("offload: strategy 'none', nothing installed")
        return None
    backend = offload_backend_class(strategy).for_config(config)
    logger.info("offload: %s on %s", strategy.value, backend.device)
    return backend
