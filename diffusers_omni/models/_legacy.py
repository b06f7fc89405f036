"""Diffusers' legacy ``Attention`` + ``AttnProcessor2_0`` path, shared by the architectures that still use it (the
SDXL UNet, HunyuanVideo-1.5's token refiner).

``AttnProcessor2_0`` calls ``F.scaled_dot_product_attention`` on ``[B, H, S, D]`` tensors; these helpers build the
same tensors in the same order and hand their ``[B, S, H, D]`` transposes to the backend, so ``TORCH_SDPA`` runs
the very same SDPA call.

The processors Diffusers swaps in on this path are replaced too, each keeping what it changes:

- ``FusedAttnProcessor2_0`` (``fuse_qkv_projections()``): the fused ``to_qkv`` / ``to_kv`` projections.
- ``SlicedAttnProcessor`` (``enable_attention_slicing()``): attention runs in slices of ``slice_size`` of the
  ``batch × heads`` rows, one backend call per slice, as Diffusers slices.
- ``AttnProcessor`` (the classic processor ``set_default_attn_processor()`` installs): same attention, through the
  backend (Diffusers' explicit softmax and SDPA differ in the last bits; ``TORCH_SDPA`` matches
  ``AttnProcessor2_0``).
- ``IPAdapterAttnProcessor2_0`` (``load_ip_adapter()``): text cross-attention through the site's role and each
  IP-Adapter's image attention through its own ``*.ip_adapter`` role (``OmniLegacyIPAdapterAttnProcessor``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from diffusers.image_processor import IPAdapterMaskProcessor
from diffusers.models.attention_processor import (
    Attention,
    AttnProcessor,
    AttnProcessor2_0,
    FusedAttnProcessor2_0,
    IPAdapterAttnProcessor,
    IPAdapterAttnProcessor2_0,
    SlicedAttnProcessor,
)

from ..attention.processors import OmniAttnProcessor, OmniModuleAttnProcessor, RoleAttention


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


def _unbound_error(processor: Any) -> RuntimeError:
    return RuntimeError(
        f"{type(processor).__name__}() was built without a backend (Diffusers re-instantiates processor classes "
        "when it loads or unloads IP-Adapters); omni attention re-applies itself at the model's next forward. Call "
        "the model, not the attention module, or call enable_omni_attention() again."
    )


def _projections(attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None, fused: bool):
    """Q, K, V projections in the order of ``AttnProcessor2_0`` or, ``fused``, of ``FusedAttnProcessor2_0``."""
    if fused and encoder_hidden_states is None:
        qkv = attn.to_qkv(hidden_states)
        return torch.split(qkv, qkv.shape[-1] // 3, dim=-1)
    if fused:
        if attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        query = attn.to_q(hidden_states)
        kv = attn.to_kv(encoder_hidden_states)
        key, value = torch.split(kv, kv.shape[-1] // 2, dim=-1)
        return query, key, value
    query = attn.to_q(hidden_states)
    if encoder_hidden_states is None:
        encoder_hidden_states = hidden_states
    elif attn.norm_cross:
        encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
    return query, attn.to_k(encoder_hidden_states), attn.to_v(encoder_hidden_states)


def _sliced(
    attention: RoleAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    slice_size: int,
) -> torch.Tensor:
    """Attention over ``[B, H, S, D]`` tensors in slices of ``slice_size`` of the ``B × H`` rows (as
    ``SlicedAttnProcessor`` slices), one backend call per slice with one head; returns ``[B, S, H, D]``."""
    batch_size, heads, query_len, head_dim = query.shape
    rows = batch_size * heads
    query = query.reshape(rows, query_len, 1, head_dim)
    key = key.reshape(rows, key.shape[2], 1, head_dim)
    value = value.reshape(rows, value.shape[2], 1, head_dim)
    if attention_mask is not None:
        attention_mask = attention_mask.expand(batch_size, heads, -1, -1).reshape(rows, 1, *attention_mask.shape[2:])
    out = torch.empty((rows, query_len, 1, head_dim), device=query.device, dtype=query.dtype)
    for start in range(0, rows, slice_size):
        end = start + slice_size
        mask = None if attention_mask is None else attention_mask[start:end]
        out[start:end] = attention(query[start:end], key[start:end], value[start:end], attn_mask=mask)
    return out.view(batch_size, heads, query_len, head_dim).transpose(1, 2)


def _attention_core(
    attention: RoleAttention,
    attn: Attention,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    qk_norm: bool = True,
    fused: bool = False,
    slice_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The body of ``AttnProcessor2_0`` from the mask preparation to the attention output, before the output
    projection (``_out_projection``): returns ``([B, S, H*D] output, [B, H, S, D] query, head_dim)``. Diffusers'
    PAG processors skip the q/k norms (``qk_norm=False``)."""
    batch_size, sequence_length, _ = (
        hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
    )
    if attention_mask is not None:
        attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
        attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])

    if attn.group_norm is not None:
        hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)

    query, key, value = _projections(attn, hidden_states, encoder_hidden_states, fused)

    head_dim = key.shape[-1] // attn.heads
    query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
    key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
    value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
    if qk_norm and attn.norm_q is not None:
        query = attn.norm_q(query)
    if qk_norm and attn.norm_k is not None:
        key = attn.norm_k(key)

    if slice_size:
        out = _sliced(attention, query, key, value, attention_mask, slice_size)
    else:
        # [B, H, S, D] → [B, S, H, D] views; the backend sees exactly the tensors Diffusers hands to SDPA.
        out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=attention_mask)
    out = out.reshape(batch_size, -1, attn.heads * head_dim).to(query.dtype)
    return out, query, head_dim


