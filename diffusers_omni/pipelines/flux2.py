"""Omni FLUX.2 pipelines (``Flux2Transformer2DModel``): FLUX.2 [dev] and the Klein variants.

``Flux2KleinKVPipeline`` installs KV-cache processors on the shared transformer in its ``__init__`` (also when
``omnify`` builds the Omni class from it); omni attention replaces those like any other, and re-applies itself
when a later pipeline swaps them again.
"""

from __future__ import annotations

from diffusers import Flux2KleinInpaintPipeline, Flux2KleinKVPipeline, Flux2KleinPipeline, Flux2Pipeline

from .mixin import OmniPipelineMixin


class Flux2Components:
    _omni_family = "flux2"
    _dit_modules = ("transformer",)
    _encoder_modules = ("text_encoder",)
    _vae_modules = ("vae",)
    _resident_modules = ()


class OmniFlux2Pipeline(Flux2Components, OmniPipelineMixin, Flux2Pipeline):
    """``Flux2Pipeline`` (FLUX.2 [dev], Mistral3 text encoder) with omni attention and offload."""


class OmniFlux2KleinPipeline(Flux2Components, OmniPipelineMixin, Flux2KleinPipeline):
    """``Flux2KleinPipeline`` (FLUX.2 [klein], Qwen3 text encoder; text-to-image and reference editing) with omni
    attention and offload."""


class OmniFlux2KleinInpaintPipeline(Flux2Components, OmniPipelineMixin, Flux2KleinInpaintPipeline):
    """``Flux2KleinInpaintPipeline`` with omni attention and offload."""


class OmniFlux2KleinKVPipeline(Flux2Components, OmniPipelineMixin, Flux2KleinKVPipeline):
    """``Flux2KleinKVPipeline`` (reference-image K/V cached on the first step) with omni attention and offload."""
