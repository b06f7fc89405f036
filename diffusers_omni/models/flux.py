"""FLUX.1 (``FluxTransformer2DModel``): joint double-stream blocks, single-stream blocks, IP-adapter image attention."""

from __future__ import annotations

from typing import Callable

import torch.nn as nn
from diffusers.models.transformers.transformer_flux import FluxAttention, FluxAttnProcessor, FluxIPAdapterAttnProcessor

from ..attention.processors import routed_processor_class
from .base import CROSS, SELF, AttentionRole, AttentionSite, TransformerDeclaration, head_dim_of, register_transformer
from .base import NORM_PROJ_OUT, routed_processors, unwrap_processor

JOINT = AttentionRole("flux.joint", SELF)
SINGLE = AttentionRole("flux.single", SELF)
IP_ADAPTER = AttentionRole("flux.ip_adapter", CROSS)


# Diffusers' processors run as they are; their attention calls go to the module's roles by call site: each
# IP-adapter's image attention (Diffusers names its result ``current_ip_hidden_states``) to ``flux.ip_adapter``,
# the joint (or single-stream) call to the module's own role. Re-instantiated with no arguments (Diffusers does ``type(processor)()`` in
# ``load_ip_adapter`` and ``unload_ip_adapter``), a routed class is an unbound placeholder until the next forward.
OmniFluxAttnProcessor = routed_processor_class(FluxAttnProcessor)
OmniFluxIPAdapterAttnProcessor = routed_processor_class(FluxIPAdapterAttnProcessor)


def flux_attention_sites(
    joint: AttentionRole, single: AttentionRole, ip_adapter: AttentionRole
) -> Callable[[nn.Module], list[AttentionSite]]:
    """``find_sites`` for a model built from ``FluxAttention`` modules (FLUX.1, Chroma): ``joint`` in the
    double-stream blocks, ``single`` in ``single_transformer_blocks``, plus ``ip_adapter`` where an IP-adapter
    processor is installed."""

    def find_sites(model: nn.Module) -> list[AttentionSite]:
        sites = []
        for name, module in model.named_modules():
            if not isinstance(module, FluxAttention):
                continue
            roles: tuple[AttentionRole, ...]
            roles = (single,) if name.startswith("single_transformer_blocks.") else (joint,)
            if isinstance(unwrap_processor(module.processor), FluxIPAdapterAttnProcessor):
                roles += (ip_adapter,)
            sites.append(AttentionSite(name, module, roles, head_dim_of(module)))
        return sites

    return find_sites


def flux_processors(ip_adapter: AttentionRole):
    """``make_processor`` for ``FluxAttention`` modules (FLUX.1, Chroma), the IP-adapters' calls to ``ip_adapter``."""
    return routed_processors(
        FluxAttnProcessor, FluxIPAdapterAttnProcessor, calls={"current_ip_hidden_states": ip_adapter}
    )


FLUX = register_transformer(
    TransformerDeclaration(
        name="flux",
        class_names=("FluxTransformer2DModel",),
        blocks_attrs=("transformer_blocks", "single_transformer_blocks"),
        tail_attrs=NORM_PROJ_OUT,
        find_sites=flux_attention_sites(JOINT, SINGLE, IP_ADAPTER),
        make_processor=flux_processors(IP_ADAPTER),
        mask_free=True,
        display_name="FLUX.1",
        example_checkpoint="black-forest-labs/FLUX.1-dev",
        roles=(JOINT, SINGLE, IP_ADAPTER),
    )
)
