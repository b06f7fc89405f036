"""Omni FLUX.1 pipelines."""

from __future__ import annotations

from diffusers import FluxPipeline

from .mixin import OmniPipelineMixin


class FluxComponents:
    _omni_family = "flux"
    _dit_modules = ("transformer",)
    _encoder_modules = ("text_encoder", "text_encoder_2")
    _vae_modules = ("vae",)
    _resident_modules = ()


class OmniFluxPipeline(FluxComponents, OmniPipelineMixin, FluxPipeline):
    """``FluxPipeline`` with omni attention and offload."""
