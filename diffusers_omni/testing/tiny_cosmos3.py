"""A tiny, randomly initialised ``Cosmos3OmniPipeline`` for CPU tests.

Nothing is downloaded: the Qwen2 tokenizer is byte-level with a minimal chat template and the one special token
the pipeline looks up (``<|vision_start|>``); the transformer uses grouped query attention (two query heads, one
key/value head); the VAE is a tiny Wan VAE; the safety checker is off.

Fast call kwargs: ``height=16, width=16, num_frames=1`` (or ``5`` for a short video), two steps,
``guidance_scale=1.0``, ``use_system_prompt=False``, ``add_resolution_template=False``,
``add_duration_template=False``, ``output_type="latent"``.
"""

from __future__ import annotations

from typing import Any, TypeVar

from diffusers import AutoencoderKLWan, Cosmos3OmniPipeline, Cosmos3OmniTransformer, DiffusionPipeline
from diffusers import UniPCMultistepScheduler
from tokenizers import AddedToken
from tokenizers.pre_tokenizers import ByteLevel
from transformers import Qwen2Tokenizer

from .tiny import _build_model

__all__ = ["tiny_cosmos3_components", "tiny_cosmos3_pipeline", "tiny_cosmos3_tokenizer"]

P = TypeVar("P", bound=DiffusionPipeline)

_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_cosmos3_tokenizer() -> Qwen2Tokenizer:
    """Byte-level Qwen2 tokenizer (no merges) with ``<|vision_start|>`` and a minimal ChatML template."""
    vocab = {symbol: index for index, symbol in enumerate(sorted(ByteLevel.alphabet()))}
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>"):
        vocab[special] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="<|im_end|>")
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True) for t in ("<|im_start|>", "<|vision_start|>")]}
    )
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def _transformer(vocab_size: int) -> Cosmos3OmniTransformer:
    return Cosmos3OmniTransformer(
        head_dim=8,
        hidden_act="relu2",
        hidden_size=16,
        intermediate_size=16,
        latent_channel=16,
        latent_patch_size=1,
        num_attention_heads=2,
        num_hidden_layers=2,
        num_key_value_heads=1,
        patch_latent_dim=16,
        qk_norm_for_text=False,
        rms_norm_eps=1e-5,
        rope_axes_dim=[2, 1, 1],
        vocab_size=vocab_size,
    )


def _vae() -> AutoencoderKLWan:
    return AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )


def tiny_cosmos3_components(seed: int = 0) -> dict[str, Any]:
    """Components for a tiny ``Cosmos3OmniPipeline`` (two packed MoT layers, GQA 2:1)."""
    tokenizer = tiny_cosmos3_tokenizer()
    return {
        "transformer": _build_model(seed, lambda: _transformer(len(tokenizer))),
        "text_tokenizer": tokenizer,
        "vae": _build_model(seed, _vae),
        "scheduler": UniPCMultistepScheduler(),
        "sound_tokenizer": None,
        "safety_checker": None,
        "enable_safety_checker": False,
    }


def tiny_cosmos3_pipeline(seed: int = 0, pipeline_cls: type[P] | None = None) -> P:
    """Tiny ``Cosmos3OmniPipeline`` (or ``pipeline_cls``)."""
    return (pipeline_cls or Cosmos3OmniPipeline)(**tiny_cosmos3_components(seed))
