"""Qwen-Image (``QwenImageTransformer2DModel``): double-stream blocks with one joint text+image attention call.

The text stream comes first in the joint sequence. When the prompts of a batch have different lengths, the
pipeline passes ``encoder_hidden_states_mask`` (``[B, S_txt]``, True for real tokens) and the processor extends it
with True for every image token into a ``[B, 1, 1, S_txt + S_img]`` boolean key-padding mask. Diffusers' pipelines
drop the text mask when it is all True, so same-length batches run unmasked.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0, apply_rotary_emb_qwen

from ..attention.processors import OmniAttnProcessor, RoleAttention
from .base import SELF, AttentionRole, AttentionSite, TransformerDeclaration, head_dim_of, register_transformer
from .base import NORM_PROJ_OUT, processor_factory

JOINT = AttentionRole("qwenimage.joint", SELF, masked=True)


class _JointMaskCache:
    """The joint ``[B, 1, 1, S_txt + S_img]`` mask of the last text mask seen.

    Every block receives the same ``encoder_hidden_states_mask`` tensor during one forward; building the joint mask
    once per text mask gives every block the same mask tensor, so the mask policy checks it for all-True once per
    forward instead of once per block (one device-to-host read each).
    """

    __slots__ = ("_text_mask", "_image_len", "_joint")

    def __init__(self) -> None:
        self._text_mask: torch.Tensor | None = None
        self._image_len = -1
        self._joint: torch.Tensor | None = None

    def __call__(self, text_mask: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        image_len = hidden_states.shape[1]
        if torch.compiler.is_compiling():
            return _joint_mask(text_mask, hidden_states)
        if text_mask is not self._text_mask or image_len != self._image_len:
            self._text_mask, self._image_len = text_mask, image_len
            self._joint = _joint_mask(text_mask, hidden_states)
        return self._joint


def _joint_mask(text_mask: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
    # Same operations as QwenDoubleStreamAttnProcessor2_0.
    image_mask = torch.ones((hidden_states.shape[0], hidden_states.shape[1]), dtype=torch.bool, device=hidden_states.device)
    return torch.cat([text_mask, image_mask], dim=1)[:, None, None, :]


# One cache for the process: forwards run one at a time, and holding the last text mask keeps its identity unique.
_JOINT_MASKS = _JointMaskCache()


class OmniQwenDoubleStreamAttnProcessor(OmniAttnProcessor):
    """Qwen-Image joint attention through the backend resolved for ``qwenimage.joint``.

    Mirrors ``QwenDoubleStreamAttnProcessor2_0`` operation by operation: separate image and text projections, QK
    RMS norms, complex rotary embeddings per stream, ``[text, image]`` concatenation, one attention call.
    """

    def __init__(self, original, attend: dict[str, RoleAttention]) -> None:
        super().__init__(original, attend)
        (self._attention,) = attend.values()

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is None:
            raise ValueError("Qwen-Image attention requires encoder_hidden_states (the text stream)")
        if attention_mask is not None:
            raise ValueError(
                "Qwen-Image attention does not accept an external attention_mask; pass encoder_hidden_states_mask "
                "and the joint mask is built from it"
            )
        if encoder_hidden_states_mask is not None:
            attention_mask = _JOINT_MASKS(encoder_hidden_states_mask, hidden_states)

        seq_txt = encoder_hidden_states.shape[1]
        img_query = attn.to_q(hidden_states)
        img_key = attn.to_k(hidden_states)
        img_value = attn.to_v(hidden_states)
        txt_query = attn.add_q_proj(encoder_hidden_states)
        txt_key = attn.add_k_proj(encoder_hidden_states)
        txt_value = attn.add_v_proj(encoder_hidden_states)

        head_dim = attn.inner_dim // attn.heads
        img_query = img_query.unflatten(-1, (-1, head_dim))
        img_key = img_key.unflatten(-1, (-1, head_dim))
        img_value = img_value.unflatten(-1, (-1, head_dim))
        txt_query = txt_query.unflatten(-1, (-1, head_dim))
        txt_key = txt_key.unflatten(-1, (-1, head_dim))
        txt_value = txt_value.unflatten(-1, (-1, head_dim))

        if attn.norm_q is not None:
            img_query = attn.norm_q(img_query)
        if attn.norm_k is not None:
            img_key = attn.norm_k(img_key)
        if attn.norm_added_q is not None:
            txt_query = attn.norm_added_q(txt_query)
        if attn.norm_added_k is not None:
            txt_key = attn.norm_added_k(txt_key)

        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb
            img_query = apply_rotary_emb_qwen(img_query, img_freqs, use_real=False)
            img_key = apply_rotary_emb_qwen(img_key, img_freqs, use_real=False)
            txt_query = apply_rotary_emb_qwen(txt_query, txt_freqs, use_real=False)
            txt_key = apply_rotary_emb_qwen(txt_key, txt_freqs, use_real=False)

        joint_query = torch.cat([txt_query, img_query], dim=1)
        joint_key = torch.cat([txt_key, img_key], dim=1)
        joint_value = torch.cat([txt_value, img_value], dim=1)

        out = self._attention(joint_query, joint_key, joint_value, attn_mask=attention_mask)
        out = out.flatten(2, 3).to(joint_query.dtype)

        txt_out = out[:, :seq_txt, :]
        img_out = out[:, seq_txt:, :]
        img_out = attn.to_out[0](img_out.contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        txt_out = attn.to_add_out(txt_out.contiguous())
        return img_out, txt_out


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
        make_processor=processor_factory(OmniQwenDoubleStreamAttnProcessor, QwenDoubleStreamAttnProcessor2_0),
        mask_free=False,
        display_name="Qwen-Image",
        example_checkpoint="Qwen/Qwen-Image",
        roles=(JOINT,),
    )
)