def _out_projection(attn: Attention, hidden_states: torch.Tensor) -> torch.Tensor:
    """``to_out``: the output projection and its dropout."""
    return attn.to_out[1](attn.to_out[0](hidden_states))


_PLAIN = (AttnProcessor2_0, AttnProcessor, FusedAttnProcessor2_0, SlicedAttnProcessor)
IP_ADAPTER_PROCESSORS = (IPAdapterAttnProcessor2_0, IPAdapterAttnProcessor)


class OmniLegacyAttnProcessor(OmniAttnProcessor):
    """Diffusers' legacy ``AttnProcessor2_0`` (the ``Attention`` class of ``attention_processor``) through the
    backend resolved for the module's single role; also stands for ``AttnProcessor``, ``FusedAttnProcessor2_0``
    (fused projections) and ``SlicedAttnProcessor`` (sliced attention), whichever it replaced.

    Built with no arguments (Diffusers does ``type(processor)()`` when it loads an IP-Adapter), it is an unbound
    placeholder standing for a stock ``AttnProcessor2_0``: omni attention's forward guard replaces it before the
    model runs.
    """

    def __init__(self, original: Any = None, attend: dict[str, RoleAttention] | None = None) -> None:
        super().__init__(AttnProcessor2_0() if original is None else original, attend or {})
        self._attention = next(iter(self.attend.values()), None)
        self.fused = isinstance(self.original, FusedAttnProcessor2_0)
        self.slice_size = self.original.slice_size if isinstance(self.original, SlicedAttnProcessor) else None

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
        if self._attention is None:
            raise _unbound_error(self)
        # Like Diffusers, the deprecated ``scale`` argument is ignored.
        residual = hidden_states
        hidden_states, shape = _tokens_last(attn, hidden_states, temb)
        hidden_states, _, _ = _attention_core(
            self._attention,
            attn,
            hidden_states,
            encoder_hidden_states,
            attention_mask,
            fused=self.fused,
            slice_size=self.slice_size,
        )
        hidden_states = _spatial(_out_projection(attn, hidden_states), shape)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


def _ip_adapter_masks(ip_adapter_masks, scales: list, ip_hidden_states: list) -> list:
    """``ip_adapter_masks`` checked and normalised as ``IPAdapterAttnProcessor2_0`` does."""
    if ip_adapter_masks is None:
        return [None] * len(scales)
    if not isinstance(ip_adapter_masks, list):
        # A tensor [num_ip_adapters, 1, height, width] is accepted for backward compatibility, as in Diffusers.
        ip_adapter_masks = list(ip_adapter_masks.unsqueeze(1))
    if not len(ip_adapter_masks) == len(scales) == len(ip_hidden_states):
        raise ValueError(
            f"Length of ip_adapter_masks array ({len(ip_adapter_masks)}) must match length of self.scale array "
            f"({len(scales)}) and number of ip_hidden_states ({len(ip_hidden_states)})"
        )
    for index, (mask, scale, states) in enumerate(zip(ip_adapter_masks, scales, ip_hidden_states)):
        if mask is None:
            continue
        if not isinstance(mask, torch.Tensor) or mask.ndim != 4:
            raise ValueError(
                "Each element of the ip_adapter_masks array should be a tensor with shape "
                "[1, num_images_for_ip_adapter, height, width]. Please use `IPAdapterMaskProcessor` to preprocess "
                "your mask"
            )
        if mask.shape[1] != states.shape[1]:
            raise ValueError(
                f"Number of masks ({mask.shape[1]}) does not match number of ip images ({states.shape[1]}) at "
                f"index {index}"
            )
        if isinstance(scale, list) and not len(scale) == mask.shape[1]:
            raise ValueError(
                f"Number of masks ({mask.shape[1]}) does not match number of scales ({len(scale)}) at index {index}"
            )
    return ip_adapter_masks


