"""HunyuanVideo-1.5 (``HunyuanVideo15Transformer3DModel``): masked joint video+text attention and the text token
refiner.

Both attention calls are always masked when driven by the Diffusers pipelines:

* ``hunyuanvideo15.joint``: every dual-stream block attends over ``[video tokens | text tokens]``; the processor
  turns the text key-padding mask into a dense ``[B, 1, S, S]`` boolean mask (valid query × valid key) on every
  call, exactly as Diffusers does.
* ``hunyuanvideo15.token_refiner``: the refiner in ``context_embedder`` uses Diffusers' legacy ``Attention`` with
  ``AttnProcessor2_0``, which calls ``F.scaled_dot_product_attention`` directly in ``[B, H, S, D]`` with a dense
  ``[B, H, S, S]`` mask; it is replaced too, so the refiner runs on the backend resolved for its own role.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention, AttnProcessor2_0
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

from ._classic import _PLAIN, OmniLegacyAttnProcessor
from ..attention.processors import OmniAttnProcessor, RoleAttention
from .base import SELF, AttentionRole, AttentionSite, TransformerDeclaration, head_dim_of, register_transformer
from .base import NORM_PROJ_OUT, unsupported_processor_error

JOINT = AttentionRole("hunyuanvideo15.joint", SELF, masked=True)
TOKEN_REFINER = AttentionRole("hunyuanvideo15.token_refiner", SELF, masked=True)

_REFINER_PREFIX = "context_embedder."


class OmniHunyuanVideo15AttnProcessor(OmniAttnProcessor):
    """Joint attention of a dual-stream block: video tokens (with RoPE) followed by text tokens, one masked call.

    Mirrors ``HunyuanVideo15AttnProcessor2_0`` operation by operation, including the dense boolean mask it builds
    from the text key-padding mask.

    Still a copy although Diffusers' processor has the ``dispatch_attention_fn`` seam: routing it would run
    Diffusers' mask code, which builds the dense mask anew in every layer, losing the mask this copy builds once
    per forward (and with it the once-per-forward all-True check); tests/models/test_hunyuanvideo15.py asserts that
    every layer gets the same mask tensor.
    """

    def __init__(self, original, attend: dict[str, RoleAttention]) -> None:
        super().__init__(original, attend)
        (self._attention,) = attend.values()

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        query = attn.to_q(hidden_states).unflatten(2, (attn.heads, -1))
        key = attn.to_k(hidden_states).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        query = attn.norm_q(query)
        key = attn.norm_k(key)

        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        if encoder_hidden_states is not None:
            encoder_query = attn.add_q_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            encoder_key = attn.add_k_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            encoder_value = attn.add_v_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            if attn.norm_added_q is not None:
                encoder_query = attn.norm_added_q(encoder_query)
            if attn.norm_added_k is not None:
                encoder_key = attn.norm_added_k(encoder_key)
            query = torch.cat([query, encoder_query], dim=1)
            key = torch.cat([key, encoder_key], dim=1)
            value = torch.cat([value, encoder_value], dim=1)

        # The text key-padding mask, left-padded with True for the video tokens, as a dense [B, 1, S, S] mask.
        # Diffusers rebuilds it in every layer (S² bytes each: about 1 GB at 30k tokens); it is built once per
        # key-padding mask here, so every layer passes the same tensor and the all-True check runs once.
        batch_size, seq_len = query.shape[:2]

        def dense() -> torch.Tensor:
            key_mask = F.pad(attention_mask, (seq_len - attention_mask.shape[1], 0), value=True).bool()
            rows = key_mask.view(batch_size, 1, 1, seq_len).repeat(1, 1, seq_len, 1)
            return (rows & rows.transpose(2, 3)).bool()

        dense_mask = self._attention.mask_policy.derived(attention_mask, (batch_size, seq_len), dense)

        hidden_states = self._attention(query, key, value, attn_mask=dense_mask)
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)

        if encoder_hidden_states is not None:
            text_len = encoder_hidden_states.shape[1]
            hidden_states, encoder_hidden_states = hidden_states[:, :-text_len], hidden_states[:, -text_len:]
            if getattr(attn, "to_out", None) is not None:
                hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
            if getattr(attn, "to_add_out", None) is not None:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        return hidden_states, encoder_hidden_states


def _find_sites(model: nn.Module) -> list[AttentionSite]:
    sites = []
    for name, module in model.named_modules():
        if not isinstance(module, Attention):
            continue
        role = TOKEN_REFINER if name.startswith(_REFINER_PREFIX) else JOINT
        sites.append(AttentionSite(name, module, (role,), head_dim_of(module)))
    return sites


def _make_processor(site: AttentionSite, original, attend: dict[str, RoleAttention]) -> OmniAttnProcessor:
    if isinstance(original, OmniAttnProcessor):
        original = original.original
    if TOKEN_REFINER in site.roles:
        # Exact types: subclasses of AttnProcessor2_0 (IP-adapter, PAG, ...) do more than plain attention.
        if type(original) not in _PLAIN:
            raise unsupported_processor_error(site, original, _PLAIN)
        return OmniLegacyAttnProcessor(original, attend)
    if type(original) is not HunyuanVideo15AttnProcessor2_0:
        raise unsupported_processor_error(site, original, (HunyuanVideo15AttnProcessor2_0,))
    return OmniHunyuanVideo15AttnProcessor(original, attend)


HUNYUANVIDEO15 = register_transformer(
    TransformerDeclaration(
        name="hunyuanvideo15",
        class_names=("HunyuanVideo15Transformer3DModel",),
        # The token refiner (two small blocks inside ``context_embedder``) stays resident.
        blocks_attrs=("transformer_blocks",),
        tail_attrs=NORM_PROJ_OUT,
        find_sites=_find_sites,
        make_processor=_make_processor,
        mask_free=False,
        display_name="HunyuanVideo-1.5",
        example_checkpoint="hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v",
        roles=(TOKEN_REFINER, JOINT),
    )
)
