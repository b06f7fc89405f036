"""SDXL (``UNet2DConditionModel``): ``attn1`` self-attention and ``attn2`` text cross-attention in every
transformer layer of the down, mid and up blocks.

Diffusers' legacy ``AttnProcessor2_0`` calls ``F.scaled_dot_product_attention`` on ``[B, H, S, D]`` tensors; the
omni processors build the same tensors in the same order and hand their ``[B, S, H, D]`` transposes to the
backend, so ``TORCH_SDPA`` runs the very same SDPA call. Roles: ``sdxl.self`` (``attn1``) and ``sdxl.cross``
(``attn2``, 77 CLIP tokens). SDXL pipelines pass no attention mask; a mask given to the UNet
(``encoder_attention_mask``) still reaches the backend, and a backend that takes none raises.

Perturbed-Attention Guidance (``StableDiffusionXLPAGPipeline``) puts ``PAGIdentitySelfAttnProcessor2_0`` (or its
CFG variant) on the chosen self-attention modules during a call; omni attention replaces those too (original path
through ``sdxl.self``, the perturbed path makes no attention call: identity attention is the value projection).

Blocks, in execution order: ``down_blocks``, ``mid_block``, ``up_blocks``. The mid block is a streamed unit of its
own rather than resident: in SDXL it holds ten transformer layers at the widest channel count (about a tenth of
the UNet's weights), and the offload planner can still keep it resident when the memory budget allows. The stem
and head (``conv_in``, time and added-condition embeddings, ``conv_norm_out``, ``conv_out``) stay resident.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from diffusers.models.attention_processor import (
    Attention,
    PAGCFGIdentitySelfAttnProcessor2_0,
    PAGIdentitySelfAttnProcessor2_0,
)

from ..attention.processors import OmniAttnProcessor, RoleAttention
from ._legacy import (
    _PLAIN,
    IP_ADAPTER_PROCESSORS,
    OmniLegacyAttnProcessor,
    OmniLegacyIPAdapterAttnProcessor,
    _attention_core,
    _out_projection,
    _spatial,
    _tokens_last,
)
from .base import CROSS, SELF, AttentionRole, AttentionSite, TransformerDeclaration, head_dim_of, register_transformer
from .base import unsupported_processor_error

SDXL_SELF = AttentionRole("sdxl.self", SELF)
SDXL_CROSS = AttentionRole("sdxl.cross", CROSS)
SDXL_IP_ADAPTER = AttentionRole("sdxl.ip_adapter", CROSS)

_PAG_PROCESSORS = (PAGIdentitySelfAttnProcessor2_0, PAGCFGIdentitySelfAttnProcessor2_0)


class OmniPAGIdentitySelfAttnProcessor(OmniAttnProcessor):
    """``PAGIdentitySelfAttnProcessor2_0`` / ``PAGCFGIdentitySelfAttnProcessor2_0`` through the resolved backend.

    The batch is ``[original | perturbed]`` (``[uncond | cond | perturbed]`` with classifier-free guidance); the
    original half runs self-attention (``sdxl.self``), the perturbed half identity attention (no attention call).
    """

    def __init__(self, original, attend: dict[str, RoleAttention], cfg: bool) -> None:
        super().__init__(original, attend)
        self.cfg = cfg
        (self._attention,) = attend.values()

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states, shape = _tokens_last(attn, hidden_states, temb)
        if self.cfg:
            uncond, org, ptb = hidden_states.chunk(3)
            org = torch.cat([uncond, org])
        else:
            org, ptb = hidden_states.chunk(2)

        # Like Diffusers, the original path ignores encoder_hidden_states: PAG layers are self-attention.
        out_org, query, _ = _attention_core(self._attention, attn, org, None, attention_mask, qk_norm=False)
        out_org = _spatial(_out_projection(attn, out_org), None if shape is None else (org.shape[0], *shape[1:]))

        if attn.group_norm is not None:
            ptb = attn.group_norm(ptb.transpose(1, 2)).transpose(1, 2)
        ptb = _out_projection(attn, attn.to_v(ptb).to(query.dtype))
        ptb = _spatial(ptb, None if shape is None else (ptb.shape[0], *shape[1:]))

        hidden_states = torch.cat([out_org, ptb])
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


def _unwrap(processor):
    return processor.original if isinstance(processor, OmniAttnProcessor) else processor


def _find_sites(model: nn.Module) -> list[AttentionSite]:
    sites = []
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            roles = (SDXL_CROSS,) if module.is_cross_attention else (SDXL_SELF,)
            if isinstance(_unwrap(module.processor), IP_ADAPTER_PROCESSORS):
                roles += (SDXL_IP_ADAPTER,)
            sites.append(AttentionSite(name, module, roles, head_dim_of(module)))
    return sites


def _make_processor(site: AttentionSite, original, attend: dict[str, RoleAttention]) -> OmniAttnProcessor:
    original = _unwrap(original)
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
