"""Copied attention processors: the Diffusers processors that have no ``dispatch_attention_fn`` seam.

Omni attention routes every Diffusers processor that calls ``dispatch_attention_fn``: the module keeps running
Diffusers' own ``__call__``, its attention calls sent to the resolved backends (``attention.processors``). The
classic processors below call ``torch.nn.functional.scaled_dot_product_attention`` inline, on ``[B, H, S, D]``
tensors, with no seam between building the tensors and attending, so there is nothing to route: these are copies.
Each builds the same tensors in the same order as the Diffusers class it mirrors and hands their ``[B, S, H, D]``
transposes to the backend, so ``TORCH_SDPA`` runs the very same SDPA call. They must keep mirroring Diffusers'
operation order (projections, reshapes, norms, casts, residuals) exactly: bitwise parity with stock Diffusers
depends on it, and the model tests compare against it bit for bit.

What each copy mirrors (all in ``diffusers.models.attention_processor``):

The legacy ``Attention`` path (the SDXL UNet, HunyuanVideo-1.5's token refiner):

- ``OmniLegacyAttnProcessor``: ``AttnProcessor2_0``; also stands for the processors Diffusers swaps in on this
  path, keeping what each changes: ``FusedAttnProcessor2_0`` (``fuse_qkv_projections()``: the fused ``to_qkv`` /
  ``to_kv`` projections), ``SlicedAttnProcessor`` (``enable_attention_slicing()``: attention in slices of
  ``slice_size`` of the ``batch × heads`` rows, one backend call per slice, as Diffusers slices) and
  ``AttnProcessor`` (the classic processor ``set_default_attn_processor()`` installs: same attention, through the
  backend; Diffusers' explicit softmax and SDPA differ in the last bits, ``TORCH_SDPA`` matches
  ``AttnProcessor2_0``).
- ``OmniLegacyIPAdapterAttnProcessor``: ``IPAdapterAttnProcessor2_0`` / ``IPAdapterAttnProcessor``
  (``load_ip_adapter()``): text cross-attention through the site's role and each IP-Adapter's image attention
  through its own ``*.ip_adapter`` role.
- ``OmniPAGIdentitySelfAttnProcessor``: ``PAGIdentitySelfAttnProcessor2_0`` / ``PAGCFGIdentitySelfAttnProcessor2_0``
  (SDXL Perturbed-Attention Guidance).

Stable Diffusion 3's joint attention:

- ``OmniJointAttnProcessor``: ``JointAttnProcessor2_0`` and ``FusedJointAttnProcessor2_0``
  (``fuse_qkv_projections()``).
- ``OmniSD3IPAdapterJointAttnProcessor``: ``SD3IPAdapterJointAttnProcessor2_0``.
- ``OmniPAGJointAttnProcessor``: ``PAGJointAttnProcessor2_0`` / ``PAGCFGJointAttnProcessor2_0``.

The roles belong to the model declarations (``sdxl.py``, ``sd3.py``, ``hunyuanvideo15.py``), which map each
Diffusers processor to its copy here; a processor with several roles tells them apart by suffix (``*.ip_adapter``,
``*.pag_identity``). The copies Diffusers may re-instantiate with no arguments when it loads or unloads
IP-Adapters (``OmniLegacyAttnProcessor``, ``OmniLegacyIPAdapterAttnProcessor``, ``OmniJointAttnProcessor``) are then
unbound placeholders that refuse to run (``unbound_error``) until omni attention's forward guard replaces them.
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
    FusedJointAttnProcessor2_0,
    IPAdapterAttnProcessor,
    IPAdapterAttnProcessor2_0,
    JointAttnProcessor2_0,
    SD3IPAdapterJointAttnProcessor2_0,
    SlicedAttnProcessor,
)

from ..attention.processors import OmniAttnProcessor, OmniModuleAttnProcessor, RoleAttention, unbound_error

# The legacy ``Attention`` + ``AttnProcessor2_0`` path ---------------------------------------------------------------


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
            raise unbound_error(self)
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
            raise unbound_error(self)
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


# Stable Diffusion 3's joint attention ---------------------------------------------------------------------------------


def _split_roles(attend: dict[str, RoleAttention], suffix: str) -> tuple[RoleAttention | None, RoleAttention | None]:
    """The role not named ``*<suffix>`` and the one that is (each ``None`` when absent)."""
    other = next((ra for role, ra in attend.items() if not role.endswith(suffix)), None)
    named = next((ra for role, ra in attend.items() if role.endswith(suffix)), None)
    return other, named


def _heads_first(attn: Attention, tensor: torch.Tensor, batch_size: int, head_dim: int) -> torch.Tensor:
    return tensor.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)


def _no_mask(attn_name: str, attention_mask: torch.Tensor | None) -> None:
    # Diffusers' JointAttnProcessor2_0 drops a mask without a word; omni attention never ignores one silently.
    if attention_mask is not None:
        raise ValueError(
            f"SD3 {attn_name} attention received an attention_mask, which Diffusers' JointAttnProcessor2_0 ignores; "
            "omni attention does not drop masks silently. Remove attention_mask from joint_attention_kwargs."
        )


def _fused_joint_qkv(attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None):
    """Q, K, V ``[B, H, S, D]`` as ``FusedJointAttnProcessor2_0`` builds them: fused projections, no q/k norms."""
    batch_size = hidden_states.shape[0]
    qkv = attn.to_qkv(hidden_states)
    query, key, value = torch.split(qkv, qkv.shape[-1] // 3, dim=-1)
    if encoder_hidden_states is not None:
        text_qkv = attn.to_added_qkv(encoder_hidden_states)
        text_query, text_key, text_value = torch.split(text_qkv, text_qkv.shape[-1] // 3, dim=-1)
        query = torch.cat([query, text_query], dim=1)
        key = torch.cat([key, text_key], dim=1)
        value = torch.cat([value, text_value], dim=1)
    head_dim = key.shape[-1] // attn.heads
    return (
        _heads_first(attn, query, batch_size, head_dim),
        _heads_first(attn, key, batch_size, head_dim),
        _heads_first(attn, value, batch_size, head_dim),
    )


def _joint_qkv(attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None):
    """Q, K, V ``[B, H, S, D]`` as ``JointAttnProcessor2_0`` builds them; also the image-only Q, K, V before the
    q/k norms (for the IP-Adapter attention)."""
    batch_size = hidden_states.shape[0]
    query = attn.to_q(hidden_states)
    key = attn.to_k(hidden_states)
    value = attn.to_v(hidden_states)
    head_dim = key.shape[-1] // attn.heads
    query = _heads_first(attn, query, batch_size, head_dim)
    key = _heads_first(attn, key, batch_size, head_dim)
    value = _heads_first(attn, value, batch_size, head_dim)
    image = (query, key, value)
    if attn.norm_q is not None:
        query = attn.norm_q(query)
    if attn.norm_k is not None:
        key = attn.norm_k(key)

    if encoder_hidden_states is not None:
        text_query = _heads_first(attn, attn.add_q_proj(encoder_hidden_states), batch_size, head_dim)
        text_key = _heads_first(attn, attn.add_k_proj(encoder_hidden_states), batch_size, head_dim)
        text_value = _heads_first(attn, attn.add_v_proj(encoder_hidden_states), batch_size, head_dim)
        if attn.norm_added_q is not None:
            text_query = attn.norm_added_q(text_query)
        if attn.norm_added_k is not None:
            text_key = attn.norm_added_k(text_key)
        query = torch.cat([query, text_query], dim=2)
        key = torch.cat([key, text_key], dim=2)
        value = torch.cat([value, text_value], dim=2)
    return query, key, value, image


def _split_joint(attn: Attention, hidden_states, encoder_hidden_states, image_len: int):
    if encoder_hidden_states is None:
        return hidden_states, None
    hidden_states, encoder_hidden_states = hidden_states[:, :image_len], hidden_states[:, image_len:]
    if not attn.context_pre_only:
        encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
    return hidden_states, encoder_hidden_states


def _joint_attention(
    attention: RoleAttention,
    attn: Attention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None,
    image_len: int,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention over ``[B, H, S, D]`` joint projections, flattened back to ``[B, S, H*D]`` and split into the
    image output (before ``to_out``) and the text output (through ``to_add_out``, ``None`` without text)."""
    # [B, H, S, D] → [B, S, H, D] views; the backend sees exactly the tensors Diffusers hands to SDPA.
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask)
    out = out.reshape(query.shape[0], -1, attn.heads * query.shape[-1]).to(query.dtype)
    return _split_joint(attn, out, encoder_hidden_states, image_len)


