"""Stable Diffusion 3 / 3.5 (``SD3Transformer2DModel``): joint text+image attention, SD3.5-Medium's image-only
``attn2``, and Perturbed-Attention Guidance.

Every block's ``attn`` runs one joint attention over ``[image tokens | text tokens]`` (role ``sd3.joint``).
SD3.5-Medium (``dual_attention_layers`` set) adds an image-only self-attention ``attn2`` to the listed blocks
(role ``sd3.image_self``). Diffusers' ``JointAttnProcessor2_0`` calls ``F.scaled_dot_product_attention`` on
``[B, H, S, D]`` tensors; the omni processors build the same tensors in the same order and hand their
``[B, S, H, D]`` transposes to the backend, so ``TORCH_SDPA`` runs the very same SDPA call.

Perturbed-Attention Guidance (``StableDiffusion3PAGPipeline``) puts ``PAGJointAttnProcessor2_0`` (or its CFG
variant) on the chosen blocks for the duration of a call. Omni attention replaces those too: the original path
goes through ``sd3.joint``; the perturbed path, whose image tokens attend only to themselves through an additive
``-inf`` mask, goes through its own masked role ``sd3.pag_identity``. The role appears on a module only while a PAG
processor is installed on it. Like Diffusers' PAG processors, these skip the q/k norms (see
``OmniPAGJointAttnProcessor``). PAG on a dual-attention ``attn2`` is refused: Diffusers' processor fails there too.

``fuse_qkv_projections()`` installs ``FusedJointAttnProcessor2_0``; omni attention replaces it with the fused
``to_qkv`` / ``to_added_qkv`` projections and, like Diffusers' fused processor, without the q/k norms. On an
SD3.5-Medium ``attn2`` (no text tokens), where Diffusers' fused processor fails, the omni processor runs the image
self-attention from the fused projection.

An IP-Adapter (``load_ip_adapter``, ``SD3IPAdapterJointAttnProcessor2_0``) adds a second attention per module: the
normalised image queries over the image keys followed by the IP-Adapter's image-prompt keys, through the role
``sd3.ip_adapter``. The IP-Adapter's image projection (``image_proj``, a small perceiver run once per step) keeps
Diffusers' own processors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from diffusers.models.attention_processor import (
    Attention,
    FusedJointAttnProcessor2_0,
    JointAttnProcessor2_0,
    PAGCFGJointAttnProcessor2_0,
    PAGJointAttnProcessor2_0,
    SD3IPAdapterJointAttnProcessor2_0,
)

from ..attention.processors import OmniAttnProcessor, OmniModuleAttnProcessor, RoleAttention
from .base import CROSS, SELF, AttentionRole, AttentionSite, TransformerDeclaration, head_dim_of, register_transformer
from .base import NORM_PROJ_OUT, unsupported_processor_error

SD3_JOINT = AttentionRole("sd3.joint", SELF)
SD3_IMAGE_SELF = AttentionRole("sd3.image_self", SELF)
SD3_PAG_IDENTITY = AttentionRole("sd3.pag_identity", SELF, masked=True)
SD3_IP_ADAPTER = AttentionRole("sd3.ip_adapter", CROSS)

_PAG_PROCESSORS = (PAGJointAttnProcessor2_0, PAGCFGJointAttnProcessor2_0)


def _heads_first(attn: Attention, tensor: torch.Tensor, batch_size: int, head_dim: int) -> torch.Tensor:
    return tensor.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)


def _no_mask(attn_name: str, attention_mask: torch.Tensor | None) -> None:
    # Diffusers' JointAttnProcessor2_0 drops a mask without a word; omni attention never ignores one silently.
    if attention_mask is not None:
        raise ValueError(
            f"SD3 {attn_name} attention received an attention_mask, which Diffusers' JointAttnProcessor2_0 ignores; "
            "omni attention does not drop masks silently. Remove attention_mask from joint_attention_kwargs."
        )


def _unbound_error(processor: Any) -> RuntimeError:
    return RuntimeError(
        f"{type(processor).__name__}() was built without a backend (Diffusers re-instantiates processor classes "
        "when it unloads IP-Adapters); omni attention re-applies itself at the model's next forward. Call the "
        "model, not the attention module, or call enable_omni_attention() again."
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
            raise _unbound_error(self)
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
        self._attention = next(ra for role, ra in attend.items() if role != SD3_IP_ADAPTER.role)
        self._ip_attention = attend[SD3_IP_ADAPTER.role]
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
        self._joint = attend[SD3_JOINT.role]
        self._identity = attend[SD3_PAG_IDENTITY.role]

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


def _unwrap(processor):
    return processor.original if isinstance(processor, OmniAttnProcessor) else processor


def _find_sites(model: nn.Module) -> list[AttentionSite]:
    sites = []
    for name, module in model.named_modules():
        # The IP-Adapter's image projection (``image_proj``, a small perceiver) keeps Diffusers' processors.
        if not isinstance(module, Attention) or not name.startswith("transformer_blocks."):
            continue
        processor = _unwrap(module.processor)
        if name.endswith(".attn2"):
            roles = (SD3_IMAGE_SELF,)
        elif isinstance(processor, _PAG_PROCESSORS):
            roles = (SD3_JOINT, SD3_PAG_IDENTITY)
        else:
            roles = (SD3_JOINT,)
        if isinstance(processor, SD3IPAdapterJointAttnProcessor2_0):
            roles += (SD3_IP_ADAPTER,)
        sites.append(AttentionSite(name, module, roles, head_dim_of(module)))
    return sites


_JOINT_PROCESSORS = (JointAttnProcessor2_0, FusedJointAttnProcessor2_0)


def _make_processor(site: AttentionSite, original, attend: dict[str, RoleAttention]) -> OmniAttnProcessor:
    original = _unwrap(original)
    if isinstance(original, SD3IPAdapterJointAttnProcessor2_0):
        return OmniSD3IPAdapterJointAttnProcessor(original, attend)
    if isinstance(original, _PAG_PROCESSORS):
        if SD3_PAG_IDENTITY.role not in attend:
            raise ValueError(
                f"attention module {site.name!r} is an SD3.5 dual-attention image-only attn2 and got "
                f"{type(original).__name__}, which needs text tokens (Diffusers' own processor fails there too); "
                "choose pag_applied_layers outside the transformer's dual_attention_layers"
            )
        return OmniPAGJointAttnProcessor(original, attend, cfg=isinstance(original, PAGCFGJointAttnProcessor2_0))
    if type(original) not in _JOINT_PROCESSORS:
        raise unsupported_processor_error(
            site, original, (*_JOINT_PROCESSORS, SD3IPAdapterJointAttnProcessor2_0, *_PAG_PROCESSORS)
        )
    return OmniJointAttnProcessor(original, attend)


SD3 = register_transformer(
    TransformerDeclaration(
        name="sd3",
        class_names=("SD3Transformer2DModel",),
        blocks_attrs=("transformer_blocks",),
        tail_attrs=NORM_PROJ_OUT,
        find_sites=_find_sites,
        make_processor=_make_processor,
        # Perturbed-Attention Guidance passes an additive identity mask on its perturbed path.
        mask_free=False,
        display_name="Stable Diffusion 3 / 3.5",
        example_checkpoint="stabilityai/stable-diffusion-3.5-medium",
        roles=(SD3_JOINT, SD3_IMAGE_SELF, SD3_PAG_IDENTITY, SD3_IP_ADAPTER),
    )
)
