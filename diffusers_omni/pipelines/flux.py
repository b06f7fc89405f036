"""Omni FLUX.1 pipelines: every Diffusers 0.42 FLUX.1 pipeline built on ``FluxTransformer2DModel``.

Not covered: the ControlNet pipelines (``FluxControlNet*``, they add a ``FluxControlNetModel``) and
``FluxPriorReduxPipeline`` (an image-embedding prior with no transformer).
"""

from __future__ import annotations

from diffusers import (
    FluxControlImg2ImgPipeline,
    FluxControlInpaintPipeline,
    FluxControlPipeline,
    FluxFillPipeline,
    FluxImg2ImgPipeline,
    FluxInpaintPipeline,
    FluxKontextInpaintPipeline,
    FluxKontextPipeline,
    FluxPipeline,
)

from .mixin import OmniPipelineMixin


class FluxComponents:
    _omni_family = "flux"
    _dit_modules = ("transformer",)
    # ``image_encoder`` is the IP-adapter's CLIP vision model (absent unless one is loaded).
    _encoder_modules = ("text_encoder", "text_encoder_2", "image_encoder")
    _vae_modules = ("vae",)
    _resident_modules = ()


class OmniFluxPipeline(FluxComponents, OmniPipelineMixin, FluxPipeline):
    """``FluxPipeline`` with omni attention and offload."""


class OmniFluxImg2ImgPipeline(FluxComponents, OmniPipelineMixin, FluxImg2ImgPipeline):
    """``FluxImg2ImgPipeline`` with omni attention and offload."""


class OmniFluxInpaintPipeline(FluxComponents, OmniPipelineMixin, FluxInpaintPipeline):
    """``FluxInpaintPipeline`` with omni attention and offload."""


class OmniFluxFillPipeline(FluxComponents, OmniPipelineMixin, FluxFillPipeline):
    """``FluxFillPipeline`` (FLUX.1 Fill: inpainting/outpainting with mask channels) with omni attention and offload."""


class OmniFluxKontextPipeline(FluxComponents, OmniPipelineMixin, FluxKontextPipeline):
    """``FluxKontextPipeline`` (image editing: reference-image tokens join the sequence) with omni attention and
    offload."""


class OmniFluxKontextInpaintPipeline(FluxComponents, OmniPipelineMixin, FluxKontextInpaintPipeline):
    """``FluxKontextInpaintPipeline`` with omni attention and offload."""


class OmniFluxControlPipeline(FluxComponents, OmniPipelineMixin, FluxControlPipeline):
    """``FluxControlPipeline`` (FLUX.1 Canny/Depth: control latents concatenated on channels) with omni attention and
    offload."""


class OmniFluxControlImg2ImgPipeline(FluxComponents, OmniPipelineMixin, FluxControlImg2ImgPipeline):
    """``FluxControlImg2ImgPipeline`` with omni attention and offload."""


class OmniFluxControlInpaintPipeline(FluxComponents, OmniPipelineMixin, FluxControlInpaintPipeline):
    """``FluxControlInpaintPipeline`` with omni attention and offload."""
