"""SDXL (``UNet2DConditionModel``): ``attn1`` self-attention and ``attn2`` text cross-attention in every
transformer layer of the down, mid and up blocks.

Diffusers' legacy ``AttnProcessor2_0`` calls ``F.scaled_dot_product_attention`` inline, with no
``dispatch_attention_fn`` seam to route: the omni processors are copies, in ``_classic`` (which says why). Roles:
``sdxl.self`` (``attn1``) and ``sdxl.cross`` (``attn2``, 77 CLIP tokens). SDXL pipelines pass no attention mask; a
mask given to the UNet (``encoder_attention_mask``) still reaches the backend, and a backend that takes none raises.

Perturbed-Attention Guidance (``StableDiffusionXLPAGPipeline``) puts ``PAGIdentitySelfAttnProcessor2_0`` (or its
CFG variant) on the chosen self-attention modules during a call; omni attention replaces those too (original path
through ``sdxl.self``, the perturbed path makes no attention call: identity attention is the value projection).

Blocks, in execution order: ``down_blocks``, ``mid_block``, ``up_blocks``. The mid block is a streamed unit of its
own rather than resident: in SDXL it holds ten transformer layers at the widest channel count (about a tenth of
the UNet's weights), and the offload planner can still keep it resident when the memory budget allows. The stem
and head (``conv_in``, time and added-condition embeddings, ``conv_norm_out``, ``conv_out``) stay resident.
"""

from __future__ import annotations

import torch.nn as nn
from diffusers.models.attention_processor import (
    Attention,
    PAGCFGIdentitySelfAttnProcessor2_0,
    PAGIdentitySelfAttnProcessor2_0,
)

from ..attention.processors import OmniAttnProcessor, RoleAttention
from ._classic import (
    _PLAIN,
    IP_ADAPTER_PROCESSORS,
    OmniLegacyAttnProcessor,
    OmniLegacyIPAdapterAttnProcessor,
    OmniPAGIdentitySelfAttnProcessor,
)
from .base import CROSS, SELF, AttentionRole, AttentionSite, TransformerDeclaration, head_dim_of, register_transformer
from .base import unsupported_processor_error, unwrap_processor

SDXL_SELF = AttentionRole("sdxl.self", SELF)
SDXL_CROSS = AttentionRole("sdxl.cross", CROSS)
SDXL_IP_ADAPTER = AttentionRole("sdxl.ip_adapter", CROSS)

_PAG_PROCESSORS = (PAGIdentitySelfAttnProcessor2_0, PAGCFGIdentitySelfAttnProcessor2_0)


def _find_sites(model: nn.Module) -> list[AttentionSite]:
    sites = []
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            roles = (SDXL_CROSS,) if module.is_cross_attention else (SDXL_SELF,)
            if isinstance(unwrap_processor(module.processor), IP_ADAPTER_PROCESSORS):
                roles += (SDXL_IP_ADAPTER,)
            sites.append(AttentionSite(name, module, roles, head_dim_of(module)))
    return sites


def _make_processor(site: AttentionSite, original, attend: dict[str, RoleAttention]) -> OmniAttnProcessor:
    original = unwrap_processor(original)
    if isinstance(original, _PAG_PROCESSORS):
        cfg = isinstance(original, PAGCFGIdentitySelfAttnProcessor2_0)
        return OmniPAGIdentitySelfAttnProcessor(original, attend, cfg=cfg)
    if isinstance(original, IP_ADAPTER_PROCESSORS):
        return OmniLegacyIPAdapterAttnProcessor(original, attend)
    # Exact types: other subclasses of these (custom diffusion, ...) do more than plain attention.
    if type(original) not in _PLAIN:
        raise unsupported_processor_error(site, original, (*_PLAIN, *IP_ADAPTER_PROCESSORS, *_PAG_PROCESSORS))
    return OmniLegacyAttnProcessor(original, attend)


SDXL = register_transformer(
    TransformerDeclaration(
        name="sdxl",
        class_names=("UNet2DConditionModel",),
        blocks_attrs=("down_blocks", "mid_block", "up_blocks"),
        find_sites=_find_sites,
        make_processor=_make_processor,
        mask_free=True,
        display_name="Stable Diffusion XL",
        example_checkpoint="stabilityai/stable-diffusion-xl-base-1.0",
        roles=(SDXL_SELF, SDXL_CROSS, SDXL_IP_ADAPTER),
    )
)
