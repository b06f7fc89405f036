"""BAGEL (``Qwen2MoTModel``, the language backbone of ``BagelPipeline``): one attention call per decoder layer, in
one of two modes.

Each layer's ``self_attn`` (``BagelMoTAttention``) makes one grouped-query attention call per forward; the forward's
mode decides its role:

* ``bagel.understanding``: text tokens (the prompt) attend causally to the cache and themselves. The prompt, the
  first thing in the cache, runs with ``is_causal=True`` and no mask; text extending a non-empty cache passes a
  boolean ``[1, 1, new, cache + new]`` mask instead (causal aligned to the last key).
* ``bagel.generation``: the image's generation tokens (and its start and end markers) attend to the prompt's
  cached keys and to each other, bidirectionally, without a mask.

The processor's attention call is its ``_attend`` method; the omni processor routes it by mode to the role's
backend, the rest of the processor (the mixture-of-transformers projections, norms, rotary embedding, cache) runs
as it is.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..architectures.bagel.modeling_bagel import UNDERSTANDING, BagelMoTAttention, BagelMoTAttnProcessor
from ..attention.processors import OmniAttnProcessor, RoleAttention
from .base import SELF, AttentionRole, AttentionSite, TransformerDeclaration, register_transformer
from .base import unsupported_processor_error

UNDERSTANDING_ROLE = AttentionRole("bagel.understanding", SELF, masked=True, gqa=True)
GENERATION_ROLE = AttentionRole("bagel.generation", SELF, gqa=True)


class OmniBagelMoTAttnProcessor(OmniAttnProcessor, BagelMoTAttnProcessor):
    """``BagelMoTAttnProcessor`` whose attention call goes to the backend of its mode's role."""

    def __init__(self, original: BagelMoTAttnProcessor, attend: dict[str, RoleAttention]) -> None:
        OmniAttnProcessor.__init__(self, original, attend)

    def _attend(self, mode: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
        role = UNDERSTANDING_ROLE if mode == UNDERSTANDING else GENERATION_ROLE
        return self.attend[role.role](query, key, value, attn_mask, 0.0, is_causal, None, True)


def _find_sites(model: nn.Module) -> list[AttentionSite]:
    return [
        AttentionSite(name, module, (UNDERSTANDING_ROLE, GENERATION_ROLE), int(module.head_dim))
        for name, module in model.named_modules()
        if isinstance(module, BagelMoTAttention)
    ]


def _make_processor(site: AttentionSite, original: Any, attend: dict[str, RoleAttention]) -> OmniAttnProcessor:
    if isinstance(original, OmniBagelMoTAttnProcessor):
        original = original.original
    if type(original) is not BagelMoTAttnProcessor:
        raise unsupported_processor_error(site, original, (BagelMoTAttnProcessor,))
    return OmniBagelMoTAttnProcessor(original, attend)


BAGEL = register_transformer(
    TransformerDeclaration(
        name="bagel",
        class_names=("Qwen2MoTModel",),
        blocks_attrs=("layers",),
        find_sites=_find_sites,
        make_processor=_make_processor,
        mask_free=False,
        display_name="BAGEL",
        example_checkpoint="ByteDance-Seed/BAGEL-7B-MoT",
        roles=(UNDERSTANDING_ROLE, GENERATION_ROLE),
    )
)
