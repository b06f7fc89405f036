"""NextStep-1.1 (``NextStepModel``): a causal decoder that reads the prompt, then writes image tokens one by one.

Every decoder layer's ``self_attn`` (``NextStepAttention``) makes one grouped-query attention call
(``nextstep.causal``): 40 query heads over 8 key/value heads in the published model. The call is one of

* the prompt prefill without padding: ``is_causal=True``, no mask tensor;
* a prefill or step with left padding (prompt and negative prompt of different lengths under guidance): a boolean
  ``[batch, 1, queries, keys]`` mask, causal and excluding padding keys (a padding query sees itself);
* a one-token step without padding: no mask, not causal (the one query sees every cached key).

The key/value cache grows by one slot per image token; each call sees the whole cache as its keys. The image
projectors and the flow-matching head (``image_head``) have no attention.
"""

from __future__ import annotations

import torch.nn as nn

from ..architectures.nextstep.modeling_nextstep import NextStepAttention, NextStepAttnProcessor
from ..attention.processors import routed_processor_class
from .base import SELF, AttentionRole, AttentionSite, TransformerDeclaration, register_transformer
from .base import routed_processors

CAUSAL = AttentionRole("nextstep.causal", SELF, masked=True, gqa=True)

# The architecture's processor runs as it is, its one attention call per module routed to ``nextstep.causal``.
OmniNextStepAttnProcessor = routed_processor_class(NextStepAttnProcessor, "OmniNextStepAttnProcessor")


def _find_sites(model: nn.Module) -> list[AttentionSite]:
    return [
        AttentionSite(name, module, (CAUSAL,), int(module.head_dim))
        for name, module in model.named_modules()
        if isinstance(module, NextStepAttention)
    ]


NEXTSTEP = register_transformer(
    TransformerDeclaration(
        name="nextstep",
        class_names=("NextStepModel",),
        blocks_attrs=("layers",),
        find_sites=_find_sites,
        make_processor=routed_processors(NextStepAttnProcessor),
        mask_free=False,
        display_name="NextStep-1.1",
        example_checkpoint="stepfun-ai/NextStep-1.1",
        roles=(CAUSAL,),
        # One backbone reads the prompt and writes every token: OmniNextStep11Pipeline refuses model-level offload.
        model_level_offload=False,
    )
)
