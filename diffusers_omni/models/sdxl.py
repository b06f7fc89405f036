"""SDXL (``UNet2DConditionModel``): ``attn1`` self-attention and ``attn2`` text cross-attention in every
transformer layer of the down, mid and up blocks.

Diffusers' own processors run (routed): their ``F.scaled_dot_product_attention`` calls go to the roles. Roles:
``sdxl.self`` (``attn1``) and ``sdxl.cross`` (``attn2``, 77 CLIP tokens). SDXL pipelines pass no attention mask; a
mask given to the UNet (``encoder_attention_mask``) still reaches the backend, and a backend that takes none raises.

Perturbed-Attention Guidance (``StableDiffusionXLPAGPipeline``) puts ``PAGIdentitySelfAttnProcessor2_0`` (or its
CFG variant) on the chosen self-attention modules during a call; omni attention replaces those too (original path
through ``sdxl.self``, the perturbed path makes no attention call: identity attention is the value projection). An
IP-Adapter's image attention goes through ``sdxl.ip_adapter``.

Blocks, in execution order: ``down_blocks``, ``mid_block``, ``up_blocks``. The mid block is a streamed unit of its
own rather than resident: in SDXL it holds ten transformer layers at the widest channel count (about a tenth of
the UNet's weights), and the offload planner can still keep it resident when the memory budget allows. The stem
and head (``conv_in``, time and added-condition embeddings, ``conv_norm_out``, ``conv_out``) stay resident.
"""

from __future__ import annotations

import torch.nn as nn
from diffusers.models.attention_processor import (
    Attention,
    AttnProcessor,
    AttnProcessor2_0,
    FusedAttnProcessor2_0,
    IPAdapterAttnProcessor,
    IPAdapterAttnProcessor2_0,
    PAGCFGIdentitySelfAttnProcessor2_0,
    PAGIdentitySelfAttnProcessor2_0,
    SlicedAttnProcessor,
)

from .base import CROSS, SELF, AttentionRole, AttentionSite, TransformerDeclaration, head_dim_of, register_transformer
from .base import routed_processors, unwrap_processor

SDXL_SELF = AttentionRole("sdxl.self", SELF)
SDXL_CROSS = AttentionRole("sdxl.cross", CROSS)
SDXL_IP_ADAPTER = AttentionRole("sdxl.ip_adapter", CROSS)

# The processors of the legacy ``Attention`` path: ``AttnProcessor2_0`` and those Diffusers swaps in on it
# (``fuse_qkv_projections()``, ``enable_attention_slicing()``, ``set_default_attn_processor()``). Exact types:
# other subclasses (custom diffusion, ...) do more than plain attention.
PLAIN_PROCESSORS = (AttnProcessor2_0, AttnProcessor, FusedAttnProcessor2_0, SlicedAttnProcessor)
IP_ADAPTER_PROCESSORS = (IPAdapterAttnProcessor2_0, IPAdapterAttnProcessor)
_PAG_PROCESSORS = (PAGIdentitySelfAttnProcessor2_0, PAGCFGIdentitySelfAttnProcessor2_0)

# Diffusers' ``AttnProcessor``, ``SlicedAttnProcessor`` and ``IPAdapterAttnProcessor`` attend with an explicit
# softmax: no call to route. The ``2_0`` class of each runs for them on the same attributes (sliced as Diffusers
# slices, one backend call per slice, for ``SlicedAttnProcessor``); ``TORCH_SDPA`` then matches ``AttnProcessor2_0``
# bit for bit (the explicit softmax differs from SDPA in the last bits).
STAND_INS = {
    AttnProcessor: AttnProcessor2_0,
    SlicedAttnProcessor: AttnProcessor2_0,
    IPAdapterAttnProcessor: IPAdapterAttnProcessor2_0,
}

# Diffusers' processors run as they are, their ``F.scaled_dot_product_attention`` calls routed: the IP-Adapters'
# image attention (Diffusers names its result ``current_ip_hidden_states``, ``_current_ip_hidden_states`` with
# masks) through ``sdxl.ip_adapter``, every other call through the module's own role.
make_legacy_processor = routed_processors(
    *PLAIN_PROCESSORS, *IP_ADAPTER_PROCESSORS, *_PAG_PROCESSORS,
    calls={"current_ip_hidden_states": SDXL_IP_ADAPTER, "_current_ip_hidden_states": SDXL_IP_ADAPTER},
    stand_ins=STAND_INS,
)


def _find_sites(model: nn.Module) -> list[AttentionSite]:
    sites = []
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            roles = (SDXL_CROSS,) if module.is_cross_attention else (SDXL_SELF,)
            if isinstance(unwrap_processor(module.processor), IP_ADAPTER_PROCESSORS):
                roles += (SDXL_IP_ADAPTER,)
            sites.append(AttentionSite(name, module, roles, head_dim_of(module)))
    return sites


SDXL = register_transformer(
    TransformerDeclaration(
        name="sdxl",
        class_names=("UNet2DConditionModel",),
        blocks_attrs=("down_blocks", "mid_block", "up_blocks"),
        find_sites=_find_sites,
        make_processor=make_legacy_processor,
        mask_free=True,
        display_name="Stable Diffusion XL",
        example_checkpoint="stabilityai/stable-diffusion-xl-base-1.0",
        roles=(SDXL_SELF, SDXL_CROSS, SDXL_IP_ADAPTER),
    )
)
