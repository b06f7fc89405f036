"""Omni Qwen-Image pipelines: text-to-image, img2img, inpaint, Edit, Edit Plus, Edit Inpaint and Layered.

All share ``QwenImageTransformer2DModel`` and the Qwen2.5-VL text encoder (whose vision tower encodes the input
image of the Edit pipelines). The ControlNet pipelines (``QwenImageControlNetPipeline``,
``QwenImageControlNetInpaintPipeline``) add a ControlNet model and are not covered; Qwen-Image 2.1
(``QwenImage21Pipeline``) has its own transformer class.
"""

from __future__ import annotations

from diffusers import (
    QwenImageEditInpaintPipeline,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImageImg2ImgPipeline,
    QwenImageInpaintPipeline,
    QwenImageLayeredPipeline,
    QwenImagePipeline,
)

from .mixin import OmniPipelineMixin


class QwenImageComponents:
    _omni_family = "qwenimage"
    _dit_modules = ("transformer",)
    _encoder_modules = ("text_encoder",)
    _vae_modules = ("vae",)
    _resident_modules = ()


class OmniQwenImagePipeline(QwenImageComponents, OmniPipelineMixin, QwenImagePipeline):
    """``QwenImagePipeline`` (text-to-image) with omni attention and offload."""


class OmniQwenImageImg2ImgPipeline(QwenImageComponents, OmniPipelineMixin, QwenImageImg2ImgPipeline):
    """``QwenImageImg2ImgPipeline`` with omni attention and offload."""


class OmniQwenImageInpaintPipeline(QwenImageComponents, OmniPipelineMixin, QwenImageInpaintPipeline):
    """``QwenImageInpaintPipeline`` with omni attention and offload."""


class OmniQwenImageEditPipeline(QwenImageComponents, OmniPipelineMixin, QwenImageEditPipeline):
    """``QwenImageEditPipeline`` with omni attention and offload."""


class OmniQwenImageEditPlusPipeline(QwenImageComponents, OmniPipelineMixin, QwenImageEditPlusPipeline):
    """``QwenImageEditPlusPipeline`` (several input images) with omni attention and offload."""


class OmniQwenImageEditInpaintPipeline(QwenImageComponents, OmniPipelineMixin, QwenImageEditInpaintPipeline):
    """``QwenImageEditInpaintPipeline`` with omni attention and offload."""


class OmniQwenImageLayeredPipeline(QwenImageComponents, OmniPipelineMixin, QwenImageLayeredPipeline):
    """``QwenImageLayeredPipeline`` (image decomposition into layers) with omni attention and offload."""
