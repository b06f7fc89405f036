"""SoulX-Singer (``DiffLlama``, the flow-matching estimator at ``cfm_decoder.model.diff_estimator``).

Every decoder layer's ``self_attn`` (``DiffLlamaAttention``) makes one bidirectional self-attention call over the
``[prompt, target]`` mel frames (the conditional pass) or the target frames alone (the unconditional pass of
classifier-free guidance). The pipelines pass no frame mask; a caller of the estimator may pass a ``[B, S]`` frame
mask, which every layer receives as the same tensor and views as ``[B, 1, 1, S]``.
"""

from __future__ import annotations

import torch.nn as nn

from ..architectures.soulx_singer import DiffLlamaAttention, DiffLlamaAttnProcessor
from ..attention.processors import routed_processor_class
from .base import SELF, AttentionRole, AttentionSite, TransformerDeclaration, register_transformer, routed_processors

SELF_ATTENTION = AttentionRole("soulx_singer.self", SELF, masked=True)

# The architecture's processor runs as it is; its one attention call per module goes to the self-attention role, the
# frame mask (``attention_mask``) shared across modules.
OmniDiffLlamaAttnProcessor = routed_processor_class(DiffLlamaAttnProcessor)


def _find_sites(model: nn.Module) -> list[AttentionSite]:
    return [
        AttentionSite(name, module, (SELF_ATTENTION,), int(module.head_dim))
        for name, module in model.named_modules()
        if isinstance(module, DiffLlamaAttention)
    ]


SOULX_SINGER = register_transformer(
    TransformerDeclaration(
        name="soulx_singer",
        class_names=("DiffLlama",),
        blocks_attrs=("layers",),
        find_sites=_find_sites,
        make_processor=routed_processors(DiffLlamaAttnProcessor, mask_source="attention_mask"),
        mask_free=False,
        display_name="SoulX-Singer",
        example_checkpoint="Soul-AILab/SoulX-Singer",
        roles=(SELF_ATTENTION,),
        tail_attrs=("norm", "mel_out_mlp"),
    )
)
