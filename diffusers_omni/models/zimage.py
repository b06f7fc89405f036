"""Z-Image (``ZImageTransformer2DModel``): single-stream self-attention in three stages.

Forward order: the noise refiner (image tokens only), the context refiner (caption tokens only), for the Omni variant
a SigLIP refiner (condition-image tokens), then the main layers over the unified ``[image, caption]`` sequence. The
model has no ``set_attn_processor``; its attention modules are Diffusers ``Attention`` objects found by walking the
model.

Masks: each stage pads its batch to the longest item and builds a ``[B, S]`` boolean key-padding mask when lengths
differ. Captions are padded to a multiple of 32 tokens per prompt, so prompts (or a prompt and its negative prompt
under classifier-free guidance) whose padded lengths differ give the context refiner and the main layers a mask.
The noise refiner is masked only when the images of one batch differ in size, which no Diffusers pipeline of this
family produces (one height and width per call); a mask reaching a mask-less backend there raises at the call.
"""

from __future__ import annotations

import torch.nn as nn
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

from ..attention.processors import routed_processor_class
from .base import SELF, AttentionRole, AttentionSite, TransformerDeclaration, head_dim_of, register_transformer
from .base import routed_processors

NOISE_REFINER = AttentionRole("zimage.noise_refiner", SELF)
CONTEXT_REFINER = AttentionRole("zimage.context_refiner", SELF, masked=True)
SIGLIP_REFINER = AttentionRole("zimage.siglip_refiner", SELF, masked=True)
JOINT = AttentionRole("zimage.joint", SELF, masked=True)

_ROLE_BY_STAGE = {
    "noise_refiner": NOISE_REFINER,
    "context_refiner": CONTEXT_REFINER,
    "siglip_refiner": SIGLIP_REFINER,
    "layers": JOINT,
}


# Diffusers' processor runs as it is, its one attention call per module routed to the module's stage role. It views
# the stage's ``[B, S]`` padding mask (the same tensor in every layer of a stage) as ``[B, 1, 1, S]``; routed with
# that argument as the mask source, the backend gets the ``[B, S]`` tensor itself (backends read both layouts
# alike), so every layer of a stage passes the same mask and the all-True check runs once per stage and forward.
OmniZImageAttnProcessor = routed_processor_class(ZSingleStreamAttnProcessor, "OmniZImageAttnProcessor")


def _find_sites(model: nn.Module) -> list[AttentionSite]:
    sites = []
    for name, module in model.named_modules():
        if not isinstance(module, Attention):
            continue
        role = _ROLE_BY_STAGE.get(name.split(".", 1)[0])
        if role is None:
            raise TypeError(f"Z-Image attention module {name!r} is outside the known stages {list(_ROLE_BY_STAGE)}")
        sites.append(AttentionSite(name, module, (role,), head_dim_of(module)))
    return sites


ZIMAGE = register_transformer(
    TransformerDeclaration(
        name="zimage",
        class_names=("ZImageTransformer2DModel",),
        # The Omni variant's optional siglip_refiner (between context_refiner and layers) stays resident.
        blocks_attrs=("noise_refiner", "context_refiner", "layers"),
        find_sites=_find_sites,
        make_processor=routed_processors(ZSingleStreamAttnProcessor, mask_source="attention_mask"),
        mask_free=False,
        display_name="Z-Image",
        example_checkpoint="Tongyi-MAI/Z-Image-Turbo",
        roles=(NOISE_REFINER, CONTEXT_REFINER, SIGLIP_REFINER, JOINT),
    )
)
