"""Pick the handler a config asks for: each registered config type maps to one ``OffloadBackend`` class.

The registry is ``config/offload_base.py``'s: a strategy is its config class, its backend module in this package and
one ``register_offload_strategy(Config, "diffusers_omni.offload.<module>:<Backend>", priority=...)``. Handlers are
looked up by the config's type (torchao-style) and imported on first use; ``register_offload_backend`` swaps the
handler of a registered strategy at run time.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from ..config.offload import OffloadConfig, offload_strategy_entry
from .base import OffloadBackend

logger = logging.getLogger("diffusers_omni")


def register_offload_backend(strategy: Any, backend: type[OffloadBackend] | str) -> None:
    """Serve ``strategy`` (a registered name, an ``OffloadStrategy`` or a registered config class) with ``backend``
    (an ``OffloadBackend`` subclass or a lazy ``"module:Class"`` path)."""
    entry = offload_strategy_entry(strategy)
    if entry.handler is None:
        raise ValueError(f"register_offload_backend: strategy {entry.name!r} installs nothing and takes no backend")
    if isinstance(backend, str) and ":" not in backend:
        raise ValueError(f"register_offload_backend: backend={backend!r} must look like 'package.module:ClassName'")
    if not isinstance(backend, str) and not (isinstance(backend, type) and issubclass(backend, OffloadBackend)):
        raise TypeError(
            f"register_offload_backend: backend must be an OffloadBackend subclass or a 'module:Class' path, got {backend!r}"
        )
    entry.handler = backend


def offload_backend_class(strategy: Any) -> type[OffloadBackend]:
    """The backend class registered for ``strategy`` (a registered name, an ``OffloadStrategy`` or a registered
    config class)."""
    entry = offload_strategy_entry(strategy)
    handler = entry.handler
    if handler is None:
        raise ValueError(f"offload strategy {entry.name!r} installs nothing and has no backend")
    if isinstance(handler, str):
        module, _, name = handler.partition(":")
        handler = getattr(importlib.import_module(module), name)
        if not (isinstance(handler, type) and issubclass(handler, OffloadBackend)):
            raise TypeError(f"the handler of offload strategy {entry.name!r}, {entry.handler!r}, is not an "
                            f"OffloadBackend subclass: {handler!r}")
        entry.handler = handler
    return handler


def get_offload_backend(config: OffloadConfig | None) -> OffloadBackend | None:
    """The backend for ``config`` (looked up by its type), not yet enabled; ``None`` when no offload is requested
    (``None``, or a strategy that installs nothing such as ``NoOffloadConfig``).

    A config built from several requested strategies (``OffloadConfig(["layerwise", "model_level"])``) is the
    highest-priority one's; the others are logged as dropped.

    Example:
    ```py
    >>> backend = get_offload_backend(LayerwiseOffloadConfig(device="cuda"))
    >>> backend.enable(pipe)
    ```
    """
    if config is None:
        logger.info("offload: no config, nothing installed")
        return None
    if not isinstance(config, OffloadConfig):
        raise TypeError(
            f"config must be an offload config (OffloadConfig, e.g. LayerwiseOffloadConfig) or None, got "
            f"{type(config).__name__}: {config!r}"
        )
    entry = offload_strategy_entry(type(config))
    if config.dropped:
        logger.info(
            "offload: %s requested; using %s (highest priority), dropping %s",
            [str(s) for s in config.requested],
            entry.name,
            [str(s) for s in config.dropped],
        )
    if entry.handler is None:
        logger.info("offload: strategy %r, nothing installed", entry.name)
        return None
    backend = offload_backend_class(entry.name).for_config(config)
    logger.info("offload: %s on %s", entry.name, backend.device)
    return backend
