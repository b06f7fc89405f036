"""LTX-2 (``LTX2VideoTransformer3DModel``) and its text connectors (``LTX2TextConnectors``).

Each audio-video block makes six attention calls, each on its own ``LTX2Attention`` module:

* ``attn1`` / ``audio_attn1``: video and audio self-attention (``ltx2.video_self``, ``ltx2.audio_self``);
* ``attn2`` / ``audio_attn2``: video→text and audio→text cross-attention, always masked by the pipelines with
  the prompt's additive padding bias (``ltx2.video_text``, ``ltx2.audio_text``);
* ``audio_to_video_attn``: video queries, audio keys (``ltx2.audio_to_video``) and ``video_to_audio_attn``: audio
  queries, video keys (``ltx2.video_to_audio``), with separate query and key RoPE.

The text connectors (a separate pipeline component run once per prompt) refine the Gemma features for each
stream with 1-D self-attention blocks, always with an additive mask (all zeros when learnable registers replace
the padding): ``ltx2.video_connector`` and ``ltx2.audio_connector``.

Masks here are additive float biases, which omni attention passes through unchanged (only all-True boolean masks
are dropped).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from diffusers.models.transformers.transformer_ltx2 import (
    LTX2Attention,
    LTX2AudioVideoAttnProcessor,
    LTX2PerturbedAttnProcessor,
    apply_interleaved_rotary_emb,
    apply_split_rotary_emb,
)

from ..attention.processors import OmniAttnProcessor, RoleAttention
from .base import CROSS, SELF, AttentionRole, AttentionSite, TransformerDeclaration, head_dim_of, register_transformer
from .base import NORM_PROJ_OUT, unsupported_processor_error

VIDEO_SELF = AttentionRole("ltx2.video_self", SELF)
AUDIO_SELF = AttentionRole("ltx2.audio_self", SELF)
VIDEO_TEXT = AttentionRole("ltx2.video_text", CROSS, masked=True)
AUDIO_TEXT = AttentionRole("ltx2.audio_text", CROSS, masked=True)
AUDIO_TO_VIDEO = AttentionRole("ltx2.audio_to_video", CROSS)
VIDEO_TO_AUDIO = AttentionRole("ltx2.video_to_audio", CROSS)
VIDEO_CONNECTOR = AttentionRole("ltx2.video_connector", SELF, masked=True)
AUDIO_CONNECTOR = AttentionRole("ltx2.audio_connector", SELF, masked=True)

_BLOCK_ROLES = {
    "attn1": VIDEO_SELF,
    "audio_attn1": AUDIO_SELF,
    "attn2": VIDEO_TEXT,
    "audio_attn2": AUDIO_TEXT,
    "audio_to_video_attn": AUDIO_TO_VIDEO,
    "video_to_audio_attn": VIDEO_TO_AUDIO,
}
_CONNECTOR_ROLES = {"video_connector": VIDEO_CONNECTOR, "audio_connector": AUDIO_CONNECTOR}


def _rotate(attn: LTX2Attention, query, key, query_rotary_emb, key_rotary_emb):
    if query_rotary_emb is None:
        return query, key
    key_rotary_emb = key_rotary_emb if key_rotary_emb is not None else query_rotary_emb
    if attn.rope_type == "interleaved":
        return apply_interleaved_rotary_emb(query, query_rotary_emb), apply_interleaved_rotary_emb(key, key_rotary_emb)
    if attn.rope_type == "split":
        return apply_split_rotary_emb(query, query_rotary_emb), apply_split_rotary_emb(key, key_rotary_emb)
    return query, key


def _prepare_mask(attn: LTX2Attention, attention_mask, hidden_states, encoder_hidden_states):
    if attention_mask is None:
        return None
    batch_size, sequence_length, _ = (
        hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
    )
    attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
    return attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])


def _gate_and_project(attn: LTX2Attention, hidden_states, gate_logits):
    if gate_logits is not None:
        hidden_states = hidden_states.unflatten(2, (attn.heads, -1))
        hidden_states = hidden_states * (2.0 * torch.sigmoid(gate_logits)).unsqueeze(-1)
        hidden_states = hidden_states.flatten(2, 3)
    return attn.to_out[1](attn.to_out[0](hidden_states))


class OmniLTX2AttnProcessor(OmniAttnProcessor):
    """``LTX2AudioVideoAttnProcessor`` through the module's role: QK RMSNorm across heads, separate query and key
    RoPE (for the audio↔video calls), optional per-head gates, one attention call."""

    def __init__(self, original, attend: dict[str, RoleAttention]) -> None:
        super().__init__(original, attend)
        (self._attention,) = attend.values()

    def _attend(
        self, attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb, key_rotary_emb, value=None
    ):
        query = attn.norm_q(attn.to_q(hidden_states))
        key = attn.norm_k(attn.to_k(encoder_hidden_states))
        value = attn.to_v(encoder_hidden_states) if value is None else value
        query, key = _rotate(attn, query, key, query_rotary_emb, key_rotary_emb)
        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        out = self._attention(query, key, value, attn_mask=attention_mask)
        return out.flatten(2, 3).to(query.dtype)

    def __call__(
        self,
        attn: LTX2Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        query_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        key_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        attention_mask = _prepare_mask(attn, attention_mask, hidden_states, encoder_hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        gate_logits = attn.to_gate_logits(hidden_states) if attn.to_gate_logits is not None else None
        out = self._attend(attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb, key_rotary_emb)
        return _gate_and_project(attn, out, gate_logits)


class OmniLTX2PerturbedAttnProcessor(OmniLTX2AttnProcessor):
    """``LTX2PerturbedAttnProcessor`` (LTX-2.3 spatio-temporal guidance): batch elements with perturbation mask 0
    skip attention and keep the value projection."""

    def __call__(
        self,
        attn: LTX2Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        query_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        key_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        perturbation_mask: torch.Tensor | None = None,
        all_perturbed: bool | None = None,
    ) -> torch.Tensor:
        attention_mask = _prepare_mask(attn, attention_mask, hidden_states, encoder_hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        gate_logits = attn.to_gate_logits(hidden_states) if attn.to_gate_logits is not None else None
        if all_perturbed is None:
            all_perturbed = torch.all(perturbation_mask == 0) if perturbation_mask is not None else False
        value = attn.to_v(encoder_hidden_states)
        if all_perturbed:
            out = value
        else:
            out = self._attend(
                attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb, key_rotary_emb, value
            )
            if perturbation_mask is not None:
                out = torch.lerp(value, out, perturbation_mask)
        return _gate_and_project(attn, out, gate_logits)


_PROCESSORS = {
    LTX2AudioVideoAttnProcessor: OmniLTX2AttnProcessor,
    LTX2PerturbedAttnProcessor: OmniLTX2PerturbedAttnProcessor,
}


def _find_sites_in(model: nn.Module, role_of) -> list[AttentionSite]:
    sites = []
    for name, module in model.named_modules():
        if isinstance(module, LTX2Attention):
            sites.append(AttentionSite(name, module, (role_of(name),), head_dim_of(module)))
    return sites


def _transformer_sites(model: nn.Module) -> list[AttentionSite]:
    return _find_sites_in(model, lambda name: _BLOCK_ROLES[name.rsplit(".", 1)[-1]])


def _connector_sites(model: nn.Module) -> list[AttentionSite]:
    return _find_sites_in(model, lambda name: _CONNECTOR_ROLES[name.split(".", 1)[0]])


def _make_processor(site: AttentionSite, original, attend: dict[str, RoleAttention]) -> OmniLTX2AttnProcessor:
    if isinstance(original, OmniAttnProcessor):
        original = original.original
    omni_cls = _PROCESSORS.get(type(original))
    if omni_cls is None:
        raise unsupported_processor_error(site, original, tuple(_PROCESSORS))
    return omni_cls(original, attend)


LTX2 = register_transformer(
    TransformerDeclaration(
        name="ltx2",
        class_names=("LTX2VideoTransformer3DModel",),
        blocks_attrs=("transformer_blocks",),
        tail_attrs=NORM_PROJ_OUT + ("audio_norm_out", "audio_proj_out"),
        find_sites=_transformer_sites,
        make_processor=_make_processor,
        mask_free=False,
        display_name="LTX-2",
        example_checkpoint="Lightricks/LTX-2",
        roles=(VIDEO_SELF, AUDIO_SELF, VIDEO_TEXT, AUDIO_TEXT, AUDIO_TO_VIDEO, VIDEO_TO_AUDIO),
    )
)

# Same family name: the connectors belong to the LTX-2 pipelines (their roles are ``ltx2.*`` too).
LTX2_CONNECTORS = register_transformer(
    TransformerDeclaration(
        name="ltx2",
        class_names=("LTX2TextConnectors",),
        blocks_attrs=("video_connector.transformer_blocks", "audio_connector.transformer_blocks"),
        find_sites=_connector_sites,
        make_processor=_make_processor,
        mask_free=False,
        display_name="LTX-2 text connectors",
        example_checkpoint="Lightricks/LTX-2",
        roles=(VIDEO_CONNECTOR, AUDIO_CONNECTOR),
    )
)
