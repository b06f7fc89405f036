"""LongCat-Image (``LongCatImageTransformer2DModel``): FLUX-like joint double-stream and single-stream blocks.

No attention mask on any path: text is padded to a fixed 512 tokens and attended like image tokens.
"""

from __future__ import annotations

import torch.nn as nn
from diffusers.models.transformers import transformer_longcat_image as _longcat

from ..attention.processors import routed_processor_class
from .base import SELF, AttentionRole, AttentionSite, TransformerDeclaration, head_dim_of, register_transformer
from .base import NORM_PROJ_OUT, routed_processors

JOINT = AttentionRole("longcat.joint", SELF)
SINGLE = AttentionRole("longcat.single", SELF)


# Diffusers' processor runs as it is (fused QKV projections included), its one attention call per module routed to
# the module's role: ``longcat.joint`` in the double-stream blocks, ``longcat.single`` in the single-stream ones.
OmniLongCatImageAttnProcessor = routed_processor_class(_longcat.LongCatImageAttnProcessor)


def flux_like_sites(model: nn.Module, attention_cls: type, joint: AttentionRole, single: AttentionRole):
    """Sites of a FLUX-like model: ``single_transformer_blocks.*`` are single-stream, the others joint."""
    sites = []
    for name, module in model.named_modules():
        if isinstance(module, attention_cls):
            role = single if name.startswith("single_transformer_blocks.") else joint
            sites.append(AttentionSite(name, module, (role,), head_dim_of(module)))
    return sites


LONGCAT = register_transformer(
    TransformerDeclaration(
        name="longcat",
        class_names=("LongCatImageTransformer2DModel",),
        blocks_attrs=("transformer_blocks", "single_transformer_blocks"),
        tail_attrs=NORM_PROJ_OUT,
        find_sites=lambda model: flux_like_sites(model, _longcat.LongCatImageAttention, JOINT, SINGLE),
        make_processor=routed_processors(_longcat.LongCatImageAttnProcessor),
        mask_free=True,
        display_name="LongCat-Image",
        example_checkpoint="meituan-longcat/LongCat-Image",
        roles=(JOINT, SINGLE),
    )
)
