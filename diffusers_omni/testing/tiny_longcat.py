"""Tiny, randomly initialised, fully local LongCat-Image pipelines for fast CPU tests.

The text encoder is the two-layer Qwen2.5-VL of :mod:`diffusers_omni.testing.tiny_qwenimage` with its byte-level
tokenizer and an image-only ``Qwen2VLProcessor``. LongCat pads every prompt to 512 text tokens.

Call kwargs that keep them fast: ``height``/``width`` multiples of 8 (e.g. 32), ``num_inference_steps=2``,
``output_type="latent"`` and ``enable_prompt_rewrite=False`` (the rewrite generates up to 512 tokens with the
text encoder).
"""

from __future__ import annotations

from typing import Any, TypeVar, overload

from diffusers import (
    AutoencoderKL,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    LongCatImagePipeline,
    LongCatImageTransformer2DModel,
)

from .tiny import _build_model, tiny_kl_vae
from .tiny_qwenimage import _qwen_processor, tiny_qwen2_5_vl_text_encoder, tiny_qwen2_tokenizer

__all__ = ["tiny_flux_like_vae", "tiny_longcat_components", "tiny_longcat_pipeline"]

P = TypeVar("P", bound=DiffusionPipeline)

_TEXT_DIM = 16
_LATENT_CHANNELS = 16  # LongCat-Image pipelines hard-code 16 latent channels


def tiny_flux_like_vae() -> AutoencoderKL:
    """A two-level ``AutoencoderKL`` with 16 latent channels (scale factor 2), FLUX-style scaling and shift."""
    return tiny_kl_vae(block_out_channels=(8, 16), latent_channels=_LATENT_CHANNELS, norm_num_groups=8)


def _longcat_transformer() -> LongCatImageTransformer2DModel:
    return LongCatImageTransformer2DModel(
        patch_size=1,
        in_channels=4 * _LATENT_CHANNELS,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=_TEXT_DIM,
        pooled_projection_dim=_TEXT_DIM,
        axes_dims_rope=[4, 4, 8],
    )


def tiny_longcat_components(seed: int = 0) -> dict[str, Any]:
    """Components for a tiny ``LongCatImagePipeline`` (also the Edit pipeline)."""
    tokenizer = tiny_qwen2_tokenizer()
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(),
        "vae": _build_model(seed, tiny_flux_like_vae),
        "text_encoder": _build_model(seed, lambda: tiny_qwen2_5_vl_text_encoder(tokenizer)),
        "tokenizer": tokenizer,
        "text_processor": _qwen_processor(tokenizer),
        "transformer": _build_model(seed, _longcat_transformer),
    }


@overload
def tiny_longcat_pipeline(seed: int = ..., pipeline_cls: None = ...) -> LongCatImagePipeline: ...
@overload
def tiny_longcat_pipeline(seed: int = ..., pipeline_cls: type[P] = ...) -> P: ...
def tiny_longcat_pipeline(seed: int = 0, pipeline_cls: type[DiffusionPipeline] | None = None) -> DiffusionPipeline:
    """Tiny ``LongCatImagePipeline`` (or ``pipeline_cls``) built from :func:`tiny_longcat_components`."""
    return (pipeline_cls or LongCatImagePipeline)(**tiny_longcat_components(seed))
