"""Tiny, fully local Chroma pipelines (``ChromaPipeline``, img2img, inpaint) for fast CPU tests.

Built like :mod:`diffusers_omni.testing.tiny`: forked RNG seeding, ``eval()`` models, nothing downloaded. The VAE
and T5 encoder are FLUX.1's tiny ones. Keep ``height``/``width`` multiples of 4 (e.g. 32) and pass a small
``max_sequence_length`` (e.g. 16) for speed.
"""

from __future__ import annotations

from typing import Any

from diffusers import ChromaPipeline, ChromaTransformer2DModel, DiffusionPipeline

from .tiny import _TEXT_DIM, _build_model, _flux_scheduler, _flux_vae, _t5_text_encoder, tiny_t5_tokenizer

__all__ = ["tiny_chroma_components", "tiny_chroma_pipeline"]


def _chroma_transformer(in_channels: int) -> ChromaTransformer2DModel:
    return ChromaTransformer2DModel(
        patch_size=1,
        in_channels=in_channels,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=_TEXT_DIM,
        axes_dims_rope=(4, 4, 8),
        approximator_num_channels=16,
        approximator_hidden_dim=32,
        approximator_layers=1,
    )


def tiny_chroma_components(seed: int = 0) -> dict[str, Any]:
    """Components for a tiny ``ChromaPipeline`` (and its img2img / inpaint siblings)."""
    tokenizer = tiny_t5_tokenizer()
    vae = _build_model(seed, _flux_vae)
    return {
        "scheduler": _flux_scheduler(),
        "vae": vae,
        "text_encoder": _build_model(seed, lambda: _t5_text_encoder(tokenizer)),
        "tokenizer": tokenizer,
        "transformer": _build_model(seed, lambda: _chroma_transformer(4 * vae.config.latent_channels)),
        "image_encoder": None,
        "feature_extractor": None,
    }


def tiny_chroma_pipeline(seed: int = 0, pipeline_cls: type[DiffusionPipeline] | None = None) -> DiffusionPipeline:
    """Tiny ``ChromaPipeline`` (or ``pipeline_cls``, e.g. ``ChromaInpaintPipeline``) from
    :func:`tiny_chroma_components`."""
    return (pipeline_cls or ChromaPipeline)(**tiny_chroma_components(seed))
