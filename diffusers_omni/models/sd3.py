"""Stable Diffusion 3 / 3.5 (``SD3Transformer2DModel``): joint text+image attention, SD3.5-Medium's image-only
``attn2``, and Perturbed-Attention Guidance.

Every block's ``attn`` runs one joint attention over ``[image tokens | text tokens]`` (role ``sd3.joint``).
SD3.5-Medium (``dual_attention_layers`` set) adds an image-only self-attention ``attn2`` to the listed blocks
(role ``sd3.image_self``). Diffusers' own processors run (routed): their ``F.scaled_dot_product_attention`` calls go
to the roles.

Perturbed-Attention Guidance (``StableDiffusion3PAGPipeline``) puts ``PAGJointAttnProcessor2_0`` (or its CFG
variant) on the chosen blocks for the duration of a call. Omni attention replaces those too: the original path
goes through ``sd3.joint``; the perturbed path, whose image tokens attend only to themselves through an additive
``-inf`` mask, goes through its own masked role ``sd3.pag_identity``. The role appears on a module only while a PAG
processor is installed on it. PAG on a dual-attention ``attn2`` is refused: Diffusers' processor fails there too.

``fuse_qkv_projections()`` installs ``FusedJointAttnProcessor2_0``, which runs routed like the others; on an
SD3.5-Medium ``attn2`` (no text tokens), where Diffusers' fused processor fails, ``JointAttnProcessor2_0``'s code runs
for it on the unfused projections.

An IP-Adapter (``load_ip_adapter``, ``SD3IPAdapterJointAttnProcessor2_0``) adds a second attention per module: the
normalised image queries over the image keys followed by the IP-Adapter's image-prompt keys, through the role
``sd3.ip_adapter``. The IP-Adapter's image projection (``image_proj``, a small perceiver run once per step) keeps
Diffusers' own processors.
"""

from __future__ import annotations

import torch.nn as nn
from diffusers.models.attention_processor import (
    Attention,
    FusedJointAttnProcessor2_0,
    JointAttnProcessor2_0,
    PAGCFGJointAttnProcessor2_0,
    PAGJointAttnProcessor2_0,
    SD3IPAdapterJointAttnProcessor2_0,
)

from ..attention.processors import OmniAttnProcessor, RoleAttention
from .base import CROSS, SELF, AttentionRole, AttentionSite, TransformerDeclaration, head_dim_of, register_transformer
from .base import NORM_PROJ_OUT, routed_processors, unwrap_processor

SD3_JOINT = AttentionRole("sd3.joint", SELF)
SD3_IMAGE_SELF = AttentionRole("sd3.image_self", SELF)
SD3_PAG_IDENTITY = AttentionRole("sd3.pag_identity", SELF, masked=True)
SD3_IP_ADAPTER = AttentionRole("sd3.ip_adapter", CROSS)

_PAG_PROCESSORS = (PAGJointAttnProcessor2_0, PAGCFGJointAttnProcessor2_0)


def _find_sites(model: nn.Module) -> list[AttentionSite]:
    sites = []
    for name, module in model.named_modules():
        # The IP-Adapter's image projection (``image_proj``, a small perceiver) keeps Diffusers' processors.
        if not isinstance(module, Attention) or not name.startswith("transformer_blocks."):
            continue
        processor = unwrap_processor(module.processor)
        if name.endswith(".attn2"):
            roles = (SD3_IMAGE_SELF,)
        elif isinstance(processor, _PAG_PROCESSORS):
            roles = (SD3_JOINT, SD3_PAG_IDENTITY)
        else:
            roles = (SD3_JOINT,)
        if isinstance(processor, SD3IPAdapterJointAttnProcessor2_0):
            roles += (SD3_IP_ADAPTER,)
        sites.append(AttentionSite(name, module, roles, head_dim_of(module)))
    return sites


_JOINT_PROCESSORS = (JointAttnProcessor2_0, FusedJointAttnProcessor2_0)

# Diffusers' processors run as they are, their ``F.scaled_dot_product_attention`` calls routed: PAG's perturbed
# path (Diffusers names its result ``hidden_states_ptb``) through ``sd3.pag_identity``, the IP-Adapter attention
# (``ip_hidden_states``) through ``sd3.ip_adapter``, every other call through the module's own role. Diffusers'
# processors here drop an ``attention_mask`` without a word; omni attention refuses one instead.
_make_routed = routed_processors(
    *_JOINT_PROCESSORS, SD3IPAdapterJointAttnProcessor2_0, *_PAG_PROCESSORS,
    calls={"hidden_states_ptb": SD3_PAG_IDENTITY, "ip_hidden_states": SD3_IP_ADAPTER},
    refuse=("attention_mask",),
)

# ``fuse_qkv_projections()`` puts ``FusedJointAttnProcessor2_0`` on SD3.5-Medium's image-only ``attn2`` too, where it
# fails in Diffusers (it needs text tokens); there ``JointAttnProcessor2_0``'s code runs for it, on the unfused
# projections, which fusing keeps.
_make_image_self = routed_processors(
    FusedJointAttnProcessor2_0, stand_ins={FusedJointAttnProcessor2_0: JointAttnProcessor2_0}, refuse=("attention_mask",)
)


def _make_processor(site: AttentionSite, original, attend: dict[str, RoleAttention]) -> OmniAttnProcessor:
    if isinstance(unwrap_processor(original), _PAG_PROCESSORS) and SD3_PAG_IDENTITY.role not in attend:
        raise ValueError(
            f"attention module {site.name!r} is an SD3.5 dual-attention image-only attn2 and got "
            f"{type(unwrap_processor(original)).__name__}, which needs text tokens (Diffusers' own processor fails "
            "there too); choose pag_applied_layers outside the transformer's dual_attention_layers"
        )
    if type(unwrap_processor(original)) is FusedJointAttnProcessor2_0 and SD3_IMAGE_SELF in site.roles:
        return _make_image_self(site, original, attend)
    return _make_routed(site, original, attend)


SD3 = register_transformer(
    TransformerDeclaration(
        name="sd3",
        class_names=("SD3Transformer2DModel",),
        blocks_attrs=("transformer_blocks",),
        tail_attrs=NORM_PROJ_OUT,
        find_sites=_find_sites,
        make_processor=_make_processor,
        # Perturbed-Attention Guidance passes an additive identity mask on its perturbed path.
        mask_free=False,
        display_name="Stable Diffusion 3 / 3.5",
        example_checkpoint="stabilityai/stable-diffusion-3.5-medium",
        roles=(SD3_JOINT, SD3_IMAGE_SELF, SD3_PAG_IDENTITY, SD3_IP_ADAPTER),
    )
)
