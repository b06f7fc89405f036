"""Tiny, fully local FLUX.2 Klein pipelines (``Flux2KleinPipeline``, ``Flux2KleinInpaintPipeline``,
``Flux2KleinKVPipeline``) for fast CPU tests.

Built like :mod:`diffusers_omni.testing.tiny`: forked RNG seeding, ``eval()`` models, nothing downloaded. The text
encoder is a 2-layer ``Qwen3ForCausalLM`` with a byte-level Qwen2 tokenizer and a minimal chat template. Call with
``text_encoder_out_layers=TINY_FLUX2_TEXT_LAYERS`` (the default layers 9/18/27 do not exist here), ``height`` /
``width`` multiples of 4 (e.g. 32) and a small ``max_sequence_length`` (e.g. 16).

``Flux2Pipeline`` (FLUX.2 [dev]) needs a Mistral3 vision-language encoder and a Pixtral processor; it has no tiny
factory here.
"""

from __future__ import annotations

from typing import Any

from diffusers import (
    AutoencoderKLFlux2,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Transformer2DModel,
)
from tokenizers.pre_tokenizers import ByteLevel
from transformers import Qwen2TokenizerFast, Qwen3Config, Qwen3ForCausalLM

from .tiny import _build_model

__all__ = ["TINY_FLUX2_TEXT_LAYERS", "tiny_flux2_klein_components", "tiny_flux2_klein_pipeline", "tiny_qwen2_tokenizer"]

TINY_FLUX2_TEXT_LAYERS = (0, 1, 2)
_QWEN_DIM = 16
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_qwen2_tokenizer() -> Qwen2TokenizerFast:
    """Byte-level Qwen2 tokenizer, one token per byte (no merges), with a minimal chat template."""
    vocab = {symbol: index for index, symbol in enumerate(sorted(ByteLevel.alphabet()))}
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    tokenizer = Qwen2TokenizerFast(
        vocab=vocab,
        merges=[],
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=512,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def _qwen3_text_encoder(tokenizer: Qwen2TokenizerFast) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=_QWEN_DIM,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(config)


def _flux2_vae() -> AutoencoderKLFlux2:
    return AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(4, 8),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=32,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=False,
    )


def _flux2_transformer(in_channels: int) -> Flux2Transformer2DModel:
    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=in_channels,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=len(TINY_FLUX2_TEXT_LAYERS) * _QWEN_DIM,
        timestep_guidance_channels=32,
        mlp_ratio=2.0,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=False,
    )


def tiny_flux2_klein_components(seed: int = 0) -> dict[str, Any]:
    """Components for a tiny FLUX.2 [klein]-like pipeline (distilled-free, no guidance embedding)."""
    tokenizer = tiny_qwen2_tokenizer()
    vae = _build_model(seed, _flux2_vae)
    in_channels = 4 * vae.config.latent_channels
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
        "vae": vae,
        "text_encoder": _build_model(seed, lambda: _qwen3_text_encoder(tokenizer)),
        "tokenizer": tokenizer,
        "transformer": _build_model(seed, lambda: _flux2_transformer(in_channels)),
    }


def tiny_flux2_klein_pipeline(seed: int = 0, pipeline_cls: type[DiffusionPipeline] | None = None) -> DiffusionPipeline:
    """Tiny ``Flux2KleinPipeline`` (or ``pipeline_cls``: ``Flux2KleinInpaintPipeline``, ``Flux2KleinKVPipeline``)."""
    return (pipeline_cls or Flux2KleinPipeline)(**tiny_flux2_klein_components(seed))
