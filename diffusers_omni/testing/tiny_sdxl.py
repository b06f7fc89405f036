"""Tiny, randomly initialised, fully local SDXL pipelines for fast CPU tests.

The UNet keeps SDXL's layout at toy size: a plain down block then a cross-attention down block, a cross-attention
mid block, mirrored up blocks, two transformer layers in the deepest blocks, ``text_time`` added conditioning.
Two CLIP text encoders (``CLIPTextModel`` and ``CLIPTextModelWithProjection``) with byte-level tokenizers built
locally.

Call kwargs that keep the pipelines fast: ``height``/``width`` multiples of 4 (e.g. 32),
``num_inference_steps=2``, ``output_type="latent"``. Pass ``pipeline_cls`` (any SDXL pipeline or Omni subclass;
InstructPix2Pix gets an 8-channel UNet) and extra init kwargs (e.g. ``pag_applied_layers``) to build it from the
same components. Equal seeds give identical weights.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    DiffusionPipeline,
    EulerDiscreteScheduler,
    StableDiffusionXLInstructPix2PixPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from .tiny import _build_model, _image_projection_state, _seeded, tiny_clip_tokenizer

__all__ = ["TINY_SDXL_IP_EMBED_DIM", "tiny_sdxl_components", "tiny_sdxl_ip_adapter_state_dict", "tiny_sdxl_pipeline"]

TINY_SDXL_IP_EMBED_DIM = 8
_IP_TOKENS = 4

_CLIP_DIM = 32
_TIME_EMBED_DIM = 8
_LATENT_CHANNELS = 4


def _clip_config(tokenizer: CLIPTokenizer) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=_CLIP_DIM,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        projection_dim=_CLIP_DIM,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        hidden_act="gelu",
    )


def _vae() -> AutoencoderKL:
    return AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(4, 8),
        layers_per_block=1,
        latent_channels=_LATENT_CHANNELS,
        norm_num_groups=4,
        sample_size=32,
        scaling_factor=0.13025,
    )


def _unet(in_channels: int) -> UNet2DConditionModel:
    return UNet2DConditionModel(
        sample_size=16,
        in_channels=in_channels,
        out_channels=_LATENT_CHANNELS,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(16, 32),
        layers_per_block=1,
        norm_num_groups=8,
        attention_head_dim=(2, 4),  # heads per block, as in SDXL's config
        transformer_layers_per_block=(1, 2),
        use_linear_projection=True,
        cross_attention_dim=2 * _CLIP_DIM,  # both CLIP hidden states side by side
        addition_embed_type="text_time",
        addition_time_embed_dim=_TIME_EMBED_DIM,
        projection_class_embeddings_input_dim=6 * _TIME_EMBED_DIM + _CLIP_DIM,
    )


def _scheduler() -> EulerDiscreteScheduler:
    return EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        steps_offset=1,
        timestep_spacing="leading",
    )


def tiny_sdxl_components(seed: int = 0, unet_in_channels: int = _LATENT_CHANNELS) -> dict[str, Any]:
    """Components for a tiny ``StableDiffusionXLPipeline`` (8 UNet input channels for InstructPix2Pix)."""
    tokenizer = tiny_clip_tokenizer()
    tokenizer_2 = tiny_clip_tokenizer()
    return {
        "vae": _build_model(seed, _vae),
        "text_encoder": _build_model(seed, lambda: CLIPTextModel(_clip_config(tokenizer))),
        "text_encoder_2": _build_model(seed + 1, lambda: CLIPTextModelWithProjection(_clip_config(tokenizer_2))),
        "tokenizer": tokenizer,
        "tokenizer_2": tokenizer_2,
        "unet": _build_model(seed, lambda: _unet(unet_in_channels)),
        "scheduler": _scheduler(),
        "image_encoder": None,
        "feature_extractor": None,
    }


def tiny_sdxl_pipeline(
    seed: int = 0, pipeline_cls: type[DiffusionPipeline] | None = None, **pipeline_kwargs: Any
) -> DiffusionPipeline:
    """Tiny ``StableDiffusionXLPipeline`` (or ``pipeline_cls``) built from :func:`tiny_sdxl_components`."""
    pipeline_cls = pipeline_cls or StableDiffusionXLPipeline
    in_channels = 2 * _LATENT_CHANNELS if issubclass(pipeline_cls, StableDiffusionXLInstructPix2PixPipeline) else None
    components = tiny_sdxl_components(seed, in_channels or _LATENT_CHANNELS)
    accepted = inspect.signature(pipeline_cls.__init__).parameters
    # InstructPix2Pix takes no IP-adapter image encoder; no pipeline needs the invisible watermark here.
    components = {k: v for k, v in components.items() if k in accepted}
    if "add_watermarker" in accepted:
        pipeline_kwargs.setdefault("add_watermarker", False)
    return pipeline_cls(**components, **pipeline_kwargs)


def tiny_sdxl_ip_adapter_state_dict(unet: UNet2DConditionModel, seed: int = 0) -> dict[str, dict]:
    """A random IP-Adapter checkpoint (the plain ``ImageProjection`` kind, 4 image tokens) in the layout
    ``IPAdapterMixin.load_ip_adapter`` reads; pass it as the checkpoint: ``pipe.load_ip_adapter(state_dict,
    subfolder="", weight_name="", image_encoder_folder=None)``. Image embeddings are ``[batch, 1, 8]`` (``TINY_SDXL_IP_EMBED_DIM``)."""
    cross_dim = unet.config.cross_attention_dim
    with _seeded(seed):
        image_proj = _image_projection_state(TINY_SDXL_IP_EMBED_DIM, cross_dim, _IP_TOKENS)
        # Diffusers numbers the cross-attention layers 1, 3, 5, ... in ``attn_processors`` order.
        ip_adapter = {}
        key_id = 1
        for name in unet.attn_processors:
            if name.endswith("attn1.processor"):
                continue
            hidden_size = unet.get_submodule(name.removesuffix(".processor")).to_k.out_features
            for weight in ("to_k_ip", "to_v_ip"):
                ip_adapter[f"{key_id}.{weight}.weight"] = torch.randn(hidden_size, cross_dim) * 0.2
            key_id += 2
    return {"image_proj": image_proj, "ip_adapter": ip_adapter}
