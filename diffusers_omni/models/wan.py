"""Wan 2.1 / 2.2 (``WanTransformer3DModel``): self-attention, text cross-attention, I2V image cross-attention."""

from __future__ import annotations

import torch
import torch.nn as nn
from diffusers.models.transformers.transformer_wan import (
    WanAttention,
    WanAttnProcessor,
    _get_added_kv_projections,
    _get_qkv_projections,
)

from ..attention.processors import OmniAttnProcessor, RoleAttention
from ..attention.rainfusion_plan import VideoGeometry
from .base import CROSS, SELF, AttentionRole, AttentionSite, TransformerDeclaration, head_dim_of, register_transformer
from .base import NORM_PROJ_OUT, processor_factory

WAN_SELF = AttentionRole("wan.self", SELF)
WAN_CROSS = AttentionRole("wan.cross", CROSS)
WAN_IMAGE_CROSS = AttentionRole("wan.image_cross", CROSS)

# Wan's I2V transformer receives [image tokens | 512 text tokens] in encoder_hidden_states.
_TEXT_CONTEXT_LEN = 512


def _rotate(hidden_states: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    x_even, x_odd = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x_even * cos - x_odd * sin
    out[..., 1::2] = x_even * sin + x_odd * cos
    return out.type_as(hidden_states)


class OmniWanAttnProcessor(OmniAttnProcessor):
    """Wan attention: ``attn1`` is self-attention, ``attn2`` text cross-attention plus, for Wan 2.1 I2V, an
    image cross-attention whose output is added to the text one."""

    def __init__(self, original, attend: dict[str, RoleAttention]) -> None:
        super().__init__(original, attend)
        self._main = attend.get(WAN_SELF.role) or attend[WAN_CROSS.role]
        self._image = attend.get(WAN_IMAGE_CROSS.role)

    def __call__(
        self,
        attn: WanAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        image_context = None
        if attn.add_k_proj is not None:
            image_len = encoder_hidden_states.shape[1] - _TEXT_CONTEXT_LEN
            image_context = encoder_hidden_states[:, :image_len]
            encoder_hidden_states = encoder_hidden_states[:, image_len:]

        query, key, value = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))

        if rotary_emb is not None:
            query = _rotate(query, *rotary_emb)
            key = _rotate(key, *rotary_emb)

        image_out = None
        if image_context is not None:
            image_key, image_value = _get_added_kv_projections(attn, image_context)
            image_key = attn.norm_added_k(image_key).unflatten(2, (attn.heads, -1))
            image_value = image_value.unflatten(2, (attn.heads, -1))
            image_out = self._image(query, image_key, image_value).flatten(2, 3).type_as(query)

        out = self._main(query, key, value, attn_mask=attention_mask).flatten(2, 3).type_as(query)
        if image_out is not None:
            out = out + image_out
        return attn.to_out[1](attn.to_out[0](out))


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
            roles = (WAN_CROSS, WAN_IMAGE_CROSS)
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
        make_processor=processor_factory(OmniWanAttnProcessor, WanAttnProcessor),
        mask_free=True,
        display_name="Wan 2.1 / 2.2",
        example_checkpoint="Wan-AI/Wan2.2-T2V-A14B-Diffusers",
        roles=(WAN_SELF, WAN_CROSS, WAN_IMAGE_CROSS),
        video_geometry=_video_geometry,
    )
)
