"""Omni Z-Image pipelines: text-to-image, img2img, inpaint and Omni (SigLIP-conditioned editing).

All share ``ZImageTransformer2DModel`` and the Qwen3 text encoder. The ControlNet pipelines
(``ZImageControlNetPipeline``, ``ZImageControlNetInpaintPipeline``) add a ControlNet model and are not covered.
"""

from __future__ import annotations

from diffusers import ZImageImg2ImgPipeline, ZImageInpaintPipeline, ZImageOmniPipeline, ZImagePipeline

from .mixin import OmniPipelineMixin


class ZImageComponents:
    _omni_family = "zimage"
    _dit_modules = ("transformer",)
    _encoder_modules = ("text_encoder",)
    _vae_modules = ("vae",)
    _resident_modules = ()


class OmniZImagePipeline(ZImageComponents, OmniPipelineMixin, ZImagePipeline):
    """``ZImagePipeline`` (text-to-image) with omni attention and offload."""


class OmniZImageImg2ImgPipeline(ZImageComponents, OmniPipelineMixin, ZImageImg2ImgPipeline):
    """``ZImageImg2ImgPipeline`` with omni attention and offload."""


class OmniZImageInpaintPipeline(ZImageComponents, OmniPipelineMixin, ZImageInpaintPipeline):
    """``ZImageInpaintPipeline`` with omni attention and offload."""


class OmniZImageOmniPipeline(ZImageComponents, OmniPipelineMixin, ZImageOmniPipeline):
    """``ZImageOmniPipeline`` with omni attention and offload; the SigLIP vision model is an encoder too."""

    _encoder_modules = ("text_encoder", "siglip")
