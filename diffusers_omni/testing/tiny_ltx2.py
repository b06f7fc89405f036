"""Tiny, randomly initialised LTX-2 pipelines (text-to-video+audio, image-to-video, condition) for CPU tests.

Nothing is downloaded: the Gemma-3 text encoder (with a tiny SigLIP vision tower the pipelines never run), the
connectors, the video and audio VAEs and the vocoder are built from configs; the Gemma tokenizer is
character-level.

Fast call kwargs: ``height=32, width=32, num_frames=5, frame_rate=25.0, max_sequence_length=16``, two steps,
``guidance_scale=1.0`` and ``output_type="latent"`` (the outputs' ``frames`` are video latents, ``audio`` audio
latents).
"""

from __future__ import annotations

import string
from typing import Any, TypeVar

from diffusers import (
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    LTX2ConditionPipeline,
    LTX2ImageToVideoPipeline,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
)
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, GemmaTokenizer
from transformers import SiglipVisionConfig

from .tiny import _build_model

__all__ = [
    "tiny_gemma_tokenizer",
    "tiny_ltx2_components",
    "tiny_ltx2_condition_pipeline",
    "tiny_ltx2_i2v_pipeline",
    "tiny_ltx2_pipeline",
    "tiny_ltx23_pipeline",
]

P = TypeVar("P", bound=DiffusionPipeline)

_GEMMA_DIM = 16
_GEMMA_LAYERS = 2
_LATENT_CHANNELS = 4
_AUDIO_LATENT_CHANNELS = 2
_MEL_BINS = 8


def tiny_gemma_tokenizer() -> GemmaTokenizer:
    """Character-level Gemma tokenizer covering printable ASCII (no merges)."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    symbols = specials + ["▁"] + list(string.ascii_letters + string.digits + string.punctuation)
    return GemmaTokenizer(vocab={symbol: index for index, symbol in enumerate(symbols)}, merges=[])


def _gemma_text_encoder(tokenizer: GemmaTokenizer) -> Gemma3ForConditionalGeneration:
    text_config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=_GEMMA_DIM,
        intermediate_size=16,
        num_hidden_layers=_GEMMA_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        sliding_window=8,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    vision_config = SiglipVisionConfig(
        hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4
    )
    config = Gemma3Config(text_config=text_config, vision_config=vision_config, mm_tokens_per_image=4)
    return Gemma3ForConditionalGeneration(config)


def _transformer(**overrides: Any) -> LTX2VideoTransformer3DModel:
    return LTX2VideoTransformer3DModel(
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        audio_in_channels=_AUDIO_LATENT_CHANNELS * _MEL_BINS // 4,
        audio_out_channels=_AUDIO_LATENT_CHANNELS * _MEL_BINS // 4,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,
        num_layers=2,
        qk_norm="rms_norm_across_heads",
        caption_channels=_GEMMA_DIM,
        rope_double_precision=False,
        rope_type="split",
        **overrides,
    )


def _connectors() -> LTX2TextConnectors:
    return LTX2TextConnectors(
        caption_channels=_GEMMA_DIM,
        text_proj_in_factor=_GEMMA_LAYERS + 1,
        video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=4,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=4,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None,
        connector_rope_base_seq_len=32,
        rope_double_precision=False,
        rope_type="split",
    )


def _vae() -> AutoencoderKLLTX2Video:
    vae = AutoencoderKLLTX2Video(
        in_channels=3,
        out_channels=3,
        latent_channels=_LATENT_CHANNELS,
        block_out_channels=(8,),
        decoder_block_out_channels=(8,),
        layers_per_block=(1,),
        decoder_layers_per_block=(1, 1),
        spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False),
        downsample_type=("spatial",),
        upsample_residual=(False,),
        upsample_factor=(1,),
        timestep_conditioning=False,
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    )
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    return vae


def _audio_vae() -> AutoencoderKLLTX2Audio:
    return AutoencoderKLLTX2Audio(
        base_channels=4,
        output_channels=2,
        ch_mult=(1,),
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=32,
        latent_channels=_AUDIO_LATENT_CHANNELS,
        norm_type="pixel",
        causality_axis="height",
        dropout=0.0,
        mid_block_add_attention=False,
        sample_rate=16000,
        mel_hop_length=160,
        is_causal=True,
        mel_bins=_MEL_BINS,
    )


def _vocoder() -> LTX2Vocoder:
    return LTX2Vocoder(
        in_channels=2 * _MEL_BINS,
        hidden_channels=8,
        out_channels=2,
        upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1,
        output_sampling_rate=16000,
    )


def tiny_ltx2_components(seed: int = 0) -> dict[str, Any]:
    """Components shared by the tiny LTX-2 pipelines (two audio-video blocks, one block per connector)."""
    tokenizer = tiny_gemma_tokenizer()
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(),
        "vae": _build_model(seed, _vae),
        "audio_vae": _build_model(seed, _audio_vae),
        "text_encoder": _build_model(seed, lambda: _gemma_text_encoder(tokenizer)),
        "tokenizer": tokenizer,
        "connectors": _build_model(seed, _connectors),
        "transformer": _build_model(seed, _transformer),
        "vocoder": _build_model(seed, _vocoder),
    }


def tiny_ltx2_pipeline(seed: int = 0, pipeline_cls: type[P] | None = None) -> P:
    """Tiny ``LTX2Pipeline`` (or ``pipeline_cls``)."""
    return (pipeline_cls or LTX2Pipeline)(**tiny_ltx2_components(seed))


def tiny_ltx2_i2v_pipeline(seed: int = 0, pipeline_cls: type[P] | None = None) -> P:
    """Tiny ``LTX2ImageToVideoPipeline`` (or ``pipeline_cls``)."""
    return (pipeline_cls or LTX2ImageToVideoPipeline)(**tiny_ltx2_components(seed))


def tiny_ltx2_condition_pipeline(seed: int = 0, pipeline_cls: type[P] | None = None) -> P:
    """Tiny ``LTX2ConditionPipeline`` (or ``pipeline_cls``)."""
    return (pipeline_cls or LTX2ConditionPipeline)(**tiny_ltx2_components(seed))


def tiny_ltx23_pipeline(seed: int = 0, pipeline_cls: type[P] | None = None) -> P:
    """Tiny LTX-2.3-style ``LTX2Pipeline``: perturbed attention (spatio-temporal guidance) and per-head gates."""
    components = tiny_ltx2_components(seed)

    components["transformer"] = _build_model(
        seed, lambda: _transformer(perturbed_attn=True, gated_attn=True, audio_gated_attn=True)
    )
    return (pipeline_cls or LTX2Pipeline)(**components)
