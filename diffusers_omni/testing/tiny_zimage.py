"""Tiny, randomly initialised, fully local Z-Image pipelines for fast CPU tests.

The text encoder is a two-layer ``Qwen3Model`` (hidden size 16) with the byte-level Qwen tokenizer of
:mod:`diffusers_omni.testing.tiny_qwenimage` (one token per byte, a minimal chat template), so caption lengths follow
prompt lengths: Z-Image pads captions to multiples of 32 tokens, and prompts whose padded lengths differ make the
transformer pass padding masks.

Call kwargs that keep them fast: ``height``/``width`` multiples of 16 (e.g. 32), ``num_inference_steps=2``,
``output_type="latent"``, ``max_sequence_length`` around 64.
"""

from __future__ import annotations

from typing import Any, TypeVar, overload

import torch
from diffusers import (
    AutoencoderKL,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from transformers import Qwen3Config, Qwen3Model

from .tiny import _build_model, tiny_kl_vae
from .tiny_qwenimage import tiny_qwen2_tokenizer

__all__ = ["tiny_zimage_components", "tiny_zimage_pipeline"]

P = TypeVar("P", bound=DiffusionPipeline)

_TEXT_DIM = 16
_LATENT_CHANNELS = 16


def _qwen3_text_encoder(vocab_size: int, pad_token_id: int) -> Qwen3Model:
    config = Qwen3Config(
        hidden_size=_TEXT_DIM,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=vocab_size,
        max_position_embeddings=512,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        eos_token_id=pad_token_id,
    )
    return Qwen3Model(config)


def _zimage_vae() -> AutoencoderKL:
    return tiny_kl_vae(block_out_channels=(8, 16), latent_channels=_LATENT_CHANNELS, norm_num_groups=8, quant_conv=True)


def _zimage_transformer() -> ZImageTransformer2DModel:
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=_LATENT_CHANNELS,
        dim=32,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=_TEXT_DIM,
        axes_dims=[8, 4, 4],
        axes_lens=[256, 32, 32],
    )
    # The pad tokens are created with torch.empty: give them defined values.
    with torch.no_grad():
        transformer.x_pad_token.fill_(1.0)
        transformer.cap_pad_token.fill_(1.0)
    return transformer


def tiny_zimage_components(seed: int = 0) -> dict[str, Any]:
    """Components for a tiny ``ZImagePipeline`` (also Img2Img and Inpaint)."""
    tokenizer = tiny_qwen2_tokenizer()
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(),
        "vae": _build_model(seed, _zimage_vae),
        "text_encoder": _build_model(seed, lambda: _qwen3_text_encoder(len(tokenizer), tokenizer.pad_token_id)),
        "tokenizer": tokenizer,
        "transformer": _build_model(seed, _zimage_transformer),
    }


@overload
def tiny_zimage_pipeline(seed: int = ..., pipeline_cls: None = ...) -> ZImagePipeline: ...
@overload
def tiny_zimage_pipeline(seed: int = ..., pipeline_cls: type[P] = ...) -> P: ...
def tiny_zimage_pipeline(seed: int = 0, pipeline_cls: type[DiffusionPipeline] | None = None) -> DiffusionPipeline:
    """Tiny ``ZImagePipeline`` (or ``pipeline_cls``) built from :func:`tiny_zimage_components`."""
    return (pipeline_cls or ZImagePipeline)(**tiny_zimage_components(seed))
