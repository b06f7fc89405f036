"""Tiny FLUX.1 pipelines beyond text-to-image: img2img, inpaint, Fill, Kontext, Control; and a tiny IP-adapter.

Built like :mod:`diffusers_omni.testing.tiny` (forked RNG seeding, ``eval()`` models, nothing downloaded) from
the same components as :func:`~diffusers_omni.testing.tiny.tiny_flux_components`; Fill and Control get a
transformer whose input takes their extra latent channels. Keep ``height``/``width`` multiples of 4 (e.g. 32).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from diffusers import (
    DiffusionPipeline,
    FluxControlPipeline,
    FluxFillPipeline,
    FluxTransformer2DModel,
)

from .tiny import _build_model, _image_projection_state, _seeded, tiny_flux_components

__all__ = [
    "TINY_FLUX_IP_EMBED_DIM",
    "load_tiny_flux_ip_adapter",
    "tiny_flux_control_pipeline",
    "tiny_flux_fill_pipeline",
    "tiny_flux_ip_adapter_state_dict",
    "tiny_flux_variant_pipeline",
]

TINY_FLUX_IP_EMBED_DIM = 8
_IP_TOKENS = 4


def _with_in_channels(transformer: FluxTransformer2DModel, in_channels: int, seed: int) -> FluxTransformer2DModel:
    config = dict(transformer.config)
    config.update(in_channels=in_channels, out_channels=transformer.config.in_channels)
    config = {key: value for key, value in config.items() if not key.startswith("_")}
    return _build_model(seed, lambda: FluxTransformer2DModel(**config))


def _components_for(pipeline_cls: type[DiffusionPipeline], components: dict[str, Any]) -> dict[str, Any]:
    accepted = inspect.signature(pipeline_cls.__init__).parameters
    return {name: value for name, value in components.items() if name in accepted}


def tiny_flux_variant_pipeline(
    pipeline_cls: type[DiffusionPipeline], seed: int = 0, in_channels: int | None = None
) -> DiffusionPipeline:
    """Any FLUX.1 pipeline class from the tiny FLUX.1 components (optionally a wider transformer input)."""
    components = tiny_flux_components(seed)
    if in_channels is not None:
        components["transformer"] = _with_in_channels(components["transformer"], in_channels, seed)
    return pipeline_cls(**_components_for(pipeline_cls, components))


def tiny_flux_fill_pipeline(seed: int = 0, pipeline_cls: type[DiffusionPipeline] | None = None) -> DiffusionPipeline:
    """Tiny ``FluxFillPipeline``: packed latents (16) + masked-image latents (16) + packed mask (16) channels."""
    return tiny_flux_variant_pipeline(pipeline_cls or FluxFillPipeline, seed, in_channels=48)


def tiny_flux_control_pipeline(
    seed: int = 0, pipeline_cls: type[DiffusionPipeline] | None = None
) -> DiffusionPipeline:
    """Tiny ``FluxControlPipeline`` (or a Control img2img/inpaint class): latents + control latents (2 × 16)."""
    return tiny_flux_variant_pipeline(pipeline_cls or FluxControlPipeline, seed, in_channels=32)


def tiny_flux_ip_adapter_state_dict(transformer: FluxTransformer2DModel, seed: int = 0) -> dict[str, dict]:
    """A random IP-adapter checkpoint in the layout ``FluxIPAdapterMixin.load_ip_adapter`` reads."""
    inner_dim = transformer.inner_dim
    cross_dim = transformer.config.joint_attention_dim
    with _seeded(seed):
        image_proj = _image_projection_state(TINY_FLUX_IP_EMBED_DIM, cross_dim, _IP_TOKENS)
        ip_adapter = {}
        for index in range(len(transformer.transformer_blocks)):
            for name in ("to_k_ip", "to_v_ip"):
                ip_adapter[f"{index}.{name}.weight"] = torch.randn(inner_dim, cross_dim) * 0.2
                ip_adapter[f"{index}.{name}.bias"] = torch.randn(inner_dim) * 0.2
    return {"image_proj": image_proj, "ip_adapter": ip_adapter}


def load_tiny_flux_ip_adapter(transformer: FluxTransformer2DModel, seed: int = 0) -> None:
    """Load a random tiny IP-adapter into ``transformer`` through Diffusers' own loader
    (``_load_ip_adapter_weights``, what ``FluxIPAdapterMixin.load_ip_adapter`` calls after reading the
    checkpoint): ``FluxIPAdapterAttnProcessor`` on the double-stream blocks, ``type(processor)()`` on the
    single-stream blocks, and an ``encoder_hid_proj`` taking ``[batch, 1, 8]`` image embeddings."""
    transformer._load_ip_adapter_weights(tiny_flux_ip_adapter_state_dict(transformer, seed), low_cpu_mem_usage=False)



