"""Omni LongCat-Image pipelines: text-to-image and Edit (both share ``LongCatImageTransformer2DModel``)."""

from __future__ import annotations

from diffusers import LongCatImageEditPipeline, LongCatImagePipeline

from .mixin import OmniPipelineMixin


class LongCatImageComponents:
    _omni_family = "longcat"
    _dit_modules = ("transformer",)
    _encoder_modules = ("text_encoder",)
    _vae_modules = ("vae",)
    _resident_modules = ()


class OmniLongCatImagePipeline(LongCatImageComponents, OmniPipelineMixin, LongCatImagePipeline):
    """``LongCatImagePipeline`` (text-to-image) with omni attention and offload."""


class OmniLongCatImageEditPipeline(LongCatImageComponents, OmniPipelineMixin, LongCatImageEditPipeline):
    """``LongCatImageEditPipeline`` with omni attention and offload."""
