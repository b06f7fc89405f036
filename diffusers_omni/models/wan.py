"""Wan 2.1 / 2.2 (``WanTransformer3DModel``): self-attention, text cross-attention, I2V image cross-attention."""

from __future__ import annotations

import torch
import torch.nn as nn
from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor

from ..attention.processors import routed_processor_class
from ..attention.backends.rainfusion.plan import VideoGeometry
from .base import CROSS, SELF, AttentionRole, AttentionSite, TransformerDeclaration, head_dim_of, register_transformer
from .base import NORM_PROJ_OUT, routed_processors

WAN_SELF = AttentionRole("wan.self", SELF)
WAN_CROSS = AttentionRole("wan.cross", CROSS)
WAN_IMAGE_CROSS = AttentionRole("wan.image_cross", CROSS)


# Diffusers' processor runs as it is, its attention calls routed to the module's roles by call site: ``attn1``
# makes one self-attention call; ``attn2`` one text cross-attention call and, for Wan 2.1 I2V (an ``attn2`` with
# ``add_k_proj``), the image cross-attention call whose output Diffusers adds to the text one (its result is
# ``hidden_states_img``: role ``wan.image_cross``).
OmniWanAttnProcessor = routed_processor_class(WanAttnProcessor)


def _video_geometry(model: nn.Module, args: tuple, kwargs: dict) -> VideoGeometry | None:
    """Self-attention runs over the patchified latent only: no prefix, grid ``(F/p_t, H/p_h, W/p_w)``."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if not isinstance(hidden, torch.Tensor) or hidden.ndim != 5:
        return None
    p_t, p_h, p_w = model.config.patch_size
    _, _, frames, height, width = hidden.shape
    return VideoGeometry(0, (frames // p_t, height // p_h, width // p_w))


def _find_sites(model: nn.Module) -> list[AttentionSite]:
    sites = []
    for name, module in model.named_modules():
        if not isinstance(module, WanAttention):
            continue
        if name.endswith("attn1"):
            roles = (WAN_SELF,)
        elif module.add_k_proj is not None:
            roles = (WAN_IMAGE_CROSS, WAN_CROSS)
        else:
            roles = (WAN_CROSS,)
        sites.append(AttentionSite(name, module, roles, head_dim_of(module)))
    return sites


WAN = register_transformer(
    TransformerDeclaration(
        name="wan",
        class_names=("WanTransformer3DModel",),
        blocks_attrs=("blocks",),
        tail_attrs=NORM_PROJ_OUT,
        find_sites=_find_sites,
        make_processor=routed_processors(WanAttnProcessor, calls={"hidden_states_img": WAN_IMAGE_CROSS}),
        mask_free=True,
        display_name="Wan 2.1 / 2.2",
        example_checkpoint="Wan-AI/Wan2.2-T2V-A14B-Diffusers",
        roles=(WAN_SELF, WAN_CROSS, WAN_IMAGE_CROSS),
        video_geometry=_video_geometry,
    )
)
