"""Tiny, randomly initialised, fully local NextStep-1.1 pipeline for fast CPU tests.

The tokenizer is the byte-level Qwen tokenizer of :mod:`diffusers_omni.testing.tiny_qwenimage` plus NextStep's
image tokens (``<|image_area|>`` and the begin/end/placeholder tokens whose ids the model config names). The
backbone has 2 layers (hidden size 32, 4 query heads over 2 key/value heads), the flow-matching head 2 blocks of
width 32; every weight is random (the reference zero-initialises the head's modulation, which would make the head
output constant). The VAE has two levels (scale factor 2, 32 groups) and 16 latent channels, so one image token
covers 4x4 pixels.

Call kwargs that keep it fast: ``height=width=16`` (16 image tokens), ``num_inference_steps=2``.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import AutoencoderKL
from transformers import Qwen2Tokenizer

from ..architectures.nextstep import NextStep11Pipeline, NextStepModel
from ..architectures.nextstep.vae import autoencoder_config_from_published
from .tiny import _build_model
from .tiny_qwenimage import tiny_qwen2_tokenizer

__all__ = [
    "TINY_NEXTSTEP_VAE", "tiny_nextstep_components", "tiny_nextstep_parts", "tiny_nextstep_pipeline",
    "tiny_nextstep_tokenizer",
]

IMAGE_TOKENS = ("<|image_area|>", "<|begin_of_image|>", "<|end_of_image|>", "<|image_placeholder|>")

# The tiny VAE in the published config.json's terms.
TINY_NEXTSTEP_VAE = {"resolution": 32, "ch": 32, "ch_mult": [1, 2], "num_res_blocks": 1, "z_channels": 16}


def tiny_nextstep_tokenizer() -> Qwen2Tokenizer:
    tokenizer = tiny_qwen2_tokenizer()
    tokenizer.add_tokens(list(IMAGE_TOKENS), special_tokens=True)
    return tokenizer


def _randomize(module: torch.nn.Module, std: float = 0.1) -> None:
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight") or name.endswith("in_ln.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(std * torch.randn_like(param))


def tiny_nextstep_model(tokenizer: Qwen2Tokenizer, use_gen_pos_embed: bool = False) -> NextStepModel:
    ids = tokenizer.convert_tokens_to_ids
    model = NextStepModel(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        attention_bias=True,
        o_attention_bias=False,
        latent_channels=16,
        latent_patch_size=2,
        fm_head_dim=32,
        fm_head_layers=2,
        boi=ids("<|begin_of_image|>"),
        eoi=ids("<|end_of_image|>"),
        image_placeholder_id=ids("<|image_placeholder|>"),
        use_gen_pos_embed=use_gen_pos_embed,
        base_image_grid_size=8,
    )
    _randomize(model)
    return model


def tiny_nextstep_components(seed: int = 0, use_gen_pos_embed: bool = False) -> dict[str, Any]:
    """Components of the tiny pipeline; ``use_gen_pos_embed`` adds the generation position table (8 x 8)."""
    tokenizer = tiny_nextstep_tokenizer()
    return {
        "tokenizer": tokenizer,
        "model": _build_model(seed, lambda: tiny_nextstep_model(tokenizer, use_gen_pos_embed)),
        "vae": _build_model(seed, lambda: AutoencoderKL(**autoencoder_config_from_published(TINY_NEXTSTEP_VAE))),
    }


def tiny_nextstep_parts():
    """``(pipeline class, VAE factory, backbone factory taking the VAE)``, unseeded, as ``testing.tiny.tiny_pipeline_parts`` gives them for the other tiny models."""
    tokenizer = tiny_nextstep_tokenizer()
    return (
        NextStep11Pipeline,
        lambda: AutoencoderKL(**autoencoder_config_from_published(TINY_NEXTSTEP_VAE)),
        lambda vae: tiny_nextstep_model(tokenizer),
    )


def tiny_nextstep_pipeline(
    seed: int = 0, pipeline_cls: type | None = None, use_gen_pos_embed: bool = False
) -> NextStep11Pipeline:
    """Tiny ``NextStep11Pipeline`` (or ``pipeline_cls``) built from :func:`tiny_nextstep_components`."""
    return (pipeline_cls or NextStep11Pipeline)(**tiny_nextstep_components(seed, use_gen_pos_embed))
