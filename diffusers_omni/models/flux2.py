"""FLUX.2 (``Flux2Transformer2DModel``): double-stream joint attention and parallel single-stream blocks.

The single-stream blocks (``Flux2ParallelSelfAttention``) project QKV and the MLP input with one fused linear
and project the attention and MLP outputs with one fused linear; ``fuse_qkv_projections`` skips them.

The KV-cache processors (installed by ``Flux2KleinKVPipeline``, which swaps every block's processor in its
``__init__``) cache the reference-image tokens' K/V on the first step ("extract") and inject them afterwards
("cached"). In extract mode one processor makes two attention calls: text+image queries over every token
(the block's own role) and reference queries over the reference tokens only (``flux2.reference``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux2 import (
    Flux2Attention,
    Flux2AttnProcessor,
    Flux2KVAttnProcessor,
    Flux2KVLayerCache,
    Flux2KVParallelSelfAttnProcessor,
    Flux2ParallelSelfAttention,
    Flux2ParallelSelfAttnProcessor,
    _get_qkv_projections,
)

from ..attention.processors import OmniAttnProcessor, RoleAttention
from .base import SELF, AttentionRole, AttentionSite, TransformerDeclaration, head_dim_of, register_transformer
from .base import NORM_PROJ_OUT, unsupported_processor_error
from .flux import joint_qkv

FLUX2_JOINT = AttentionRole("flux2.joint", SELF)
FLUX2_SINGLE = AttentionRole("flux2.single", SELF)
FLUX2_REFERENCE = AttentionRole("flux2.reference", SELF)

_KV_PROCESSORS = (Flux2KVAttnProcessor, Flux2KVParallelSelfAttnProcessor)


def _kv_causal_attention(
    main: RoleAttention,
    reference: RoleAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    num_txt_tokens: int,
    num_ref_tokens: int,
    kv_cache: Flux2KVLayerCache | None = None,
) -> torch.Tensor:
    """Diffusers' ``_flux2_kv_causal_attention`` (sequence ``[txt, ref, img]``) with a role per call."""
    if num_ref_tokens == 0 and kv_cache is None:
        return main(query, key, value)

    if kv_cache is not None:
        k_ref, v_ref = kv_cache.get()
        k_all = torch.cat([key[:, :num_txt_tokens], k_ref, key[:, num_txt_tokens:]], dim=1)
        v_all = torch.cat([value[:, :num_txt_tokens], v_ref, value[:, num_txt_tokens:]], dim=1)
        return main(query, k_all, v_all)

    ref_start, ref_end = num_txt_tokens, num_txt_tokens + num_ref_tokens
    q_txt_img = torch.cat([query[:, :ref_start], query[:, ref_end:]], dim=1)
    k_all = torch.cat([key[:, :ref_start], key[:, ref_start:ref_end], key[:, ref_end:]], dim=1)
    v_all = torch.cat([value[:, :ref_start], value[:, ref_start:ref_end], value[:, ref_end:]], dim=1)
    attn_txt_img = main(q_txt_img, k_all, v_all)
    attn_ref = reference(query[:, ref_start:ref_end], key[:, ref_start:ref_end], value[:, ref_start:ref_end])
    return torch.cat([attn_txt_img[:, :ref_start], attn_ref, attn_txt_img[:, ref_start:]], dim=1)


def _store_reference(kv_cache, kv_cache_mode, num_txt_tokens, num_ref_tokens, key, value) -> None:
    if kv_cache_mode == "extract" and kv_cache is not None and num_ref_tokens > 0:
        ref_start, ref_end = num_txt_tokens, num_txt_tokens + num_ref_tokens
        kv_cache.store(key[:, ref_start:ref_end].clone(), value[:, ref_start:ref_end].clone())


class _Flux2Processor(OmniAttnProcessor):
    def __init__(self, original: Any, attend: dict[str, RoleAttention]) -> None:
        super().__init__(original, attend)
        self._attention = next(ra for role, ra in attend.items() if role != FLUX2_REFERENCE.role)
        self._reference = attend.get(FLUX2_REFERENCE.role)

    def _attend(self, query, key, value, attention_mask, kv_cache, kv_cache_mode, num_txt_tokens, num_ref_tokens):
        _store_reference(kv_cache, kv_cache_mode, num_txt_tokens, num_ref_tokens, key, value)
        if kv_cache_mode == "extract" and num_ref_tokens > 0:
            return _kv_causal_attention(
                self._attention, self._reference, query, key, value, num_txt_tokens, num_ref_tokens
            )
        if kv_cache_mode == "cached" and kv_cache is not None:
            return _kv_causal_attention(
                self._attention, self._reference, query, key, value, num_txt_tokens, 0, kv_cache=kv_cache
            )
        return self._attention(query, key, value, attn_mask=attention_mask)


class OmniFlux2AttnProcessor(_Flux2Processor):
    """FLUX.2 double-stream attention (replaces ``Flux2AttnProcessor``): text tokens in front of image tokens,
    one joint call."""

    def __call__(
        self,
        attn: Flux2Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ):
        return self._forward(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)

    def _forward(
        self,
        attn: Flux2Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        image_rotary_emb: torch.Tensor | None,
        kv_cache: Flux2KVLayerCache | None = None,
        kv_cache_mode: str | None = None,
        num_ref_tokens: int = 0,
    ):
        query, key, value = joint_qkv(attn, hidden_states, encoder_hidden_states, image_rotary_emb, _get_qkv_projections)

        num_txt_tokens = encoder_hidden_states.shape[1] if encoder_hidden_states is not None else 0
        out = self._attend(query, key, value, attention_mask, kv_cache, kv_cache_mode, num_txt_tokens, num_ref_tokens)
        out = out.flatten(2, 3).to(query.dtype)

        text_out = None
        if encoder_hidden_states is not None:
            text_out, out = out.split_with_sizes([num_txt_tokens, out.shape[1] - num_txt_tokens], dim=1)
            text_out = attn.to_add_out(text_out)
        out = attn.to_out[1](attn.to_out[0](out))
        return out if text_out is None else (out, text_out)


