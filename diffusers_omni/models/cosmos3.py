"""Cosmos3 (``Cosmos3OmniTransformer``): one packed mixture-of-transformers that is both the reasoner and the
generator.

Every decoder layer's ``self_attn`` (``Cosmos3PackedMoTAttention``) makes two attention calls, both with grouped
query attention (fewer key/value heads than query heads) and no mask tensor:

* ``cosmos3.understanding``: the understanding (text/reasoning) tokens attend to themselves causally
  (``is_causal=True``);
* ``cosmos3.generation``: the generation (vision/sound/action) tokens attend to the understanding and generation
  keys together, without a mask (``is_causal=False``).

``is_causal`` and ``enable_gqa`` reach the resolved backend exactly as Diffusers passes them to
``dispatch_attention_fn``.
"""

from __future__ import annotations

import torch.nn as nn
from diffusers.models.transformers.transformer_cosmos3 import Cosmos3AttnProcessor, Cosmos3PackedMoTAttention

from ..attention.processors import routed_processor_class
from .base import SELF, AttentionRole, AttentionSite, TransformerDeclaration, register_transformer
from .base import routed_processors

UNDERSTANDING = AttentionRole("cosmos3.understanding", SELF, gqa=True)
GENERATION = AttentionRole("cosmos3.generation", SELF, gqa=True)

# Diffusers' processor runs as it is; its two attention calls go to the module's roles by call site: the causal
# understanding call (``causal_out``) and the generation call over ``[understanding | generation]`` keys
# (``full_out``).
OmniCosmos3AttnProcessor = routed_processor_class(Cosmos3AttnProcessor)


def _find_sites(model: nn.Module) -> list[AttentionSite]:
    return [
        AttentionSite(name, module, (UNDERSTANDING, GENERATION), int(module.head_dim))
        for name, module in model.named_modules()
        if isinstance(module, Cosmos3PackedMoTAttention)
    ]


_make_processor = routed_processors(Cosmos3AttnProcessor, calls={"causal_out": UNDERSTANDING, "full_out": GENERATION})


COSMOS3 = register_transformer(
    TransformerDeclaration(
        name="cosmos3",
        class_names=("Cosmos3OmniTransformer",),
        blocks_attrs=("layers",),
        find_sites=_find_sites,
        make_processor=_make_processor,
        mask_free=True,
        display_name="Cosmos3",
        example_checkpoint="nvidia/Cosmos3-Nano",
        roles=(UNDERSTANDING, GENERATION),
    )
)
