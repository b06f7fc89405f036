"""Which Omni pipeline class serves which Diffusers pipeline class, and ``omnify``."""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
from typing import Any

_INFRASTRUCTURE = frozenset({"mixin", "registry"})


@functools.lru_cache(maxsize=1)
def omni_pipelines() -> dict[str, type]:
    """Diffusers pipeline class name → Omni class, collected from every family module in this package.

    An Omni class serves the Diffusers pipeline it directly subclasses.
    """
    from .. import pipelines
    from .mixin import OmniPipelineMixin

    found: dict[str, type] = {}
    for info in pkgutil.iter_modules(pipelines.__path__):
        if info.name in _INFRASTRUCTURE or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{pipelines.__name__}.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__ or not issubclass(cls, OmniPipelineMixin):
                continue
            for base in cls.__bases__:
                if base.__module__.startswith("diffusers.") and base.__name__.endswith("Pipeline"):
                    found[base.__name__] = cls
    return found


def supported_pipelines() -> list[str]:
    return sorted(omni_pipelines())


def omni_pipeline_class(pipeline_cls: type) -> type:
    """The Omni class for a Diffusers pipeline class (its own class if it already is one)."""
    from .mixin import OmniPipelineMixin

    if issubclass(pipeline_cls, OmniPipelineMixin):
        return pipeline_cls
    registry = omni_pipelines()
    for cls in pipeline_cls.__mro__:
        if cls.__name__ in registry:
            return registry[cls.__name__]
    from ..models.base import declarations

    families = sorted({d.display_name or d.name for d in declarations()})
    raise TypeError(
        f"{pipeline_cls.__name__} is not supported by diffusers-omni; supported families: {', '.join(families)} "
        f"({len(registry)} pipelines; `diffusers-omni models` lists them)"
    )


def omnify(pipe: Any, attention: Any = None, *, enable_attention: bool = True):
    """Return the Omni version of a Diffusers pipeline, sharing its components.

    Args:
        pipe: a supported Diffusers pipeline (e.g. ``FluxPipeline``).
        attention: anything ``AttentionConfig.parse`` accepts; ``None`` uses the environment variable or the
            platform default.
        enable_attention (`bool`, defaults to `True`): install omni attention right away.

    The components are shared, not copied or cast (unlike ``from_pipe``, which casts every component to one
    dtype): the original pipeline object sees the omni processors too.

    Example:
    ```py
    >>> pipe = omnify(FluxPipeline.from_pretrained("black-forest-labs/FLUX.1-dev"), "TORCH_SDPA")
    ```
    """
    from .mixin import sharing_components

    omni_cls = omni_pipeline_class(type(pipe))
    if isinstance(pipe, omni_cls):
        omni = pipe
    else:
        with sharing_components():
            omni = omni_cls.from_pipe(pipe)
    if enable_attention:
        omni.enable_omni_attention(attention)
    return omni
