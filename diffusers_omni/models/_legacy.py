"""Diffusers' legacy ``Attention`` + ``AttnProcessor2_0`` path, shared by the architectures that still use it (the
SDXL UNet, HunyuanVideo-1.5's token refiner).

``AttnProcessor2_0`` calls ``F.scaled_dot_product_attention`` on ``[B, H, S, D]`` tensors; these helpers build the
same tensors in the same order and hand their ``[B, S, H, D]`` transposes to the backend, so ``TORCH_SDPA`` runs
the very same SDPA call.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention

from ..attention.processors import OmniAttnProcessor, RoleAttention


def _tokens_last(attn: Attention, hidden_states: torch.Tensor, temb: torch.Tensor | None):
    """Spatial norm and ``[B, C, H, W]`` → ``[B, H*W, C]``, as Diffusers; returns the spatial shape too."""
    if attn.spatial_norm is not None:
        hidden_states = attn.spatial_norm(hidden_states, temb)
    shape = None
    if hidden_states.ndim == 4:
        shape = hidden_states.shape
        batch_size, channel, height, width = shape
        hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)
    return hidden_states, shape


def _spatial(hidden_states: torch.Tensor, shape) -> torch.Tensor:
    if shape is None:
        return hidden_states
    return hidden_states.transpose(-1, -2).reshape(*shape)


def _attention(
    attention: RoleAttention,
    attn: Attention,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    qk_norm: bool = True,
) -> tuple[torch.Tensor, torch.dtype]:
    """The body of ``AttnProcessor2_0`` from the mask preparation to the output projection; returns the output
    and the query dtype. Diffusers' PAG processors skip the q/k norms (``qk_norm=False``)."""
    batch_size, sequence_length, _ = (
        hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
    )
    if attention_mask is not None:
        attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
        attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])

    if attn.group_norm is not None:
        hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)

    query = attn.to_q(hidden_states)
    if encoder_hidden_states is None:
        encoder_hidden_states = hidden_states
    elif attn.norm_cross:
        encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
    key = attn.to_k(encoder_hidden_states)
    value = attn.to_v(encoder_hidden_states)

    head_dim = key.shape[-1] // attn.heads
    query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
    key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
    value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
    if qk_norm and attn.norm_q is not None:
        query = attn.norm_q(query)
    if qk_norm and attn.norm_k is not None:
        key = attn.norm_k(key)

    # [B, H, S, D] → [B, S, H, D] views; the backend sees exactly the tensors Diffusers hands to SDPA.
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=attention_mask)
    out = out.reshape(batch_size, -1, attn.heads * head_dim).to(query.dtype)
    return attn.to_out[1](attn.to_out[0](out)), query.dtype


class OmniLegacyAttnProcessor(OmniAttnProcessor):
    """Diffusers' legacy ``AttnProcessor2_0`` (the ``Attention`` class of ``attention_processor``) through the
    backend resolved for the module's single role."""

    def __init__(self, original, attend: dict[str, RoleAttention]) -> None:
        super().__init__(original, attend)
        (self._attention,) = attend.values()

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        # Like Diffusers, the deprecated ``scale`` argument is ignored.
        residual = hidden_states
        hidden_states, shape = _tokens_last(attn, hidden_states, temb)
        hidden_states, _ = _attention(self._attention, attn, hidden_states, encoder_hidden_states, attention_mask)
        hidden_states = _spatial(hidden_states, shape)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor
