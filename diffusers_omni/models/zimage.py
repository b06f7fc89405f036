"""Z-Image (``ZImageTransformer2DModel``): single-stream self-attention in three stages.

Forward order: the noise refiner (image tokens only), the context refiner (caption tokens only), for the Omni variant
a SigLIP refiner (condition-image tokens), then the main layers over the unified ``[image, caption]`` sequence. The
model has no ``set_attn_processor``; its attention modules are Diffusers ``Attention`` objects found by walking the
model.

Masks: each stage pads its batch to the longest item and builds a ``[B, S]`` boolean key-padding mask when lengths
differ. Captions are padded to a multiple of 32 tokens per prompt, so prompts (or a prompt and its negative prompt
under classifier-free guidance) whose padded lengths differ give the context refiner and the main layers a mask.
The noise refiner is masked only when the images of one batch differ in size, which no Diffusers pipeline of this
family produces (one height and width per call); a mask reaching a mask-less backend there raises at the call.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

from ..attention.processors import OmniAttnProcessor, RoleAttention
from .base import SELF, AttentionRole, AttentionSite, TransformerDeclaration, head_dim_of, register_transformer
from .base import processor_factory

NOISE_REFINER = AttentionRole("zimage.noise_refiner", SELF)
CONTEXT_REFINER = AttentionRole("zimage.context_refiner", SELF, masked=True)
SIGLIP_REFINER = AttentionRole("zimage.siglip_refiner", SELF, masked=True)
JOINT = AttentionRole("zimage.joint", SELF, masked=True)

_ROLE_BY_STAGE = {
    "noise_refiner": NOISE_REFINER,
    "context_refiner": CONTEXT_REFINER,
    "siglip_refiner": SIGLIP_REFINER,
    "layers": JOINT,
}


def _apply_rotary_emb(x_in: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    # As ZSingleStreamAttnProcessor's inner function.
    with torch.amp.autocast("cuda", enabled=False):
        x = torch.view_as_complex(x_in.float().reshape(*x_in.shape[:-1], -1, 2))
        freqs_cis = freqs_cis.unsqueeze(2)
        x_out = torch.view_as_real(x * freqs_cis).flatten(3)
        return x_out.type_as(x_in)


class OmniZImageAttnProcessor(OmniAttnProcessor):
    """Z-Image single-stream attention through the backend resolved for the module's stage role.

    Mirrors ``ZSingleStreamAttnProcessor``. A ``[B, S]`` padding mask is handed to the backend as it is (backends
    broadcast it as Diffusers' ``[B, 1, 1, S]`` view), so every layer of a stage sees the same mask tensor and the
    all-True check runs once per stage and forward.
    """

    def __init__(self, original, attend: dict[str, RoleAttention]) -> None:
        super().__init__(original, attend)
        (self._attention,) = attend.values()

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        freqs_cis: torch.Tensor | None = None,
    ) -> torch.Tensor:
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)

        query = query.unflatten(-1, (attn.heads, -1))
        key = key.unflatten(-1, (attn.heads, -1))
        value = value.unflatten(-1, (attn.heads, -1))

        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        if freqs_cis is not None:
            query = _apply_rotary_emb(query, freqs_cis)
            key = _apply_rotary_emb(key, freqs_cis)

        dtype = query.dtype
        query, key = query.to(dtype), key.to(dtype)

        out = self._attention(query, key, value, attn_mask=attention_mask)
        out = out.flatten(2, 3).to(dtype)

        output = attn.to_out[0](out)
        if len(attn.to_out) > 1:
            output = attn.to_out[1](output)
        return output


def _find_sites(model: nn.Module) -> list[AttentionSite]:
    sites = []
    for name, module in model.named_modules():
        if not isinstance(module, Attention):
            continue
        role = _ROLE_BY_STAGE.get(name.split(".", 1)[0])
        if role is None:
            raise TypeError(f"Z-Image attention module {name!r} is outside the known stages {list(_ROLE_BY_STAGE)}")
        sites.append(AttentionSite(name, module, (role,), head_dim_of(module)))
    return sites


ZIMAGE = register_transformer(
    TransformerDeclaration(
        name="zimage",
        class_names=("ZImageTransformer2DModel",),
        # The Omni variant's optional siglip_refiner (between context_refiner and layers) stays resident.
        blocks_attrs=("noise_refiner", "context_refiner", "layers"),
        find_sites=_find_sites,
        make_processor=processor_factory(OmniZImageAttnProcessor, ZSingleStreamAttnProcessor),
        mask_free=False,
        display_name="Z-Image",
        example_checkpoint="Tongyi-MAI/Z-Image-Turbo",
        roles=(NOISE_REFINER, CONTEXT_REFINER, SIGLIP_REFINER, JOINT),
    )
)
