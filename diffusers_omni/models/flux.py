"""FLUX.1 (``FluxTransformer2DModel``): joint double-stream blocks, single-stream blocks, IP-adapter image attention."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import (
    FluxAttention,
    FluxAttnProcessor,
    FluxIPAdapterAttnProcessor,
    _get_qkv_projections,
)

from ..attention.processors import OmniAttnProcessor, OmniModuleAttnProcessor, RoleAttention
from .base import CROSS, SELF, AttentionRole, AttentionSite, TransformerDeclaration, head_dim_of, register_transformer
from .base import NORM_PROJ_OUT, unsupported_processor_error

JOINT = AttentionRole("flux.joint", SELF)
SINGLE = AttentionRole("flux.single", SELF)
IP_ADAPTER = AttentionRole("flux.ip_adapter", CROSS)
_IP_SUFFIX = ".ip_adapter"


def _unbound_error(processor: Any) -> RuntimeError:
    return RuntimeError(
        f"{type(processor).__name__}() was built without a backend (Diffusers re-instantiates processor classes "
        "when it loads or unloads IP-adapters); omni attention re-applies itself at the model's next forward. Call "
        "the model, not the attention module, or call enable_omni_attention() again."
    )


def joint_qkv(
    attn, hidden_states, encoder_hidden_states, image_rotary_emb, projections=_get_qkv_projections,
    with_image_query: bool = False,
):
    """Q, K, V of the joint ``[text | image]`` sequence, ``[B, S, H, D]``, with q/k norms and rotary embeddings
    applied in the order of Diffusers' FLUX processors (FLUX.2 passes its own ``projections``). With
    ``with_image_query``, the normed image query before concatenation and rotary comes fourth (IP-Adapter)."""
    query, key, value, text_query, text_key, text_value = projections(attn, hidden_states, encoder_hidden_states)
    query = attn.norm_q(query.unflatten(-1, (-1, attn.head_dim)))
    key = attn.norm_k(key.unflatten(-1, (-1, attn.head_dim)))
    value = value.unflatten(-1, (-1, attn.head_dim))
    image_query = query

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
    return (query, key, value, image_query) if with_image_query else (query, key, value)


class OmniFluxAttnProcessor(OmniAttnProcessor):
    """FLUX.1 attention through the backend resolved for the module's role.

    The text stream (when present) is concatenated in front of the image stream, rotary embeddings are applied
    to both, and one attention call covers the joint sequence.

    Built with no arguments (Diffusers does ``type(processor)()`` in ``load_ip_adapter`` for the single-stream
    blocks and in ``unload_ip_adapter``), it is an unbound placeholder standing for a stock ``FluxAttnProcessor``:
    omni attention's forward guard replaces it before the model runs.
    """

    def __init__(self, original: Any = None, attend: dict[str, RoleAttention] | None = None) -> None:
        super().__init__(FluxAttnProcessor() if original is None else original, attend or {})
        self._attention = next(iter(self.attend.values()), None)

    def __call__(
        self,
        attn: FluxAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self._attention is None:
            raise _unbound_error(self)
        query, key, value = joint_qkv(attn, hidden_states, encoder_hidden_states, image_rotary_emb)

        out = self._attention(query, key, value, attn_mask=attention_mask)
        out = out.flatten(2, 3).to(query.dtype)

        if encoder_hidden_states is None:
            return out
        text_len = encoder_hidden_states.shape[1]
        text_out, image_out = out.split_with_sizes([text_len, out.shape[1] - text_len], dim=1)
        image_out = attn.to_out[1](attn.to_out[0](image_out.contiguous()))
        text_out = attn.to_add_out(text_out.contiguous())
        return image_out, text_out


class OmniFluxIPAdapterAttnProcessor(OmniModuleAttnProcessor):
    """FLUX.1 attention with IP-adapter image attention (replaces ``FluxIPAdapterAttnProcessor``).

    The joint attention goes through the ``flux.joint`` role; each IP-adapter's attention of the image queries
    (normalised, without rotary embeddings) over its image-prompt tokens goes through ``flux.ip_adapter`` (any
    role named ``*.ip_adapter``).

    Like the Diffusers processor this is an ``nn.Module`` holding the adapter weights: ``to_k_ip`` and
    ``to_v_ip`` are the original processor's own module lists, registered here under the same names, so the
    model's ``state_dict`` keys, ``.to()`` and ``parameters()`` see the same tensors as with the stock processor
    (``set_processor`` keeps an ``nn.Module`` processor in the attention module's ``_modules``). ``scale`` reads
    and writes the original's, so ``set_ip_adapter_scale`` keeps working.
    """

    def __init__(self, original: Any = None, attend: dict[str, RoleAttention] | None = None) -> None:
        super().__init__(FluxAttnProcessor() if original is None else original, attend or {})
        # Roles are found by suffix so that architectures reusing FLUX.1 attention (Chroma) name their own.
        self._split_ip_roles(_IP_SUFFIX)
        if isinstance(self.original, FluxIPAdapterAttnProcessor):
            self.to_k_ip = self.original.to_k_ip
            self.to_v_ip = self.original.to_v_ip

    def __call__(
        self,
        attn: FluxAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
        ip_hidden_states: list[torch.Tensor] | None = None,
        ip_adapter_masks: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._attention is None:
            raise _unbound_error(self)
        batch_size = hidden_states.shape[0]
        query, key, value, ip_query = joint_qkv(
            attn, hidden_states, encoder_hidden_states, image_rotary_emb, with_image_query=True
        )
        out = self._attention(query, key, value, attn_mask=attention_mask)
        out = out.flatten(2, 3).to(query.dtype)

        if encoder_hidden_states is None:
            return out
        text_len = encoder_hidden_states.shape[1]
        text_out, image_out = out.split_with_sizes([text_len, out.shape[1] - text_len], dim=1)
        image_out = attn.to_out[1](attn.to_out[0](image_out))
        text_out = attn.to_add_out(text_out)

        ip_out = torch.zeros_like(image_out)
        for states, scale, to_k_ip, to_v_ip in zip(ip_hidden_states, self.scale, self.to_k_ip, self.to_v_ip):
            ip_key = to_k_ip(states).view(batch_size, -1, attn.heads, attn.head_dim)
            ip_value = to_v_ip(states).view(batch_size, -1, attn.heads, attn.head_dim)
            states = self._ip_attention(ip_query, ip_key, ip_value)
            states = states.reshape(batch_size, -1, attn.heads * attn.head_dim).to(ip_query.dtype)
            ip_out += scale * states
        return image_out, text_out, ip_out


def _unwrap(processor: Any) -> Any:
    return processor.original if isinstance(processor, OmniAttnProcessor) else processor


def flux_attention_sites(
    joint: AttentionRole, single: AttentionRole, ip_adapter: AttentionRole
) -> Callable[[nn.Module], list[AttentionSite]]:
    """``find_sites`` for a model built from ``FluxAttention`` modules (FLUX.1, Chroma): ``joint`` in the
    double-stream blocks, ``single`` in ``single_transformer_blocks``, plus ``ip_adapter`` where an IP-adapter
    processor is installed."""

    def find_sites(model: nn.Module) -> list[AttentionSite]:
        sites = []
        for name, module in model.named_modules():
            if not isinstance(module, FluxAttention):
                continue
            roles: tuple[AttentionRole, ...]
            roles = (single,) if name.startswith("single_transformer_blocks.") else (joint,)
            if isinstance(_unwrap(module.processor), FluxIPAdapterAttnProcessor):
                roles += (ip_adapter,)
            sites.append(AttentionSite(name, module, roles, head_dim_of(module)))
        return sites

    return find_sites


def make_flux_processor(site: AttentionSite, original, attend: dict[str, RoleAttention]) -> OmniAttnProcessor:
    """``make_processor`` for ``FluxAttention`` modules: replaces ``FluxAttnProcessor`` and
    ``FluxIPAdapterAttnProcessor``; raises naming the module for anything else."""
    original = _unwrap(original)
    if isinstance(original, FluxIPAdapterAttnProcessor):
        return OmniFluxIPAdapterAttnProcessor(original, attend)
    if isinstance(original, FluxAttnProcessor):
        return OmniFluxAttnProcessor(original, attend)
    raise unsupported_processor_error(site, original, (FluxAttnProcessor, FluxIPAdapterAttnProcessor))


FLUX = register_transformer(
    TransformerDeclaration(
        name="flux",
        class_names=("FluxTransformer2DModel",),
        blocks_attrs=("transformer_blocks", "single_transformer_blocks"),
        tail_attrs=NORM_PROJ_OUT,
        find_sites=flux_attention_sites(JOINT, SINGLE, IP_ADAPTER),
        make_processor=make_flux_processor,
        mask_free=True,
        display_name="FLUX.1",
        example_checkpoint="black-forest-labs/FLUX.1-dev",
        roles=(JOINT, SINGLE, IP_ADAPTER),
    )
)