class OmniJointAttnProcessor(OmniAttnProcessor):
    """``JointAttnProcessor2_0`` (or ``FusedJointAttnProcessor2_0``) through the backend resolved for the module's
    role.

    With ``encoder_hidden_states`` (``attn``): joint attention over ``[image | text]`` (``sd3.joint``). Without
    (SD3.5-Medium's ``attn2``): image self-attention (``sd3.image_self``).

    Built with no arguments (Diffusers does ``type(processor)()`` in ``unload_ip_adapter``), it is an unbound
    placeholder standing for a stock ``JointAttnProcessor2_0``: omni attention's forward guard replaces it before
    the model runs.
    """

    def __init__(self, original: Any = None, attend: dict[str, RoleAttention] | None = None) -> None:
        super().__init__(JointAttnProcessor2_0() if original is None else original, attend or {})
        self._attention = next(iter(self.attend.values()), None)
        self.fused = isinstance(self.original, FusedJointAttnProcessor2_0)

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *args,
        **kwargs,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self._attention is None:
            raise unbound_error(self)
        _no_mask(self._attention.role, attention_mask)
        image_len = hidden_states.shape[1]
        if self.fused:
            query, key, value = _fused_joint_qkv(attn, hidden_states, encoder_hidden_states)
        else:
            query, key, value, _ = _joint_qkv(attn, hidden_states, encoder_hidden_states)

        hidden_states, encoder_hidden_states = _joint_attention(
            self._attention, attn, query, key, value, encoder_hidden_states, image_len
        )

        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        return hidden_states


