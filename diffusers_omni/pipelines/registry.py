"""Which Omni pipeline class serves which Diffusers pipeline class, and ``omnify``."""

from __future__ import annotations

import importlib
from typing import Any

# Diffusers pipeline class name → "module:OmniClass".
_OMNI_PIPELINES: dict[str, str] = {
    "FluxPipeline": "diffusers_omni.pipelines.flux:OmniFluxPipeline",
    "WanPipeline": "diffusers_omni.pipelines.wan:OmniWanPipeline",
    "WanImageToVideoPipeline": "diffusers_omni.pipelines.wan:OmniWanImageToVideoPipeline",
}

_KEEP_DISABLED = object()


def supported_pipelines() -> list[str]:
    return sorted(_OMNI_PIPELINES)


def omni_pipeline_class(pipeline_cls: type) -> type:
    """The Omni class for a Diffusers pipeline class (its own class if it already is one)."""
    from .mixin import OmniPipelineMixin

    if issubclass(pipeline_cls, OmniPipelineMixin):
        return pipeline_cls
    for cls in pipeline_cls.__mro__:
        path = _OMNI_PIPELINES.get(cls.__name__)
        if path:
            module, _, name = path.partition(":")
            return getattr(importlib.import_module(module), name)
    raise TypeError(
        f"{pipeline_cls.__name__} is not supported by diffusers-omni; supported pipelines: "
        f"{', '.join(supported_pipelines())}"
    )


def omnify(pipe: Any, attention: Any = None, *, enable_attention: bool = True):
    """Return the Omni version of a Diffusers pipeline, sharing its components.

    Args:
        pipe: a supported Diffusers pipeline (e.g. ``FluxPipeline``).
        attention: anything ``AttentionConfig.parse`` accepts; ``None`` uses the environment variable or the
            platform default.
        enable_attention (`bool`, defaults to `True`): install omni attention right away.

    The components are shared, not copied: the original pipeline object sees the omni processors too.

    Example:
    ```py
    >>> pipe = omnify(FluxPipeline.from_pretrained("black-forest-labs/FLUX.1-dev"), "TORCH_SDPA")
    ```
    """
    omni_cls = omni_pipeline_class(type(pipe))
    omni = pipe if isinstance(pipe, omni_cls) else omni_cls.from_pipe(pipe)
    if enable_attention:
        omni.enable_omni_attention(attention)
    return omni
