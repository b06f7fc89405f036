"""Ovis-Image (``OvisImageTransformer2DModel``): FLUX-like joint double-stream and single-stream blocks.

No attention mask on any path: the text is padded to a fixed length and attended like image tokens. The processor
is operation for operation the same as LongCat-Image's; only the Diffusers classes differ.
"""

from __future__ import annotations

from diffusers.models.transformers import transformer_ovis_image as _ovis

from .base import NORM_PROJ_OUT, SELF, AttentionRole, TransformerDeclaration, processor_factory, register_transformer
from .longcat import OmniLongCatImageAttnProcessor, flux_like_sites

JOINT = AttentionRole("ovis.joint", SELF)
SINGLE = AttentionRole("ovis.single", SELF)


class OmniOvisImageAttnProcessor(OmniLongCatImageAttnProcessor):
    """Ovis-Image attention through the backend resolved for the module's role (mirrors ``OvisImageAttnProcessor``)."""

    _get_qkv_projections = staticmethod(_ovis._get_qkv_projections)


OVIS = register_transformer(
    TransformerDeclaration(
        name="ovis",
        class_names=("OvisImageTransformer2DModel",),
        blocks_attrs=("transformer_blocks", "single_transformer_blocks"),
        tail_attrs=NORM_PROJ_OUT,
        find_sites=lambda model: flux_like_sites(model, _ovis.OvisImageAttention, JOINT, SINGLE),
        make_processor=processor_factory(OmniOvisImageAttnProcessor, _ovis.OvisImageAttnProcessor),
        mask_free=True,
        display_name="Ovis-Image",
        example_checkpoint="AIDC-AI/Ovis-Image-7B",
        roles=(JOINT, SINGLE),
    )
)
