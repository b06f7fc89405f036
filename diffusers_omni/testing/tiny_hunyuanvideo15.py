"""Tiny, randomly initialised HunyuanVideo-1.5 pipelines (text-to-video and image-to-video) for CPU tests.

Nothing is downloaded: the Qwen2.5-VL prompt encoder, the ByT5 glyph encoder and the SigLIP image encoder are
built from configs; the Qwen2 tokenizer is byte-level with no merges and a minimal chat template, the ByT5
tokenizer needs no files.

Fast call kwargs: ``height=16, width=16, num_frames=5`` (image-to-video takes its size from ``image``: pass a
16×16 image) (the tiny VAE compresses 4× in space and 2× in time), two
steps. The pipelines always pad the prompt to 1000 Qwen tokens (plus 108 cropped template tokens) and 256 ByT5
tokens; quote text in the prompt (``'a sign that says "hi"'``) so the glyph encoder runs.
"""

from __future__ import annotations

from typing import Any, TypeVar

from diffusers import (
    AutoencoderKLHunyuanVideo15,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15ImageToVideoPipeline,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
)
from diffusers.guiders import ClassifierFreeGuidance
from tokenizers.pre_tokenizers import ByteLevel
from transformers import (
    ByT5Tokenizer,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
    Qwen2Tokenizer,
    SiglipImageProcessorPil,
    SiglipVisionConfig,
    SiglipVisionModel,
    T5Config,
    T5EncoderModel,
)

from .tiny import _build_model

__all__ = [
    "tiny_hunyuanvideo15_components",
    "tiny_hunyuanvideo15_i2v_components",
    "tiny_hunyuanvideo15_i2v_pipeline",
    "tiny_hunyuanvideo15_pipeline",
    "tiny_qwen2_tokenizer",
]

P = TypeVar("P", bound=DiffusionPipeline)

_QWEN_DIM = 16
_BYT5_DIM = 16
_IMAGE_DIM = 12
_IMAGE_SIZE = 16
_LATENT_CHANNELS = 4

_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_qwen2_tokenizer() -> Qwen2Tokenizer:
    """Byte-level Qwen2 tokenizer (one token per byte, no merges) with a minimal ChatML template."""
    vocab = {symbol: index for index, symbol in enumerate(sorted(ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[])
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def _qwen_text_encoder(tokenizer: Qwen2Tokenizer) -> Qwen2_5_VLTextModel:
    config = Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=_QWEN_DIM,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
        rope_theta=1000000.0,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen2_5_VLTextModel(config)


def _byt5_text_encoder(tokenizer: ByT5Tokenizer) -> T5EncoderModel:
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=_BYT5_DIM,
        d_kv=8,
        d_ff=16,
        num_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return T5EncoderModel(config)


def _transformer(task_type: str) -> HunyuanVideo15Transformer3DModel:
    return HunyuanVideo15Transformer3DModel(
        in_channels=2 * _LATENT_CHANNELS + 1,
        out_channels=_LATENT_CHANNELS,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=2,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=_QWEN_DIM,
        text_embed_2_dim=_BYT5_DIM,
        image_embed_dim=_IMAGE_DIM,
        rope_axes_dim=(2, 2, 4),
        target_size=16,
        task_type=task_type,
    )


def _vae() -> AutoencoderKLHunyuanVideo15:
    return AutoencoderKLHunyuanVideo15(
        latent_channels=_LATENT_CHANNELS,
        block_out_channels=(8, 8),
        layers_per_block=1,
        spatial_compression_ratio=4,
        temporal_compression_ratio=2,
        downsample_match_channel=False,
        upsample_match_channel=False,
    )


def _siglip_image_encoder() -> SiglipVisionModel:
    config = SiglipVisionConfig(
        hidden_size=_IMAGE_DIM,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=_IMAGE_SIZE,
        patch_size=8,
    )
    return SiglipVisionModel(config)


def tiny_hunyuanvideo15_components(seed: int = 0, task_type: str = "t2v") -> dict[str, Any]:
    """Components for a tiny ``HunyuanVideo15Pipeline`` (two dual-stream blocks, one refiner block)."""
    tokenizer = tiny_qwen2_tokenizer()
    tokenizer_2 = ByT5Tokenizer()
    return {
        "transformer": _build_model(seed, lambda: _transformer(task_type)),
        "vae": _build_model(seed, _vae),
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=7.0),
        "text_encoder": _build_model(seed, lambda: _qwen_text_encoder(tokenizer)),
        "tokenizer": tokenizer,
        "text_encoder_2": _build_model(seed, lambda: _byt5_text_encoder(tokenizer_2)),
        "tokenizer_2": tokenizer_2,
        "guider": ClassifierFreeGuidance(guidance_scale=1.0),
    }


def tiny_hunyuanvideo15_pipeline(seed: int = 0, pipeline_cls: type[P] | None = None) -> P:
    """Tiny ``HunyuanVideo15Pipeline`` (or ``pipeline_cls``)."""
    return (pipeline_cls or HunyuanVideo15Pipeline)(**tiny_hunyuanvideo15_components(seed))


def tiny_hunyuanvideo15_i2v_components(seed: int = 0) -> dict[str, Any]:
    """Components for a tiny ``HunyuanVideo15ImageToVideoPipeline`` with a SigLIP image encoder (4 image tokens)."""
    return {
        **tiny_hunyuanvideo15_components(seed, task_type="i2v"),
        "image_encoder": _build_model(seed, _siglip_image_encoder),
        "feature_extractor": SiglipImageProcessorPil(size={"height": _IMAGE_SIZE, "width": _IMAGE_SIZE}),
    }


def tiny_hunyuanvideo15_i2v_pipeline(seed: int = 0, pipeline_cls: type[P] | None = None) -> P:
    """Tiny ``HunyuanVideo15ImageToVideoPipeline`` (or ``pipeline_cls``)."""
    return (pipeline_cls or HunyuanVideo15ImageToVideoPipeline)(**tiny_hunyuanvideo15_i2v_components(seed))
