"""A tiny, randomly initialised, fully local ``BagelPipeline`` for fast CPU tests.

The language model is a two-layer ``Qwen2MoTModel`` (hidden size 32, 4 query and 2 key/value heads) over the
byte-level Qwen tokenizer of :mod:`diffusers_omni.testing.tiny_qwenimage` (which holds BAGEL's ``<|im_start|>``,
``<|im_end|>``, ``<|vision_start|>`` and ``<|vision_end|>``); the VAE downsamples by 2 with 4 latent channels, so one
generation token covers 4×4 pixels and images go up to 64×64 (``max_latent_size`` 16). The vision tower is a
one-layer SigLIP (hidden size 16).

Call kwargs that keep it fast: ``height=width=16`` to ``64``, ``num_inference_steps=3``.
"""

from __future__ import annotations

from typing import Any, Callable

from ..architectures.bagel import BagelModel, BagelPipeline
from .tiny import _build_model, tiny_kl_vae
from .tiny_qwenimage import tiny_qwen2_tokenizer

__all__ = ["TINY_BAGEL_LLM", "TINY_BAGEL_VIT", "tiny_bagel_model", "tiny_bagel_components", "tiny_bagel_parts",
           "tiny_bagel_pipeline"]

TINY_BAGEL_VIT = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "image_size": 56, "patch_size": 14, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6}


def tiny_bagel_llm(vocab_size: int) -> dict[str, Any]:
    return {"vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}


TINY_BAGEL_LLM = tiny_bagel_llm(0)  # the shape of the config; the vocabulary size is the tokenizer's


def tiny_bagel_model(vocab_size: int, max_latent_size: int = 16) -> BagelModel:
    """The tiny ``BagelModel`` (random weights from the global generator)."""
    return BagelModel(llm_config=tiny_bagel_llm(vocab_size), vit_config=TINY_BAGEL_VIT, latent_channels=4,
                      vae_downsample=2, latent_patch_size=2, max_latent_size=max_latent_size,
                      vit_max_num_patch_per_side=4)


def _tiny_bagel_vae():
    return tiny_kl_vae(block_out_channels=(8, 16), latent_channels=4, norm_num_groups=8)


def tiny_bagel_components(seed: int = 0) -> dict[str, Any]:
    """Components of a tiny ``BagelPipeline`` (``bagel``, ``vae``, ``tokenizer``)."""
    tokenizer = tiny_qwen2_tokenizer()
    return {
        "bagel": _build_model(seed, lambda: tiny_bagel_model(len(tokenizer))),
        "vae": _build_model(seed, _tiny_bagel_vae),
        "tokenizer": tokenizer,
    }


def tiny_bagel_parts() -> tuple[type, Callable[[], Any], Callable[[Any], Any]]:
    """``(BagelPipeline, VAE factory, DiT factory taking the VAE)`` for ``tiny_pipeline_parts("tiny-bagel")``; the
    DiT is the language backbone (``Qwen2MoTModel``)."""
    vocab = len(tiny_qwen2_tokenizer())
    return BagelPipeline, _tiny_bagel_vae, lambda vae: tiny_bagel_model(vocab).backbone


def tiny_bagel_pipeline(seed: int = 0, pipeline_cls: type | None = None) -> BagelPipeline:
    """Tiny ``BagelPipeline`` (or ``pipeline_cls``) built from :func:`tiny_bagel_components`."""
    return (pipeline_cls or BagelPipeline)(**tiny_bagel_components(seed))
