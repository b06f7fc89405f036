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

import torch.nn as nn
from diffusers.models.transformers.transformer_ltx2 import (
    LTX2Attention,
    LTX2AudioVideoAttnProcessor,
    LTX2PerturbedAttnProcessor,
)

from ..attention.processors import routed_processor_class
from .base import CROSS, SELF, AttentionRole, AttentionSite, TransformerDeclaration, head_dim_of, register_transformer
from .base import NORM_PROJ_OUT, routed_processors

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


# Diffusers' processors run as they are; each makes (at most) one attention call, routed to its module's role. The
# perturbed processor (LTX-2.3 spatio-temporal guidance) skips the call when every batch element is perturbed.
OmniLTX2AttnProcessor = routed_processor_class(LTX2AudioVideoAttnProcessor)
OmniLTX2PerturbedAttnProcessor = routed_processor_class(LTX2PerturbedAttnProcessor)


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


_make_processor = routed_processors(LTX2AudioVideoAttnProcessor, LTX2PerturbedAttnProcessor)


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
