"""Omni Chroma pipelines (``ChromaTransformer2DModel``, T5 text encoder)."""

from __future__ import annotations

from diffusers import ChromaImg2ImgPipeline, ChromaInpaintPipeline, ChromaPipeline

from .mixin import OmniPipelineMixin


class ChromaComponents:
    _omni_family = "chroma"
    _dit_modules = ("transformer",)
    # ``image_encoder`` is the IP-adapter's CLIP vision model (absent unless one is loaded).
    _encoder_modules = ("text_encoder", "image_encoder")
    _vae_modules = ("vae",)
    _resident_modules = ()


class OmniChromaPipeline(ChromaComponents, OmniPipelineMixin, ChromaPipeline):
    """``ChromaPipeline`` with omni attention and offload."""


class OmniChromaImg2ImgPipeline(ChromaComponents, OmniPipelineMixin, ChromaImg2ImgPipeline):
    """``ChromaImg2ImgPipeline`` with omni attention and offload."""


class OmniChromaInpaintPipeline(ChromaComponents, OmniPipelineMixin, ChromaInpaintPipeline):
    """``ChromaInpaintPipeline`` with omni attention and offload."""
