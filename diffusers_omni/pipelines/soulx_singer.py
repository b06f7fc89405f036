"""Omni SoulX-Singer pipelines: singing voice synthesis and conversion.

The DiT is the flow-matching estimator ``cfm_decoder.model.diff_estimator`` (``DiffLlama``); its condition
projection ``cfm_decoder.model.cond_emb`` runs once a call, before the sampling loop, and stays resident. The
condition encoder and the mel front end (and, for SVC, the Whisper encoder) are the encoders; the vocoder plays the
VAE's part.
"""

from __future__ import annotations

from ..architectures.soulx_singer import SoulXSingerPipeline, SoulXSingerSVCPipeline
from .mixin import OmniPipelineMixin


class SoulXSingerComponents:
    _omni_family = "soulx_singer"
    _dit_modules = ("cfm_decoder.model.diff_estimator",)
    _encoder_modules = ("condition_encoder", "mel")
    _vae_modules = ("vocoder",)
    _resident_modules = ("cfm_decoder.model.cond_emb",)


class OmniSoulXSingerPipeline(SoulXSingerComponents, OmniPipelineMixin, SoulXSingerPipeline):
    """``SoulXSingerPipeline`` (singing voice synthesis) with omni attention and offload."""


class OmniSoulXSingerSVCPipeline(SoulXSingerComponents, OmniPipelineMixin, SoulXSingerSVCPipeline):
    """``SoulXSingerSVCPipeline`` (singing voice conversion) with omni attention and offload; the Whisper encoder is
    an encoder too."""

    _encoder_modules = ("whisper_encoder", "condition_encoder", "mel")