class OmniLegacyIPAdapterAttnProcessor(OmniModuleAttnProcessor, IPAdapterAttnProcessor2_0):
    """``IPAdapterAttnProcessor2_0`` through the resolved backends: the text cross-attention through the site's
    role, each IP-Adapter's attention of the queries over its image tokens through the ``*.ip_adapter`` role.

    It is an ``IPAdapterAttnProcessor2_0`` (Diffusers' ``set_ip_adapter_scale`` and ``unload_ip_adapter`` find it
    by ``isinstance``) and an ``nn.Module`` holding the adapter weights: ``to_k_ip`` / ``to_v_ip`` are the
    original processor's own module lists, so ``state_dict`` keys, ``.to()`` and ``parameters()`` see the same
    tensors as with the stock processor. ``scale`` reads and writes the original's.
    """

    def __init__(self, original: Any = None, attend: dict[str, RoleAttention] | None = None) -> None:
        super().__init__(AttnProcessor2_0() if original is None else original, attend or {})
        self._split_ip_roles(".ip_adapter")
        if isinstance(self.original, IP_ADAPTER_PROCESSORS):
            self.to_k_ip = self.original.to_k_ip
            self.to_v_ip = self.original.to_v_ip

    @property
    def num_tokens(self) -> list:
        return self.original.num_tokens

    @property
    def hidden_size(self) -> int:
        return self.original.hidden_size

    @property
    def cross_attention_dim(self) -> int:
        return self.original.cross_attention_dim

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
        scale: float = 1.0,
        ip_adapter_masks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self._attention is None or self._ip_attention is None:
            raise _unbound_error(self)
        residual = hidden_states
        ip_hidden_states: list = []
        if encoder_hidden_states is not None:
            if isinstance(encoder_hidden_states, tuple):
                encoder_hidden_states, ip_hidden_states = encoder_hidden_states
            else:
                # Diffusers' deprecated layout: image tokens appended to the text tokens.
                end = encoder_hidden_states.shape[1] - self.num_tokens[0]
                encoder_hidden_states, ip_hidden_states = (
                    encoder_hidden_states[:, :end, :],
                    [encoder_hidden_states[:, end:, :]],
                )

        hidden_states, shape = _tokens_last(attn, hidden_states, temb)
        batch_size = hidden_states.shape[0]
        hidden_states, query, head_dim = _attention_core(
            self._attention, attn, hidden_states, encoder_hidden_states, attention_mask
        )
        masks = _ip_adapter_masks(ip_adapter_masks, self.scale, ip_hidden_states)

        def image_attention(states: torch.Tensor, to_k_ip: nn.Module, to_v_ip: nn.Module) -> torch.Tensor:
            ip_key = to_k_ip(states).view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
            ip_value = to_v_ip(states).view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
            out = self._ip_attention(query.transpose(1, 2), ip_key.transpose(1, 2), ip_value.transpose(1, 2))
            return out.reshape(batch_size, -1, attn.heads * head_dim).to(query.dtype)

        for states, scale, to_k_ip, to_v_ip, mask in zip(ip_hidden_states, self.scale, self.to_k_ip, self.to_v_ip, masks):
            if all(s == 0 for s in scale) if isinstance(scale, list) else scale == 0:
                continue
            if mask is None:
                hidden_states = hidden_states + scale * image_attention(states, to_k_ip, to_v_ip)
                continue
            scales = scale if isinstance(scale, list) else [scale] * mask.shape[1]
            for i in range(mask.shape[1]):
                out = image_attention(states[:, i, :, :], to_k_ip, to_v_ip)
                mask_downsample = IPAdapterMaskProcessor.downsample(mask[:, i, :, :], batch_size, out.shape[1], out.shape[2])
                mask_downsample = mask_downsample.to(dtype=query.dtype, device=query.device)
                hidden_states = hidden_states + scales[i] * (out * mask_downsample)

        hidden_states = _spatial(_out_projection(attn, hidden_states), shape)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor
