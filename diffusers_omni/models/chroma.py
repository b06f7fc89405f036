"""Chroma (``ChromaTransformer2DModel``): FLUX.1's attention modules and processors, always with a padding mask.

Chroma's pipelines mask all T5 padding tokens but one, and every block expands the ``[B, S]`` mask into
``mask[:, None, None, :] * mask[:, None, :, None]`` (``[B, 1, S, S]``) before attention, so every joint and single
call is masked. In Diffusers 0.42 that mask is a float 0/1 tensor (``_get_t5_prompt_embeds`` casts it to the
latent dtype), which SDPA adds to the scores as a bias; it is passed on unchanged, exactly as stock Diffusers
does. A boolean mask (a caller's own ``attention_mask``) is treated as a boolean mask, and dropped when all True.
"""

from __future__ import annotations

from .base import NORM_PROJ_OUT, CROSS, SELF, AttentionRole, TransformerDeclaration, register_transformer
from .flux import flux_attention_sites, flux_processors

CHROMA_JOINT = AttentionRole("chroma.joint", SELF, masked=True)
CHROMA_SINGLE = AttentionRole("chroma.single", SELF, masked=True)
CHROMA_IP_ADAPTER = AttentionRole("chroma.ip_adapter", CROSS)

CHROMA = register_transformer(
    TransformerDeclaration(
        name="chroma",
        class_names=("ChromaTransformer2DModel",),
        blocks_attrs=("transformer_blocks", "single_transformer_blocks"),
        tail_attrs=NORM_PROJ_OUT,
        find_sites=flux_attention_sites(CHROMA_JOINT, CHROMA_SINGLE, CHROMA_IP_ADAPTER),
        make_processor=flux_processors(CHROMA_IP_ADAPTER),
        mask_free=False,
        display_name="Chroma",
        example_checkpoint="lodestones/Chroma1-HD",
        roles=(CHROMA_JOINT, CHROMA_SINGLE, CHROMA_IP_ADAPTER),
    )
)
