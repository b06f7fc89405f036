"""Cosmos3 (``Cosmos3OmniTransformer``): one packed mixture-of-transformers that is both the reasoner and the
generator.

Every decoder layer's ``self_attn`` (``Cosmos3PackedMoTAttention``) makes two attention calls, both with grouped
query attention (fewer key/value heads than query heads) and no mask tensor:

* ``cosmos3.understanding``: the understanding (text/reasoning) tokens attend to themselves causally
  (``is_causal=True``);
* ``cosmos3.generation``: the generation (vision/sound/action) tokens attend to the understanding and generation
  keys together, without a mask (``is_causal=False``).

``is_causal`` and ``enable_gqa`` reach the resolved backend exactly as Diffusers passes them to
``dispatch_attention_fn``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from diffusers.models.transformers.transformer_cosmos3 import (
    Cosmos3AttnProcessor,
    Cosmos3PackedMoTAttention,
    _rotate_half,
)

from ..attention.processors import OmniAttnProcessor, RoleAttention
from .base import SELF, AttentionRole, AttentionSite, TransformerDeclaration, register_transformer
from .base import unsupported_processor_error

UNDERSTANDING = AttentionRole("cosmos3.understanding", SELF, gqa=True)
GENERATION = AttentionRole("cosmos3.generation", SELF, gqa=True)


class OmniCosmos3AttnProcessor(OmniAttnProcessor):
    """``Cosmos3AttnProcessor``: per-pathway projections, norms and RoPE, then a causal understanding call and a
    full generation call over ``[understanding | generation]`` keys, each on its own role's backend."""

    def __init__(self, original, attend: dict[str, RoleAttention]) -> None:
        super().__init__(original, attend)
        self._understanding = attend[UNDERSTANDING.role]
        self._generation = attend[GENERATION.role]

    def __call__(
        self,
        attn: Cosmos3PackedMoTAttention,
        und_seq: torch.Tensor,
        gen_seq: torch.Tensor,
        rotary_emb: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        heads, kv_heads, head_dim = attn.num_attention_heads, attn.num_key_value_heads, attn.head_dim
        q_und = attn.norm_q(attn.to_q(und_seq).view(-1, heads, head_dim))
        k_und = attn.norm_k(attn.to_k(und_seq).view(-1, kv_heads, head_dim))
        v_und = attn.to_v(und_seq).view(-1, kv_heads, head_dim)
        q_gen = attn.norm_added_q(attn.add_q_proj(gen_seq).view(-1, heads, head_dim))
        k_gen = attn.norm_added_k(attn.add_k_proj(gen_seq).view(-1, kv_heads, head_dim))
        v_gen = attn.add_v_proj(gen_seq).view(-1, kv_heads, head_dim)
        k_und_for_gen = attn.k_norm_und_for_gen(k_und) if attn.k_norm_und_for_gen is not None else k_und

        cos_und, sin_und, cos_gen, sin_gen = rotary_emb
        cos_und, sin_und = cos_und.unsqueeze(1), sin_und.unsqueeze(1)
        q_und = q_und * cos_und + _rotate_half(q_und) * sin_und
        k_und = k_und * cos_und + _rotate_half(k_und) * sin_und
        k_und_for_gen = k_und_for_gen * cos_und + _rotate_half(k_und_for_gen) * sin_und
        cos_gen, sin_gen = cos_gen.unsqueeze(1), sin_gen.unsqueeze(1)
        q_gen = q_gen * cos_gen + _rotate_half(q_gen) * sin_gen
        k_gen = k_gen * cos_gen + _rotate_half(k_gen) * sin_gen

        causal_out = self._understanding(
            q_und.unsqueeze(0), k_und.unsqueeze(0), v_und.unsqueeze(0), is_causal=True, enable_gqa=True
        )
        causal_out = causal_out.squeeze(0).flatten(-2, -1)

        all_k = torch.cat([k_und_for_gen, k_gen], dim=0)
        all_v = torch.cat([v_und, v_gen], dim=0)
        full_out = self._generation(
            q_gen.unsqueeze(0), all_k.unsqueeze(0), all_v.unsqueeze(0), is_causal=False, enable_gqa=True
        )
        full_out = full_out.squeeze(0).flatten(-2, -1)
        return attn.to_out(causal_out), attn.to_add_out(full_out)


def _find_sites(model: nn.Module) -> list[AttentionSite]:
    return [
        AttentionSite(name, module, (UNDERSTANDING, GENERATION), int(module.head_dim))
        for name, module in model.named_modules()
        if isinstance(module, Cosmos3PackedMoTAttention)
    ]


def _make_processor(site: AttentionSite, original, attend: dict[str, RoleAttention]) -> OmniCosmos3AttnProcessor:
    if isinstance(original, OmniAttnProcessor):
        original = original.original
    if type(original) is not Cosmos3AttnProcessor:
        raise unsupported_processor_error(site, original, (Cosmos3AttnProcessor,))
    return OmniCosmos3AttnProcessor(original, attend)


COSMOS3 = register_transformer(
    TransformerDeclaration(
        name="cosmos3",
        class_names=("Cosmos3OmniTransformer",),
        blocks_attrs=("layers",),
        find_sites=_find_sites,
        make_processor=_make_processor,
        mask_free=True,
        display_name="Cosmos3",
        example_checkpoint="nvidia/Cosmos3-Nano",
        roles=(UNDERSTANDING, GENERATION),
    )
)
