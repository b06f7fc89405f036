"""Omni Wan 2.1 / 2.2 pipelines (Wan 2.2 A14B adds ``transformer_2``, the low-noise expert)."""

from __future__ import annotations

from diffusers import WanImageToVideoPipeline, WanPipeline, WanVideoToVideoPipeline

from .mixin import OmniPipelineMixin


class WanComponents:
    _omni_family = "wan"
    _dit_modules = ("transformer", "transformer_2")
    # Wan 2.2 A14B: each denoising step runs one expert (high noise, then low noise past boundary_ratio), so under
    # a host budget the experts' blocks may share host buffers.
    _alternating_dits = ("transformer", "transformer_2")
    _encoder_modules = ("text_encoder",)
    _vae_modules = ("vae",)
    _resident_modules = ()


class OmniWanPipeline(WanComponents, OmniPipelineMixin, WanPipeline):
    """``WanPipeline`` (text-to-video) with omni attention and offload."""


class OmniWanImageToVideoPipeline(WanComponents, OmniPipelineMixin, WanImageToVideoPipeline):
    """``WanImageToVideoPipeline`` with omni attention and offload; the image encoder is an encoder too."""

    _encoder_modules = ("text_encoder", "image_encoder")


class OmniWanVideoToVideoPipeline(WanComponents, OmniPipelineMixin, WanVideoToVideoPipeline):
    """``WanVideoToVideoPipeline`` with omni attention and offload."""
