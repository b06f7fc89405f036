"""Omni BAGEL pipeline (``BagelPipeline``, text-to-image).

BAGEL's language model is its text encoder and its denoiser at once: ``bagel.language_model.model``
(``Qwen2MoTModel``) reads the prompt into its key/value cache, then predicts every step's velocity against that
cache. It is the DiT here; its ``layers`` stream under layerwise offload, and its embedding table and final norms
stay on the device with it. BAGEL's other modules ("customized modules": the timestep embedder, the latent
projections and position table, the LM head, the vision tower and its connector) are small or unused by
text-to-image and stay resident. Model-level offload, which swaps whole components between phases, has no phase
to swap here (the one model runs in every phase) and is refused.
"""

from __future__ import annotations

from typing import Any

from ..architectures.bagel import BagelPipeline
from .mixin import OmniPipelineMixin


class BagelComponents:
    _omni_family = "bagel"
    _model_level_offload = False  # refused: see enable_omni_model_cpu_offload
    _dit_modules = ("bagel.language_model.model",)
    _encoder_modules = ()
    _vae_modules = ("vae",)
    _resident_modules = (
        "bagel.time_embedder",
        "bagel.vae2llm",
        "bagel.llm2vae",
        "bagel.latent_pos_embed",
        "bagel.language_model.lm_head",
        "bagel.vit_model",
        "bagel.connector",
        "bagel.vit_pos_embed",
    )


class OmniBagelPipeline(BagelComponents, OmniPipelineMixin, BagelPipeline):
    """``BagelPipeline`` with omni attention and layerwise offload."""

    def enable_omni_model_cpu_offload(self, config: Any) -> Any:
        raise ValueError(
            "model-level offload is not supported for BagelPipeline: BAGEL's language model "
            "(bagel.language_model.model) is both its prompt encoder and its denoiser, so it runs in every phase "
            "and there is no component to swap out; use layerwise offload (enable_layerwise_offload, or "
            "--offload layerwise), which streams its decoder layers"
        )