class OmniFlux2KVAttnProcessor(OmniFlux2AttnProcessor):
    """Replaces ``Flux2KVAttnProcessor``: as :class:`OmniFlux2AttnProcessor`, plus the reference-token KV cache."""

    def __call__(
        self,
        attn: Flux2Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
        kv_cache: Flux2KVLayerCache | None = None,
        kv_cache_mode: str | None = None,
        num_ref_tokens: int = 0,
    ):
        return self._forward(
            attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb,
            kv_cache, kv_cache_mode, num_ref_tokens,
        )  # fmt: skip


class OmniFlux2ParallelSelfAttnProcessor(_Flux2Processor):
    """FLUX.2 single-stream attention (replaces ``Flux2ParallelSelfAttnProcessor``): one fused QKV+MLP-in
    projection, attention over the joint sequence, one fused attention+MLP output projection."""

    def __call__(
        self,
        attn: Flux2ParallelSelfAttention,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self._forward(attn, hidden_states, attention_mask, image_rotary_emb)

    def _forward(
        self,
        attn: Flux2ParallelSelfAttention,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        image_rotary_emb: torch.Tensor | None,
        kv_cache: Flux2KVLayerCache | None = None,
        kv_cache_mode: str | None = None,
        num_txt_tokens: int = 0,
        num_ref_tokens: int = 0,
    ) -> torch.Tensor:
        projected = attn.to_qkv_mlp_proj(hidden_states)
        qkv_dim = 3 * attn.inner_dim
        mlp_dim = attn.mlp_hidden_dim * attn.mlp_mult_factor
        local_qkv = projected.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)
        qkv, mlp_hidden_states = torch.split(projected, [local_qkv, projected.shape[-1] - local_qkv], dim=-1)

        query, key, value = qkv.chunk(3, dim=-1)
        query = attn.norm_q(query.unflatten(-1, (-1, attn.head_dim)))
        key = attn.norm_k(key.unflatten(-1, (-1, attn.head_dim)))
        value = value.unflatten(-1, (-1, attn.head_dim))

        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        out = self._attend(query, key, value, attention_mask, kv_cache, kv_cache_mode, num_txt_tokens, num_ref_tokens)
        out = out.flatten(2, 3).to(query.dtype)

        mlp_hidden_states = attn.mlp_act_fn(mlp_hidden_states)
        return attn.to_out(torch.cat([out, mlp_hidden_states], dim=-1))


class OmniFlux2KVParallelSelfAttnProcessor(OmniFlux2ParallelSelfAttnProcessor):
    """Replaces ``Flux2KVParallelSelfAttnProcessor``: single-stream attention plus the reference-token KV cache."""

    def __call__(
        self,
        attn: Flux2ParallelSelfAttention,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
        kv_cache: Flux2KVLayerCache | None = None,
        kv_cache_mode: str | None = None,
        num_txt_tokens: int = 0,
        num_ref_tokens: int = 0,
    ) -> torch.Tensor:
        return self._forward(
            attn, hidden_states, attention_mask, image_rotary_emb, kv_cache, kv_cache_mode, num_txt_tokens, num_ref_tokens
        )


# Diffusers processor class → omni processor class, exact types (the KV classes do not subclass the plain ones).
_REPLACEMENTS: dict[type, type[_Flux2Processor]] = {
    Flux2AttnProcessor: OmniFlux2AttnProcessor,
    Flux2KVAttnProcessor: OmniFlux2KVAttnProcessor,
    Flux2ParallelSelfAttnProcessor: OmniFlux2ParallelSelfAttnProcessor,
    Flux2KVParallelSelfAttnProcessor: OmniFlux2KVParallelSelfAttnProcessor,
}


def _unwrap(processor: Any) -> Any:
    return processor.original if isinstance(processor, OmniAttnProcessor) else processor


def _find_sites(model: nn.Module) -> list[AttentionSite]:
    sites = []
    for name, module in model.named_modules():
        if isinstance(module, Flux2Attention):
            roles: tuple[AttentionRole, ...] = (FLUX2_JOINT,)
        elif isinstance(module, Flux2ParallelSelfAttention):
            roles = (FLUX2_SINGLE,)
        else:
            continue
        if isinstance(_unwrap(module.processor), _KV_PROCESSORS):
            roles += (FLUX2_REFERENCE,)
        sites.append(AttentionSite(name, module, roles, head_dim_of(module)))
    return sites


def _make_processor(site: AttentionSite, original, attend: dict[str, RoleAttention]) -> _Flux2Processor:
    original = _unwrap(original)
    replacement = _REPLACEMENTS.get(type(original))
    if replacement is None:
        raise unsupported_processor_error(site, original, tuple(_REPLACEMENTS))
    return replacement(original, attend)


FLUX2 = register_transformer(
    TransformerDeclaration(
        name="flux2",
        class_names=("Flux2Transformer2DModel",),
        blocks_attrs=("transformer_blocks", "single_transformer_blocks"),
        tail_attrs=NORM_PROJ_OUT,
        find_sites=_find_sites,
        make_processor=_make_processor,
        mask_free=True,
        display_name="FLUX.2",
        example_checkpoint="black-forest-labs/FLUX.2-dev",
        roles=(FLUX2_JOINT, FLUX2_SINGLE, FLUX2_REFERENCE),
    )
)
