"""Tiny, randomly initialised, fully local Ovis-Image pipeline for fast CPU tests.

The text encoder is a two-layer ``Qwen3Model`` (hidden size 16) with the byte-level Qwen tokenizer of
:mod:`diffusers_omni.testing.tiny_qwenimage`.

Call kwargs that keep it fast: ``height``/``width`` multiples of 8 (e.g. 32), ``num_inference_steps=2``,
``output_type="latent"``, a small ``max_sequence_length`` (e.g. 32).
"""

from __future__ import annotations

from typing import Any, TypeVar, overload

from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler, OvisImagePipeline, OvisImageTransformer2DModel

from .tiny import _build_model
from .tiny_longcat import tiny_flux_like_vae
from .tiny_qwenimage import tiny_qwen2_tokenizer
from .tiny_zimage import _qwen3_text_encoder

__all__ = ["tiny_ovis_components", "tiny_ovis_pipeline"]

P = TypeVar("P", bound=DiffusionPipeline)


def _ovis_transformer() -> OvisImageTransformer2DModel:
    return OvisImageTransformer2DModel(
        patch_size=1,
        in_channels=64,
        out_channels=64,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(4, 4, 8),
    )


def tiny_ovis_components(seed: int = 0) -> dict[str, Any]:
    """Components for a tiny ``OvisImagePipeline``."""
    tokenizer = tiny_qwen2_tokenizer()
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(),
        "vae": _build_model(seed, tiny_flux_like_vae),
        "text_encoder": _build_model(seed, lambda: _qwen3_text_encoder(len(tokenizer), tokenizer.pad_token_id)),
        "tokenizer": tokenizer,
        "transformer": _build_model(seed, _ovis_transformer),
    }


@overload
def tiny_ovis_pipeline(seed: int = ..., pipeline_cls: None = ...) -> OvisImagePipeline: ...
@overload
def tiny_ovis_pipeline(seed: int = ..., pipeline_cls: type[P] = ...) -> P: ...
def tiny_ovis_pipeline(seed: int = 0, pipeline_cls: type[DiffusionPipeline] | None = None) -> DiffusionPipeline:
    """Tiny ``OvisImagePipeline`` (or ``pipeline_cls``) built from :func:`tiny_ovis_components`."""
    return (pipeline_cls or OvisImagePipeline)(**tiny_ovis_components(seed))
