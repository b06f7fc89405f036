"""Omni Cosmos3 pipeline.

Cosmos3's transformer is also its reasoner: the prompt is tokenised (no separate text encoder) and embedded by the
transformer's own ``embed_tokens``, and the understanding pathway runs inside every denoising step. So the one
DiT is the only "encoder" as well; a split-model offload must treat ``transformer`` as a DiT whose blocks
(``layers``) stream, while its embedding table, rotary embedding, final norms and modality heads (everything
outside ``layers``) stay resident with it. The Wan VAE and the optional sound tokenizer decode.
"""

from __future__ import annotations

from diffusers import Cosmos3OmniPipeline

from .mixin import OmniPipelineMixin


class Cosmos3Components:
    _omni_family = "cosmos3"
    _dit_modules = ("transformer",)
    # No separate text encoder: the transformer embeds the prompt tokens itself.
    _encoder_modules = ()
    _vae_modules = ("vae", "sound_tokenizer")
    # The embedding table, used by the understanding pass of every step, lies outside ``layers``, so layerwise
    # offload keeps it on the device with the rest of the non-block weights; declaring it resident as well would
    # nest a component inside the DiT, which model-level offload (whole-component moves) refuses.
    _resident_modules = ()


class OmniCosmos3OmniPipeline(Cosmos3Components, OmniPipelineMixin, Cosmos3OmniPipeline):
    """``Cosmos3OmniPipeline`` (text/image-to-video, with sound and action heads) with omni attention and
    offload."""
