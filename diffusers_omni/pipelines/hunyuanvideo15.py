"""Omni HunyuanVideo-1.5 pipelines (text-to-video and image-to-video share ``HunyuanVideo15Transformer3DModel``)."""

from __future__ import annotations

from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline

from .mixin import OmniPipelineMixin


class HunyuanVideo15Components:
    _omni_family = "hunyuanvideo15"
    _dit_modules = ("transformer",)
    # Qwen2.5-VL (prompt) and ByT5 (glyph text).
    _encoder_modules = ("text_encoder", "text_encoder_2")
    _vae_modules = ("vae",)
    _resident_modules = ()


class OmniHunyuanVideo15Pipeline(HunyuanVideo15Components, OmniPipelineMixin, HunyuanVideo15Pipeline):
    """``HunyuanVideo15Pipeline`` (text-to-video) with omni attention and offload."""


class OmniHunyuanVideo15ImageToVideoPipeline(
    HunyuanVideo15Components, OmniPipelineMixin, HunyuanVideo15ImageToVideoPipeline
):
    """``HunyuanVideo15ImageToVideoPipeline`` with omni attention and offload; the SigLIP image encoder is an
    encoder too."""

    _encoder_modules = ("text_encoder", "text_encoder_2", "image_encoder")
