"""Pick the one backend an ``OffloadConfig`` asks for."""

from __future__ import annotations

import logging

from ..config.offload import OffloadConfig, OffloadStrategy
from .base import OffloadBackend

logger = logging.getLogger("diffusers_omni")


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
    if strategy is OffloadStrategy.DISTRIBUTED_LAYERWISE:
        from .distributed import DistributedLayerwiseOffloadBackend

        backend: OffloadBackend = DistributedLayerwiseOffloadBackend(config)
    elif strategy is OffloadStrategy.LAYERWISE:
        from .layerwise import LayerwiseOffloadBackend

        backend = LayerwiseOffloadBackend(config)
    else:
        from .model_level import ModelLevelOffloadBackend

        backend = ModelLevelOffloadBackend(config)
    logger.info("offload: %s on %s", strategy.value, backend.device)
    return backend
