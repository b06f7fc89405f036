"""LongCat-Image (``LongCatImageTransformer2DModel``): FLUX-like joint double-stream and single-stream blocks.

No attention mask on any path: text is padded to a fixed 512 tokens and attended like image tokens.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers import transformer_longcat_image as _longcat

from ..attention.processors import OmniAttnProcessor, RoleAttention
from .base import SELF, AttentionRole, AttentionSite, TransformerDeclaration, head_dim_of, register_transformer
from .base import NORM_PROJ_OUT, processor_factory

JOINT = AttentionRole("longcat.joint", SELF)
SINGLE = AttentionRole("longcat.single", SELF)


class OmniLongCatImageAttnProcessor(OmniAttnProcessor):
    """LongCat-Image attention through the backend resolved for the module's role.

    Mirrors ``LongCatImageAttnProcessor``: in double-stream blocks the text stream is concatenated in front of the
    image stream; single-stream blocks receive the already concatenated sequence. Fused QKV projections
    (``fuse_qkv_projections``) are read through Diffusers' own projection helper.
    """

    _get_qkv_projections = staticmethod(_longcat._get_qkv_projections)

    def __init__(self, original, attend: dict[str, RoleAttention]) -> None:
        super().__init__(original, attend)
        (self._attention,) = attend.values()

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        query, key, value, encoder_query, encoder_key, encoder_value = self._get_qkv_projections(
            attn, hidden_states, encoder_hidden_states
        )

        query = query.unflatten(-1, (attn.heads, -1))
        key = key.unflatten(-1, (attn.heads, -1))
        value = value.unflatten(-1, (attn.heads, -1))

        query = attn.norm_q(query)
        key = attn.norm_k(key)

        if attn.added_kv_proj_dim is not None:
            encoder_query = encoder_query.unflatten(-1, (attn.heads, -1))
            encoder_key = encoder_key.unflatten(-1, (attn.heads, -1))
            encoder_value = encoder_value.unflatten(-1, (attn.heads, -1))

            encoder_query = attn.norm_added_q(encoder_query)
            encoder_key = attn.norm_added_k(encoder_key)

            query = torch.cat([encoder_query, query], dim=1)
            key = torch.cat([encoder_key, key], dim=1)
            value = torch.cat([encoder_value, value], dim=1)

        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        hidden_states = self._attention(query, key, value, attn_mask=attention_mask)
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)

        if encoder_hidden_states is None:
            return hidden_states
        text_len = encoder_hidden_states.shape[1]
        encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
            [text_len, hidden_states.shape[1] - text_len], dim=1
        )
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        return hidden_states, encoder_hidden_states


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
        make_processor=processor_factory(OmniLongCatImageAttnProcessor, _longcat.LongCatImageAttnProcessor),
        mask_free=True,
        display_name="LongCat-Image",
        example_checkpoint="meituan-longcat/LongCat-Image",
        roles=(JOINT, SINGLE),
    )
)
