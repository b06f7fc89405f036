"""Omni NextStep-1.1 pipeline.

``NextStep11Pipeline`` (``diffusers_omni.architectures.nextstep``) has one backbone, ``model``, which is both the
prompt reader and the image-token writer: there is no separate text encoder. Layerwise offload streams its decoder
``layers``; everything else of it (embeddings, final norm, language-model head, image projectors and the
flow-matching head, which runs several times per image token) stays on the device. Model-level offload would only
ever hold the one backbone on the device and is refused (as in vLLM-Omni, which lists no model-level offload for
this pipeline).
"""

from __future__ import annotations

from typing import Any

from ..architectures.nextstep import NextStep11Pipeline
from .mixin import OmniPipelineMixin


class NextStepComponents:
    _omni_family = "nextstep"
    _dit_modules = ("model",)
    _encoder_modules = ()
    _vae_modules = ("vae",)
    _resident_modules = ()


class OmniNextStep11Pipeline(NextStepComponents, OmniPipelineMixin, NextStep11Pipeline):
    """``NextStep11Pipeline`` (text-to-image) with omni attention and layerwise offload."""

    _model_level_offload = False  # read by the CLI to refuse ``--offload model-level`` before loading

    def enable_omni_offload(self, config: Any) -> Any:
        from ..config.offload import ModelLevelOffloadConfig

        if isinstance(config, ModelLevelOffloadConfig):
            raise ValueError(
                "NextStep11Pipeline does not support model-level offload: its one backbone ('model') reads the "
                "prompt and writes every image token, so it would never leave the device. Use layerwise offload "
                "(enable_layerwise_offload), which streams its decoder layers."
            )
        return super().enable_omni_offload(config)
