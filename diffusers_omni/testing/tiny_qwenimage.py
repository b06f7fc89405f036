"""Tiny, randomly initialised, fully local Qwen-Image pipelines for fast CPU tests.

The text encoder is a two-layer ``Qwen2_5_VLForConditionalGeneration`` (hidden size 16, a two-block vision tower
that the text-only pipelines never run) and the tokenizer is a byte-level ``Qwen2Tokenizer`` with one token per
byte plus Qwen's special tokens, so prompts of different lengths give different token counts and Qwen-Image's
padding mask can be exercised. The Edit pipelines get a ``Qwen2VLProcessor`` built from the same tokenizer and a
PIL image processor with small pixel bounds.

Call kwargs that keep them fast: ``height``/``width`` multiples of 8 (e.g. 32), ``num_inference_steps=2``,
``output_type="latent"``. The Edit pipelines resize the input image to about 1024x1024 pixels before VAE-encoding
it (hard-coded in Diffusers), which gives the transformer some 16k condition tokens: they build, but running them
takes minutes on CPU even with these weights.
"""

from __future__ import annotations

from typing import Any, TypeVar, overload

from diffusers import (
    AutoencoderKLQwenImage,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    QwenImageEditPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from tokenizers.pre_tokenizers import ByteLevel
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer, Qwen2VLProcessor

from .tiny import _build_model

__all__ = [
    "tiny_qwen2_tokenizer",
    "tiny_qwen2_5_vl_text_encoder",
    "tiny_qwenimage_components",
    "tiny_qwenimage_edit_components",
    "tiny_qwenimage_edit_pipeline",
    "tiny_qwenimage_pipeline",
]

P = TypeVar("P", bound=DiffusionPipeline)

_TEXT_DIM = 16
_Z_DIM = 4
_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_qwen2_tokenizer() -> Qwen2Tokenizer:
    """Byte-level ``Qwen2Tokenizer``: one token per byte (no merges) plus Qwen's chat and vision tokens."""
    vocab = {symbol: index for index, symbol in enumerate(sorted(ByteLevel.alphabet()))}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=2048)
    tokenizer.add_special_tokens({"additional_special_tokens": list(_SPECIAL_TOKENS[1:])})
    tokenizer.add_tokens([_SPECIAL_TOKENS[0]], special_tokens=True)
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def tiny_qwen2_5_vl_text_encoder(tokenizer: Qwen2Tokenizer) -> Qwen2_5_VLForConditionalGeneration:
    """A two-layer Qwen2.5-VL (hidden size 16) whose vocabulary and vision token ids match ``tokenizer``."""
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": _TEXT_DIM,
            "intermediate_size": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "vocab_size": len(tokenizer),
            "bos_token_id": None,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
            "rope_theta": 1000000.0,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": _TEXT_DIM,
            "fullatt_block_indexes": [1],
        },
        hidden_size=_TEXT_DIM,
        vocab_size=len(tokenizer),
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(config)


class _ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` without a video processor.

    Transformers checks every processor attribute's class on construction, and the video processor classes need
    torchvision; the Edit pipelines never process video, so ``video_processor=None`` is accepted here.
    """

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument is None and argument_name == "video_processor":
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def _qwen_processor(tokenizer: Qwen2Tokenizer) -> Qwen2VLProcessor:
    from transformers import Qwen2VLImageProcessorPil

    # One 56x56 image → 4x4 patches of 14 px → 4 vision tokens after the 2x2 merge.
    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56)
    return _ImageOnlyQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=_CHAT_TEMPLATE)


def _qwen_vae() -> AutoencoderKLQwenImage:
    return AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=_Z_DIM,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.0] * _Z_DIM,
        latents_std=[1.0] * _Z_DIM,
    )


def _qwen_transformer() -> QwenImageTransformer2DModel:
    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * _Z_DIM,
        out_channels=_Z_DIM,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=_TEXT_DIM,
        guidance_embeds=False,
        axes_dims_rope=(8, 4, 4),
    )


def tiny_qwenimage_components(seed: int = 0) -> dict[str, Any]:
    """Components for a tiny ``QwenImagePipeline`` (also Img2Img and Inpaint)."""
    tokenizer = tiny_qwen2_tokenizer()
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(),
        "vae": _build_model(seed, _qwen_vae),
        "text_encoder": _build_model(seed, lambda: tiny_qwen2_5_vl_text_encoder(tokenizer)),
        "tokenizer": tokenizer,
        "transformer": _build_model(seed, _qwen_transformer),
    }


def tiny_qwenimage_edit_components(seed: int = 0) -> dict[str, Any]:
    """Components for a tiny ``QwenImageEditPipeline`` (also Edit Plus and Edit Inpaint): adds the processor."""
    components = tiny_qwenimage_components(seed)
    return {**components, "processor": _qwen_processor(components["tokenizer"])}


@overload
def tiny_qwenimage_pipeline(seed: int = ..., pipeline_cls: None = ...) -> QwenImagePipeline: ...
@overload
def tiny_qwenimage_pipeline(seed: int = ..., pipeline_cls: type[P] = ...) -> P: ...
def tiny_qwenimage_pipeline(seed: int = 0, pipeline_cls: type[DiffusionPipeline] | None = None) -> DiffusionPipeline:
    """Tiny ``QwenImagePipeline`` (or ``pipeline_cls``) built from :func:`tiny_qwenimage_components`."""
    return (pipeline_cls or QwenImagePipeline)(**tiny_qwenimage_components(seed))


@overload
def tiny_qwenimage_edit_pipeline(seed: int = ..., pipeline_cls: None = ...) -> QwenImageEditPipeline: ...
@overload
def tiny_qwenimage_edit_pipeline(seed: int = ..., pipeline_cls: type[P] = ...) -> P: ...
def tiny_qwenimage_edit_pipeline(seed: int = 0, pipeline_cls: type[DiffusionPipeline] | None = None) -> DiffusionPipeline:
    """Tiny ``QwenImageEditPipeline`` (or ``pipeline_cls``) built from :func:`tiny_qwenimage_edit_components`."""
    return (pipeline_cls or QwenImageEditPipeline)(**tiny_qwenimage_edit_components(seed))
