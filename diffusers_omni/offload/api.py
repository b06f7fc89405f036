"""Offload for a bare model (no pipeline), and disabling an offload from any object sharing its components."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ..config.offload import OffloadConfig
from .base import OffloadBackend
from .factory import get_offload_backend
from .guards import offload_backends


def apply_offload(target: Any, config: OffloadConfig) -> OffloadBackend | None:
    """Enable ``config``'s strategy on ``target`` and return the enabled backend, or ``None`` for a strategy that
    installs nothing (``NoOffloadConfig``). The handler is the one registered for the config's type.

    ``target`` is a bare model (a ``torch.nn.Module``, treated as one DiT; call ``backend.disable()`` to remove it)
    or an Omni pipeline, for which this is ``pipe.enable_omni_offload(config)`` (remove it with
    ``pipe.disable_omni_offload()``).

    Example:
    ```py
    >>> backend = apply_offload(transformer, LayerwiseOffloadConfig(device="cuda"))
    >>> with torch.inference_mode():
    ...     transformer(**inputs)  # non-block weights and inputs on cuda
    >>> backend.disable()
    ```
    """
    enable_on_pipeline = getattr(target, "enable_omni_offload", None)
    if callable(enable_on_pipeline) and not isinstance(target, nn.Module):
        return enable_on_pipeline(config)
    if not isinstance(target, nn.Module):
        raise TypeError(f"apply_offload: target must be a torch.nn.Module or an Omni pipeline, got "
                        f"{type(target).__name__}; for a Diffusers pipeline use diffusers_omni.omnify(pipe) first")
    backend = get_offload_backend(config)
    if backend is not None:
        backend.enable(target)
    return backend


def disable_offload(target: Any) -> list[OffloadBackend]:
    """Disable every diffusers-omni offload that places a component of ``target`` and return those backends (empty
    when there is none).

    Offload belongs to the components, not to the object it was enabled from, so this works from any object sharing
    them: the Diffusers pipeline given to ``omnify`` after the Omni pipeline is gone, a pipeline built from
    ``pipe.components``, ``from_pipe``, a component itself or a bare model given to ``apply_offload``. As with
    ``disable()``, offloaded weights become ordinary host tensors; move them with ``.to()`` afterwards. Distributed
    offload is disabled collectively: call this on every rank.

    Args:
        target: a pipeline (anything with a ``components`` dict) or a ``torch.nn.Module`` (a component, a bare model,
            or a module containing them).

    Example:
    ```py
    >>> omni = omnify(pipe)
    >>> omni.enable_layerwise_offload(device="cuda")
    >>> del omni
    >>> diffusers_omni.disable_offload(pipe)  # the original pipeline shares the components
    ```
    """
    if not isinstance(target, nn.Module) and not isinstance(getattr(target, "components", None), dict):
        raise TypeError(
            f"disable_offload: target must be a pipeline (with a components dict) or a torch.nn.Module, got "
            f"{type(target).__name__}"
        )
    backends = offload_backends(target)
    for backend in backends:
        backend.disable()
    return backends