class OmniSD3IPAdapterJointAttnProcessor(OmniModuleAttnProcessor, SD3IPAdapterJointAttnProcessor2_0):
    """``SD3IPAdapterJointAttnProcessor2_0`` through the resolved backends: the joint (or image-only) attention
    through the site's role, the IP-Adapter attention (normalised image queries over ``[image keys | image-prompt
    keys]``) through ``sd3.ip_adapter``.

    It is an ``SD3IPAdapterJointAttnProcessor2_0`` (Diffusers' ``is_ip_adapter_active``, ``set_ip_adapter_scale``
    and ``unload_ip_adapter`` find it by ``isinstance``) and an ``nn.Module`` whose submodules are the original
    processor's own (``norm_ip``, ``to_k_ip``, ``to_v_ip``, ``norm_q``, ``norm_k``, ``norm_ip_k``): ``state_dict``
    keys, ``.to()`` and ``parameters()`` see the same tensors as with the stock processor. ``scale`` reads and
    writes the original's.
    """

    _WEIGHTS = ("norm_ip", "to_k_ip", "to_v_ip", "norm_q", "norm_k", "norm_ip_k")

    def __init__(self, original: Any, attend: dict[str, RoleAttention]) -> None:
        super().__init__(original, attend)
        self._split_ip_roles(".ip_adapter")
        for name in self._WEIGHTS:
            setattr(self, name, getattr(original, name))

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        ip_hidden_states: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self._attention is None or self._ip_attention is None:
            raise unbound_error(self)
        _no_mask(self._attention.role, attention_mask)
        batch_size, image_len = hidden_states.shape[:2]
        query, key, value, (img_query, img_key, img_value) = _joint_qkv(attn, hidden_states, encoder_hidden_states)
        head_dim = query.shape[-1]

        hidden_states, encoder_hidden_states = _joint_attention(
            self._attention, attn, query, key, value, encoder_hidden_states, image_len
        )

        if self.scale != 0 and ip_hidden_states is not None:
            norm_ip_hidden_states = self.norm_ip(ip_hidden_states, temb=temb)
            ip_key = _heads_first(attn, self.to_k_ip(norm_ip_hidden_states), batch_size, head_dim)
            ip_value = _heads_first(attn, self.to_v_ip(norm_ip_hidden_states), batch_size, head_dim)
            ip_query = self.norm_q(img_query)
            ip_key = torch.cat([self.norm_k(img_key), self.norm_ip_k(ip_key)], dim=2)
            ip_value = torch.cat([img_value, ip_value], dim=2)
            ip_out = self._ip_attention(ip_query.transpose(1, 2), ip_key.transpose(1, 2), ip_value.transpose(1, 2))
            ip_out = ip_out.reshape(batch_size, -1, attn.heads * head_dim).to(ip_query.dtype)
            hidden_states = hidden_states + ip_out * self.scale

        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        return hidden_states


