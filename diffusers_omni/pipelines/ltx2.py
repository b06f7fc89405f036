"""Omni LTX-2 pipelines: every Diffusers 0.42 pipeline that runs ``LTX2VideoTransformer3DModel``.

The text connectors (``connectors``) are declared as a DiT too, so their self-attention gets omni attention and
their blocks can be streamed; they run once per prompt, before the denoising loop. The Gemma text encoder, the
optional prompt enhancer and the duration head are encoders; the video VAE, the audio VAE and the vocoder decode.
``LTX2VideoDiffusionDecodePipeline`` (a different decoder DiT) and ``LTX2LatentUpsamplePipeline`` (no DiT) are not
covered.
"""

from __future__ import annotations

from diffusers import (
    LTX2ConditionPipeline,
    LTX2DFRPipeline,
    LTX2DFRTemporalRefinePipeline,
    LTX2HDRPipeline,
    LTX2ImageToVideoPipeline,
    LTX2InContextPipeline,
    LTX2Pipeline,
)

from .mixin import OmniPipelineMixin


class LTX2Components:
    _omni_family = "ltx2"
    _dit_modules = ("transformer", "connectors")
    _encoder_modules = ("text_encoder", "prompt_enhancer", "duration_head")
    _vae_modules = ("vae", "audio_vae", "vocoder")
    _resident_modules = ()


class OmniLTX2Pipeline(LTX2Components, OmniPipelineMixin, LTX2Pipeline):
    """``LTX2Pipeline`` (text-to-video with audio) with omni attention and offload."""


class OmniLTX2ImageToVideoPipeline(LTX2Components, OmniPipelineMixin, LTX2ImageToVideoPipeline):
    """``LTX2ImageToVideoPipeline`` with omni attention and offload."""


class OmniLTX2ConditionPipeline(LTX2Components, OmniPipelineMixin, LTX2ConditionPipeline):
    """``LTX2ConditionPipeline`` (image/video conditions at any frame) with omni attention and offload."""


class OmniLTX2InContextPipeline(LTX2Components, OmniPipelineMixin, LTX2InContextPipeline):
    """``LTX2InContextPipeline`` (IC-LoRA reference conditioning) with omni attention and offload."""


class OmniLTX2HDRPipeline(LTX2Components, OmniPipelineMixin, LTX2HDRPipeline):
    """``LTX2HDRPipeline`` (HDR LoRA, video only) with omni attention and offload."""


class OmniLTX2DFRPipeline(LTX2Components, OmniPipelineMixin, LTX2DFRPipeline):
    """``LTX2DFRPipeline`` (keyframe layout) with omni attention and offload."""


class OmniLTX2DFRTemporalRefinePipeline(LTX2Components, OmniPipelineMixin, LTX2DFRTemporalRefinePipeline):
    """``LTX2DFRTemporalRefinePipeline`` with omni attention and offload; the temporal latent upsampler decodes
    alongside the VAEs."""

    _encoder_modules = ("text_encoder",)
    _vae_modules = ("vae", "audio_vae", "vocoder", "temporal_latent_upsampler")
