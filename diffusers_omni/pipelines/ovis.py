"""Omni Ovis-Image pipeline (text-to-image; the only Diffusers 0.42 pipeline of the family)."""

from __future__ import annotations

from diffusers import OvisImagePipeline

from .mixin import OmniPipelineMixin


class OvisImageComponents:
    _omni_family = "ovis"
    _dit_modules = ("transformer",)
    _encoder_modules = ("text_encoder",)
    _vae_modules = ("vae",)
    _resident_modules = ()


class OmniOvisImagePipeline(OvisImageComponents, OmniPipelineMixin, OvisImagePipeline):
    """``OvisImagePipeline`` with omni attention and offload."""