class OmniPAGJointAttnProcessor(OmniAttnProcessor):
    """``PAGJointAttnProcessor2_0`` / ``PAGCFGJointAttnProcessor2_0`` through the resolved backends.

    The batch is ``[original | perturbed]`` (``[uncond | cond | perturbed]`` with classifier-free guidance). The
    original half runs joint attention (``sd3.joint``); the perturbed half runs it with an additive mask that
    leaves each image token attending only to itself (``sd3.pag_identity``). Mirrors Diffusers exactly, including
    that the q/k norms (SD3.5's ``qk_norm``) are not applied on PAG layers.
    """

    def __init__(self, original, attend: dict[str, RoleAttention], cfg: bool) -> None:
        super().__init__(original, attend)
        self.cfg = cfg
        self._joint, self._identity = _split_roles(attend, ".pag_identity")

    def _path(
        self,
        attention: RoleAttention,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        image_len: int,
        identity_mask: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size = encoder_hidden_states.shape[0]
        query = torch.cat([attn.to_q(hidden_states), attn.add_q_proj(encoder_hidden_states)], dim=1)
        key = torch.cat([attn.to_k(hidden_states), attn.add_k_proj(encoder_hidden_states)], dim=1)
        value = torch.cat([attn.to_v(hidden_states), attn.add_v_proj(encoder_hidden_states)], dim=1)
        head_dim = key.shape[-1] // attn.heads
        query = _heads_first(attn, query, batch_size, head_dim)
        key = _heads_first(attn, key, batch_size, head_dim)
        value = _heads_first(attn, value, batch_size, head_dim)

        mask = None
        if identity_mask:
            seq_len = query.size(2)
            mask = torch.zeros((seq_len, seq_len), device=query.device, dtype=query.dtype)
            mask[:image_len, :image_len] = float("-inf")
            mask[:image_len, :image_len].fill_diagonal_(0)
            mask = mask.unsqueeze(0).unsqueeze(0)

        out, text_out = _joint_attention(attention, attn, query, key, value, encoder_hidden_states, image_len, mask)
        return attn.to_out[1](attn.to_out[0](out)), text_out

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *args,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._joint is None or self._identity is None:
            raise unbound_error(self)
        _no_mask(self._joint.role, attention_mask)
        if hidden_states.ndim == 4 or encoder_hidden_states is None or encoder_hidden_states.ndim == 4:
            raise ValueError("SD3 PAG attention expects [batch, tokens, channels] image and text hidden states")
        image_len = hidden_states.shape[1]
        if self.cfg:
            uncond, org, ptb = hidden_states.chunk(3)
            hidden_org = torch.cat([uncond, org])
            text_uncond, text_org, text_ptb = encoder_hidden_states.chunk(3)
            text_org = torch.cat([text_uncond, text_org])
        else:
            hidden_org, ptb = hidden_states.chunk(2)
            text_org, text_ptb = encoder_hidden_states.chunk(2)

        out_org, text_out_org = self._path(self._joint, attn, hidden_org, text_org, image_len, identity_mask=False)
        out_ptb, text_out_ptb = self._path(self._identity, attn, ptb, text_ptb, image_len, identity_mask=True)
        return torch.cat([out_org, out_ptb]), torch.cat([text_out_org, text_out_ptb])
