"""Omni SDXL pipelines, including InstructPix2Pix (edit) and Perturbed-Attention Guidance (PAG).

Not covered: ControlNet, ControlNet-Union, ControlNet-XS and T2I-Adapter pipelines (they add a controlnet or
adapter model), Kolors (a ChatGLM text encoder, its own family), AnimateDiff-SDXL (``UNetMotionModel``) and the
modular pipelines.
"""

from __future__ import annotations

from diffusers import (
    StableDiffusionXLImg2ImgPipeline,
    StableDiffusionXLInpaintPipeline,
    StableDiffusionXLInstructPix2PixPipeline,
    StableDiffusionXLPAGImg2ImgPipeline,
    StableDiffusionXLPAGInpaintPipeline,
    StableDiffusionXLPAGPipeline,
    StableDiffusionXLPipeline,
)

from .mixin import OmniPipelineMixin
from .sd3 import OmniPAGMixin


class SDXLComponents:
    _omni_family = "sdxl"
    _dit_modules = ("unet",)
    _encoder_modules = ("text_encoder", "text_encoder_2", "image_encoder")
    _vae_modules = ("vae",)
    _resident_modules = ()


class OmniStableDiffusionXLPipeline(SDXLComponents, OmniPipelineMixin, StableDiffusionXLPipeline):
    """``StableDiffusionXLPipeline`` with omni attention and offload."""


class OmniStableDiffusionXLImg2ImgPipeline(SDXLComponents, OmniPipelineMixin, StableDiffusionXLImg2ImgPipeline):
    """``StableDiffusionXLImg2ImgPipeline`` (also the SDXL refiner) with omni attention and offload."""


class OmniStableDiffusionXLInpaintPipeline(SDXLComponents, OmniPipelineMixin, StableDiffusionXLInpaintPipeline):
    """``StableDiffusionXLInpaintPipeline`` with omni attention and offload."""


class OmniStableDiffusionXLInstructPix2PixPipeline(
    SDXLComponents, OmniPipelineMixin, StableDiffusionXLInstructPix2PixPipeline
):
    """``StableDiffusionXLInstructPix2PixPipeline`` (instruction editing) with omni attention and offload."""


class OmniStableDiffusionXLPAGPipeline(SDXLComponents, OmniPAGMixin, OmniPipelineMixin, StableDiffusionXLPAGPipeline):
    """``StableDiffusionXLPAGPipeline`` with omni attention (PAG layers included) and offload."""


class OmniStableDiffusionXLPAGImg2ImgPipeline(
    SDXLComponents, OmniPAGMixin, OmniPipelineMixin, StableDiffusionXLPAGImg2ImgPipeline
):
    """``StableDiffusionXLPAGImg2ImgPipeline`` with omni attention (PAG layers included) and offload."""


class OmniStableDiffusionXLPAGInpaintPipeline(
    SDXLComponents, OmniPAGMixin, OmniPipelineMixin, StableDiffusionXLPAGInpaintPipeline
):
    """``StableDiffusionXLPAGInpaintPipeline`` with omni attention (PAG layers included) and offload."""
