"""HunyuanVideo-1.5 (``HunyuanVideo15Transformer3DModel``): masked joint video+text attention and the text token
refiner.

Both attention calls are always masked when driven by the Diffusers pipelines:

* ``hunyuanvideo15.joint``: every dual-stream block attends over ``[video tokens | text tokens]``. Diffusers' own
  ``HunyuanVideo15AttnProcessor2_0`` runs (routed): it turns the text key-padding mask into a dense
  ``[B, 1, S, S]`` boolean mask (valid query × valid key) in every layer, and its one attention call goes to the
  role's backend.
* ``hunyuanvideo15.token_refiner``: the refiner in ``context_embedder`` uses Diffusers' legacy ``Attention`` with
  ``AttnProcessor2_0``, which calls ``F.scaled_dot_product_attention`` directly in ``[B, H, S, D]`` with a dense
  ``[B, H, S, S]`` mask; it runs routed too (as in SDXL's UNet), its call on the backend resolved for its own role.
"""

from __future__ import annotations

import torch.nn as nn
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

from ..attention.processors import OmniAttnProcessor, RoleAttention, routed_processor_class
from .base import SELF, AttentionRole, AttentionSite, TransformerDeclaration, head_dim_of, register_transformer
from .base import NORM_PROJ_OUT, routed_processors
from .sdxl import PLAIN_PROCESSORS, STAND_INS

JOINT = AttentionRole("hunyuanvideo15.joint", SELF, masked=True)
TOKEN_REFINER = AttentionRole("hunyuanvideo15.token_refiner", SELF, masked=True)

_REFINER_PREFIX = "context_embedder."


# Diffusers' processor runs as it is; its one attention call goes to the module's role. It builds the dense mask
# from the text key-padding mask (``attention_mask``, the same tensor in every block of a forward) in every layer,
# as Diffusers does; with it named as the mask source, every layer hands the backend the first layer's mask, so the
# all-True check runs once per forward.
OmniHunyuanVideo15AttnProcessor = routed_processor_class(HunyuanVideo15AttnProcessor2_0)
_make_joint_processor = routed_processors(HunyuanVideo15AttnProcessor2_0, mask_source="attention_mask")
# The refiner's legacy processors, as in SDXL's UNet (exact types: IP-adapter, PAG, ... do more than attention).
_make_refiner_processor = routed_processors(*PLAIN_PROCESSORS, stand_ins=STAND_INS)


def _find_sites(model: nn.Module) -> list[AttentionSite]:
    sites = []
    for name, module in model.named_modules():
        if not isinstance(module, Attention):
            continue
        role = TOKEN_REFINER if name.startswith(_REFINER_PREFIX) else JOINT
        sites.append(AttentionSite(name, module, (role,), head_dim_of(module)))
    return sites


def _make_processor(site: AttentionSite, original, attend: dict[str, RoleAttention]) -> OmniAttnProcessor:
    if TOKEN_REFINER not in site.roles:
        return _make_joint_processor(site, original, attend)
    return _make_refiner_processor(site, original, attend)


HUNYUANVIDEO15 = register_transformer(
    TransformerDeclaration(
        name="hunyuanvideo15",
        class_names=("HunyuanVideo15Transformer3DModel",),
        # The token refiner (two small blocks inside ``context_embedder``) stays resident.
        blocks_attrs=("transformer_blocks",),
        tail_attrs=NORM_PROJ_OUT,
        find_sites=_find_sites,
        make_processor=_make_processor,
        mask_free=False,
        display_name="HunyuanVideo-1.5",
        example_checkpoint="hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v",
        roles=(TOKEN_REFINER, JOINT),
    )
)
