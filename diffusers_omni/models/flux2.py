"""FLUX.2 (``Flux2Transformer2DModel``): double-stream joint attention and parallel single-stream blocks.

The single-stream blocks (``Flux2ParallelSelfAttention``) project QKV and the MLP input with one fused linear
and project the attention and MLP outputs with one fused linear; ``fuse_qkv_projections`` skips them.

The KV-cache processors (installed by ``Flux2KleinKVPipeline``, which swaps every block's processor in its
``__init__``) cache the reference-image tokens' K/V on the first step ("extract") and inject them afterwards
("cached"). In extract mode one processor makes two attention calls: text+image queries over every token
(the block's own role) and reference queries over the reference tokens only (``flux2.reference``).
"""

from __future__ import annotations

import torch.nn as nn
from diffusers.models.transformers.transformer_flux2 import (
    Flux2Attention,
    Flux2AttnProcessor,
    Flux2KVAttnProcessor,
    Flux2KVParallelSelfAttnProcessor,
    Flux2ParallelSelfAttention,
    Flux2ParallelSelfAttnProcessor,
)

from ..attention.processors import routed_processor_class
from .base import SELF, AttentionRole, AttentionSite, TransformerDeclaration, head_dim_of, register_transformer
from .base import NORM_PROJ_OUT, routed_processors, unwrap_processor

FLUX2_JOINT = AttentionRole("flux2.joint", SELF)
FLUX2_SINGLE = AttentionRole("flux2.single", SELF)
FLUX2_REFERENCE = AttentionRole("flux2.reference", SELF)

_KV_PROCESSORS = (Flux2KVAttnProcessor, Flux2KVParallelSelfAttnProcessor)


# Diffusers' processors run as they are, their attention calls routed to the module's roles by call site: the
# reference queries over the reference tokens (KV-cache extract mode: Diffusers' ``_flux2_kv_causal_attention``
# names that result ``attn_ref``) to ``flux2.reference``, every other call to the block's own role.
OmniFlux2AttnProcessor = routed_processor_class(Flux2AttnProcessor)
OmniFlux2KVAttnProcessor = routed_processor_class(Flux2KVAttnProcessor)
OmniFlux2ParallelSelfAttnProcessor = routed_processor_class(Flux2ParallelSelfAttnProcessor)
OmniFlux2KVParallelSelfAttnProcessor = routed_processor_class(Flux2KVParallelSelfAttnProcessor)


def _find_sites(model: nn.Module) -> list[AttentionSite]:
    sites = []
    for name, module in model.named_modules():
        if isinstance(module, Flux2Attention):
            roles: tuple[AttentionRole, ...] = (FLUX2_JOINT,)
        elif isinstance(module, Flux2ParallelSelfAttention):
            roles = (FLUX2_SINGLE,)
        else:
            continue
        if isinstance(unwrap_processor(module.processor), _KV_PROCESSORS):
            roles += (FLUX2_REFERENCE,)
        sites.append(AttentionSite(name, module, roles, head_dim_of(module)))
    return sites


_make_processor = routed_processors(
    Flux2AttnProcessor, Flux2KVAttnProcessor, Flux2ParallelSelfAttnProcessor, Flux2KVParallelSelfAttnProcessor,
    calls={"attn_ref": FLUX2_REFERENCE},
)


FLUX2 = register_transformer(
    TransformerDeclaration(
        name="flux2",
        class_names=("Flux2Transformer2DModel",),
        blocks_attrs=("transformer_blocks", "single_transformer_blocks"),
        tail_attrs=NORM_PROJ_OUT,
        find_sites=_find_sites,
        make_processor=_make_processor,
        mask_free=True,
        display_name="FLUX.2",
        example_checkpoint="black-forest-labs/FLUX.2-dev",
        roles=(FLUX2_JOINT, FLUX2_SINGLE, FLUX2_REFERENCE),
    )
)
