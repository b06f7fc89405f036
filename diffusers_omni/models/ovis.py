"""Ovis-Image (``OvisImageTransformer2DModel``): FLUX-like joint double-stream and single-stream blocks.

No attention mask on any path: the text is padded to a fixed length and attended like image tokens.
"""

from __future__ import annotations

from diffusers.models.transformers import transformer_ovis_image as _ovis

from ..attention.processors import routed_processor_class
from .base import NORM_PROJ_OUT, SELF, AttentionRole, TransformerDeclaration, register_transformer, routed_processors
from .longcat import flux_like_sites

JOINT = AttentionRole("ovis.joint", SELF)
SINGLE = AttentionRole("ovis.single", SELF)


# Diffusers' processor runs as it is, its one attention call per module routed to the module's role.
OmniOvisImageAttnProcessor = routed_processor_class(_ovis.OvisImageAttnProcessor)


OVIS = register_transformer(
    TransformerDeclaration(
        name="ovis",
        class_names=("OvisImageTransformer2DModel",),
        blocks_attrs=("transformer_blocks", "single_transformer_blocks"),
        tail_attrs=NORM_PROJ_OUT,
        find_sites=lambda model: flux_like_sites(model, _ovis.OvisImageAttention, JOINT, SINGLE),
        make_processor=routed_processors(_ovis.OvisImageAttnProcessor),
        mask_free=True,
        display_name="Ovis-Image",
        example_checkpoint="AIDC-AI/Ovis-Image-7B",
        roles=(JOINT, SINGLE),
    )
)
