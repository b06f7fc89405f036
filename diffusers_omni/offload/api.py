"""Offload for a bare model (no pipeline)."""

from __future__ import annotations

import torch.nn as nn

from ..config.offload import OffloadConfig
from .base import OffloadBackend
from .factory import get_offload_backend


def apply_offload(model: nn.Module, config: OffloadConfig) -> OffloadBackend | None:
    """Enable ``config``'s strategy on ``model`` (treated as one DiT) and return the enabled backend, or ``None``
    for strategy ``"none"``. Call ``backend.disable()`` to remove it.

    Example:
    ```py
    >>> backend = apply_offload(transformer, OffloadConfig("layerwise", device="cuda"))
    >>> with torch.inference_mode():
    ...     transformer(**inputs)  # non-block weights and inputs on cuda
    >>> backend.disable()
    ```
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}; for pipelines use "
                        "pipe.enable_omni_offload(config)")
    backend = get_offload_backend(config)
    if backend is not None:
        backend.enable(model)
    return backend
