"""Qwen-Image (``QwenImageTransformer2DModel``): double-stream blocks with one joint text+image attention call.

The text stream comes first in the joint sequence. When the prompts of a batch have different lengths, the
pipeline passes ``encoder_hidden_states_mask`` (``[B, S_txt]``, True for real tokens) and Diffusers' processor
extends it with True for every image token into a ``[B, 1, 1, S_txt + S_img]`` boolean key-padding mask. Diffusers'
pipelines drop the text mask when it is all True, so same-length batches run unmasked.
"""

from __future__ import annotations

import torch.nn as nn
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

from ..attention.processors import routed_processor_class
from .base import SELF, AttentionRole, AttentionSite, TransformerDeclaration, head_dim_of, register_transformer
from .base import NORM_PROJ_OUT, routed_processors

JOINT = AttentionRole("qwenimage.joint", SELF, masked=True)


# Diffusers' processor runs as it is, its one attention call per module routed to ``qwenimage.joint``. Every block
# receives the same ``encoder_hidden_states_mask`` tensor in one forward and Diffusers builds the joint mask from it
# (and the image length) in every block: routed with that argument as the mask source, every block hands the
# backend the first block's joint mask, so the mask policy checks it for all-True once per forward, not per block.
OmniQwenDoubleStreamAttnProcessor = routed_processor_class(QwenDoubleStreamAttnProcessor2_0)


def _find_sites(model: nn.Module) -> list[AttentionSite]:
    return [
        AttentionSite(name, module, (JOINT,), head_dim_of(module))
        for name, module in model.named_modules()
        if isinstance(module, Attention) and name.startswith("transformer_blocks.")
    ]


QWENIMAGE = register_transformer(
    TransformerDeclaration(
        name="qwenimage",
        class_names=("QwenImageTransformer2DModel",),
        blocks_attrs=("transformer_blocks",),
        tail_attrs=NORM_PROJ_OUT,
        find_sites=_find_sites,
        make_processor=routed_processors(QwenDoubleStreamAttnProcessor2_0, mask_source="encoder_hidden_states_mask"),
        mask_free=False,
        display_name="Qwen-Image",
        example_checkpoint="Qwen/Qwen-Image",
        roles=(JOINT,),
    )
)
