"""FLUX.1 (``FluxTransformer2DModel``): joint double-stream blocks and single-stream blocks."""

from __future__ import annotations

import torch
import torch.nn as nn
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxAttention, FluxAttnProcessor, _get_qkv_projections

from ..attention.processors import OmniAttnProcessor, RoleAttention
from .base import SELF, AttentionRole, AttentionSite, TransformerDeclaration, head_dim_of, register_transformer
from .base import unsupported_processor_error

JOINT = AttentionRole("flux.joint", SELF)
SINGLE = AttentionRole("flux.single", SELF)


class OmniFluxAttnProcessor(OmniAttnProcessor):
    """FLUX.1 attention through the backend resolved for the module's role.

    The text stream (when present) is concatenated in front of the image stream, rotary embeddings are applied
    to both, and one attention call covers the joint sequence.
    """

    def __init__(self, original, attend: dict[str, RoleAttention]) -> None:
        super().__init__(original, attend)
        (self._attention,) = attend.values()

    def __call__(
        self,
        attn: FluxAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        query, key, value, text_query, text_key, text_value = _get_qkv_projections(
            attn, hidden_states, encoder_hidden_states
        )
        query = attn.norm_q(query.unflatten(-1, (-1, attn.head_dim)))
        key = attn.norm_k(key.unflatten(-1, (-1, attn.head_dim)))
        value = value.unflatten(-1, (-1, attn.head_dim))

        if attn.added_kv_proj_dim is not None:
            text_query = attn.norm_added_q(text_query.unflatten(-1, (-1, attn.head_dim)))
            text_key = attn.norm_added_k(text_key.unflatten(-1, (-1, attn.head_dim)))
            text_value = text_value.unflatten(-1, (-1, attn.head_dim))
            query = torch.cat([text_query, query], dim=1)
            key = torch.cat([text_key, key], dim=1)
            value = torch.cat([text_value, value], dim=1)

        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        out = self._attention(query, key, value, attn_mask=attention_mask)
        out = out.flatten(2, 3).to(query.dtype)

        if encoder_hidden_states is None:
            return out
        text_len = encoder_hidden_states.shape[1]
        text_out, image_out = out.split_with_sizes([text_len, out.shape[1] - text_len], dim=1)
        image_out = attn.to_out[1](attn.to_out[0](image_out.contiguous()))
        text_out = attn.to_add_out(text_out.contiguous())
        return image_out, text_out


def _find_sites(model: nn.Module) -> list[AttentionSite]:
    sites = []
    for name, module in model.named_modules():
        if not isinstance(module, FluxAttention):
            continue
        role = SINGLE if name.startswith("single_transformer_blocks.") else JOINT
        sites.append(AttentionSite(name, module, (role,), head_dim_of(module)))
    return sites


def _make_processor(site: AttentionSite, original, attend: dict[str, RoleAttention]) -> OmniFluxAttnProcessor:
    if not isinstance(original, (FluxAttnProcessor, OmniFluxAttnProcessor)):
        raise unsupported_processor_error(site, original, (FluxAttnProcessor,))
    if isinstance(original, OmniFluxAttnProcessor):
        original = original.original
    return OmniFluxAttnProcessor(original, attend)


FLUX = register_transformer(
    TransformerDeclaration(
        name="flux",
        class_names=("FluxTransformer2DModel",),
        blocks_attrs=("transformer_blocks", "single_transformer_blocks"),
        find_sites=_find_sites,
        make_processor=_make_processor,
        mask_free=True,
        display_name="FLUX.1",
        example_checkpoint="black-forest-labs/FLUX.1-dev",
        roles=(JOINT, SINGLE),
    )
)
