"""Tiny, randomly initialised, fully local Diffusers pipelines for fast CPU tests.

Every factory builds its components from configs (nothing is downloaded), seeds
torch before each component inside a forked RNG (so the caller's global RNG is
left untouched and equal seeds give identical weights) and puts every model in
``eval()`` mode.

Supported pipelines and the call kwargs that keep them fast:

* FLUX.1 (``FluxPipeline``): ``height``/``width`` multiples of 4, e.g. 32.
  The default ``max_sequence_length=512`` works; a smaller value is faster.
* Wan 2.1 T2V (``WanPipeline``): ``height``/``width`` multiples of 16, e.g. 32,
  ``num_frames`` of the form ``4k + 1``, e.g. 5. Any ``max_sequence_length``
  up to 512 works.
* Wan 2.1 I2V (``WanImageToVideoPipeline``): as T2V plus ``image``. Keep the
  default ``max_sequence_length=512``: Wan's attention processor splits the
  image/text context at a hard-coded 512 text tokens, so a shorter text
  context runs without error but silently drops the image cross-attention.

Pass ``pipeline_cls`` to build a subclass from the same components.

Bitwise reproducibility holds between pipelines built by these factories. A
``save_pretrained``/``from_pretrained`` round trip reloads identical weights,
but CPU kernels may differ in the last bit for differently aligned tensors,
so compare reloaded outputs with a tolerance.
"""

from __future__ import annotations

import logging
import re
import string
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, overload

import torch

# Diffusers' pipeline modules read ``transformers.CLIPImageProcessor`` at import; without torchvision, transformers 5
# logs a fallback notice for it (harmless: it uses the PIL class). Dropped for this import only, as
# ``diffusers_omni.utils.quiet`` does for the package (``testing`` imports nothing of the package).
_FALLBACK = re.compile(r"^`\w+` requires torchvision \(not installed\); falling back to `\w+Pil`")


@contextmanager
def _quiet_torchvision_fallback() -> Iterator[None]:
    logger = logging.getLogger("transformers.utils.import_utils")
    drop = logging.Filter()
    drop.filter = lambda record: not _FALLBACK.match(record.getMessage())  # type: ignore[method-assign]
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


with _quiet_torchvision_fallback():
    from diffusers import (
        AutoencoderKL,
        AutoencoderKLWan,
        DiffusionPipeline,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
        UniPCMultistepScheduler,
        WanImageToVideoPipeline,
        WanPipeline,
        WanTransformer3DModel,
    )
from tokenizers.pre_tokenizers import ByteLevel
from transformers import (
    CLIPImageProcessorPil,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTokenizer,
    CLIPVisionConfig,
    CLIPVisionModel,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
    UMT5Config,
    UMT5EncoderModel,
)

__all__ = [
    "tiny_clip_tokenizer",
    "tiny_flux_components",
    "tiny_flux_pipeline",
    "tiny_t5_tokenizer",
    "tiny_wan_components",
    "tiny_wan_i2v_components",
    "tiny_wan_i2v_pipeline",
    "tiny_wan_pipeline",
]

P = TypeVar("P", bound=DiffusionPipeline)
M = TypeVar("M", bound=torch.nn.Module)

_CLIP_MAX_LENGTH = 77
_T5_MAX_LENGTH = 512
_TEXT_DIM = 32
_CLIP_IMAGE_SIZE = 32
_CLIP_VISION_DIM = 8
_WAN_HEADS = 2
_WAN_HEAD_DIM = 12
_WAN_LATENT_CHANNELS = 16

_CHARACTERS = string.ascii_letters + string.digits + string.punctuation


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _build_model(seed: int, factory: Callable[[], M]) -> M:
    with _seeded(seed):
        model = factory()
    return model.eval()


def tiny_clip_tokenizer() -> CLIPTokenizer:
    """Byte-level CLIP tokenizer with one token per byte (no merges)."""
    alphabet = sorted(ByteLevel.alphabet())
    symbols = alphabet + [f"{char}</w>" for char in alphabet]
    vocab = {symbol: index for index, symbol in enumerate(symbols)}
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=_CLIP_MAX_LENGTH)


def tiny_t5_tokenizer() -> T5Tokenizer:
    """Character-level Unigram T5 tokenizer covering printable ASCII."""
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [(f"▁{char}", -3.0) for char in _CHARACTERS]
    vocab += [(char, -4.0) for char in _CHARACTERS]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=_T5_MAX_LENGTH)


def _clip_text_encoder(tokenizer: CLIPTokenizer) -> CLIPTextModel:
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=_TEXT_DIM,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=_CLIP_MAX_LENGTH,
        projection_dim=_TEXT_DIM,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModel(config)


def _t5_config_kwargs(tokenizer: T5Tokenizer) -> dict[str, Any]:
    return {
        "vocab_size": len(tokenizer),
        "d_model": _TEXT_DIM,
        "d_kv": 8,
        "d_ff": 37,
        "num_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "decoder_start_token_id": tokenizer.pad_token_id,
    }


def _t5_text_encoder(tokenizer: T5Tokenizer) -> T5EncoderModel:
    return T5EncoderModel(T5Config(**_t5_config_kwargs(tokenizer)))


def _umt5_text_encoder(tokenizer: T5Tokenizer) -> UMT5EncoderModel:
    return UMT5EncoderModel(UMT5Config(**_t5_config_kwargs(tokenizer)))


def tiny_kl_vae(block_out_channels=(4, 8), latent_channels=4, norm_num_groups=4, quant_conv=False) -> AutoencoderKL:
    """A two-level ``AutoencoderKL`` (scale factor 2) with FLUX-style scaling and shift."""
    return AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=block_out_channels,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=norm_num_groups,
        sample_size=32,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=quant_conv,
        use_post_quant_conv=quant_conv,
    )


def _flux_vae() -> AutoencoderKL:
    return tiny_kl_vae()


def _flux_transformer(vae: AutoencoderKL) -> FluxTransformer2DModel:
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * vae.config.latent_channels,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=_TEXT_DIM,
        pooled_projection_dim=_TEXT_DIM,
        guidance_embeds=True,
        axes_dims_rope=(4, 4, 8),
    )


def _flux_scheduler() -> FlowMatchEulerDiscreteScheduler:
    return FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )


def _image_projection_state(embed_dim: int, cross_dim: int, tokens: int) -> dict[str, torch.Tensor]:
    """Random weights of Diffusers' plain ``ImageProjection`` (``tokens`` image tokens of width ``cross_dim`` from
    ``embed_dim``-wide image embeddings), drawn from the current global generator."""
    return {
        "proj.weight": torch.randn(tokens * cross_dim, embed_dim) * 0.2,
        "proj.bias": torch.randn(tokens * cross_dim) * 0.2,
        "norm.weight": 1 + 0.1 * torch.randn(cross_dim),
        "norm.bias": 0.1 * torch.randn(cross_dim),
    }


def tiny_flux_inputs(seed: int = 0, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8) -> dict[str, Any]:
    """Random keyword inputs for the transformer of ``tiny_flux_components`` (``image_tokens`` packed latent
    tokens, ``text_tokens`` text tokens, timestep 0.5, guidance 3.5)."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(batch, image_tokens, 16, generator=generator),
        "encoder_hidden_states": torch.randn(batch, text_tokens, 32, generator=generator),
        "pooled_projections": torch.randn(batch, 32, generator=generator),
        "timestep": torch.tensor([0.5] * batch),
        "guidance": torch.tensor([3.5] * batch),
        "img_ids": torch.zeros(image_tokens, 3),
        "txt_ids": torch.zeros(text_tokens, 3),
    }


def tiny_flux_components(seed: int = 0) -> dict[str, Any]:
    """Components for a tiny FLUX.1-dev-like ``FluxPipeline`` (guidance-distilled)."""
    tokenizer = tiny_clip_tokenizer()
    tokenizer_2 = tiny_t5_tokenizer()
    vae = _build_model(seed, _flux_vae)
    return {
        "scheduler": _flux_scheduler(),
        "vae": vae,
        "text_encoder": _build_model(seed, lambda: _clip_text_encoder(tokenizer)),
        "tokenizer": tokenizer,
        "text_encoder_2": _build_model(seed, lambda: _t5_text_encoder(tokenizer_2)),
        "tokenizer_2": tokenizer_2,
        "transformer": _build_model(seed, lambda: _flux_transformer(vae)),
        "image_encoder": None,
        "feature_extractor": None,
    }


@overload
def tiny_flux_pipeline(seed: int = ..., pipeline_cls: None = ...) -> FluxPipeline: ...
@overload
def tiny_flux_pipeline(seed: int = ..., pipeline_cls: type[P] = ...) -> P: ...
def tiny_flux_pipeline(seed: int = 0, pipeline_cls: type[DiffusionPipeline] | None = None) -> DiffusionPipeline:
    """Tiny ``FluxPipeline`` (or ``pipeline_cls``) built from :func:`tiny_flux_components`."""
    return (pipeline_cls or FluxPipeline)(**tiny_flux_components(seed))


def _wan_vae() -> AutoencoderKLWan:
    return AutoencoderKLWan(
        base_dim=3,
        z_dim=_WAN_LATENT_CHANNELS,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )


def _wan_transformer(in_channels: int, image_dim: int | None = None) -> WanTransformer3DModel:
    inner_dim = _WAN_HEADS * _WAN_HEAD_DIM
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=_WAN_HEADS,
        attention_head_dim=_WAN_HEAD_DIM,
        in_channels=in_channels,
        out_channels=_WAN_LATENT_CHANNELS,
        text_dim=_TEXT_DIM,
        freq_dim=256,
        ffn_dim=32,
        num_layers=1,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        image_dim=image_dim,
        added_kv_proj_dim=inner_dim if image_dim is not None else None,
        rope_max_seq_len=32,
    )


def _wan_scheduler() -> UniPCMultistepScheduler:
    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)


def _clip_image_encoder() -> CLIPVisionModel:
    config = CLIPVisionConfig(
        hidden_size=_CLIP_VISION_DIM,
        projection_dim=_CLIP_VISION_DIM,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=_CLIP_IMAGE_SIZE,
        patch_size=8,
    )
    return CLIPVisionModel(config)


def _clip_image_processor() -> CLIPImageProcessorPil:
    return CLIPImageProcessorPil(size=_CLIP_IMAGE_SIZE, crop_size=_CLIP_IMAGE_SIZE)


def _wan_text_components(seed: int) -> dict[str, Any]:
    tokenizer = tiny_t5_tokenizer()
    return {
        "tokenizer": tokenizer,
        "text_encoder": _build_model(seed, lambda: _umt5_text_encoder(tokenizer)),
        "vae": _build_model(seed, _wan_vae),
        "scheduler": _wan_scheduler(),
    }


def tiny_wan_components(seed: int = 0) -> dict[str, Any]:
    """Components for a tiny Wan 2.1 text-to-video ``WanPipeline``."""
    transformer = _build_model(seed, lambda: _wan_transformer(_WAN_LATENT_CHANNELS))
    return {**_wan_text_components(seed), "transformer": transformer, "transformer_2": None}


@overload
def tiny_wan_pipeline(seed: int = ..., pipeline_cls: None = ...) -> WanPipeline: ...
@overload
def tiny_wan_pipeline(seed: int = ..., pipeline_cls: type[P] = ...) -> P: ...
def tiny_wan_pipeline(seed: int = 0, pipeline_cls: type[DiffusionPipeline] | None = None) -> DiffusionPipeline:
    """Tiny ``WanPipeline`` (or ``pipeline_cls``) built from :func:`tiny_wan_components`."""
    return (pipeline_cls or WanPipeline)(**tiny_wan_components(seed))


def tiny_wan_i2v_components(seed: int = 0) -> dict[str, Any]:
    """Components for a tiny Wan 2.1 image-to-video ``WanImageToVideoPipeline``.

    The transformer takes noise, mask and image-condition latents
    (``2 * 16 + 4`` channels) and has image cross-attention fed by the CLIP
    vision encoder's penultimate hidden states.
    """
    in_channels = 2 * _WAN_LATENT_CHANNELS + 4
    transformer = _build_model(seed, lambda: _wan_transformer(in_channels, image_dim=_CLIP_VISION_DIM))
    return {
        **_wan_text_components(seed),
        "transformer": transformer,
        "transformer_2": None,
        "image_encoder": _build_model(seed, _clip_image_encoder),
        "image_processor": _clip_image_processor(),
    }


@overload
def tiny_wan_i2v_pipeline(seed: int = ..., pipeline_cls: None = ...) -> WanImageToVideoPipeline: ...
@overload
def tiny_wan_i2v_pipeline(seed: int = ..., pipeline_cls: type[P] = ...) -> P: ...
def tiny_wan_i2v_pipeline(seed: int = 0, pipeline_cls: type[DiffusionPipeline] | None = None) -> DiffusionPipeline:
    """Tiny ``WanImageToVideoPipeline`` (or ``pipeline_cls``) built from :func:`tiny_wan_i2v_components`."""
    return (pipeline_cls or WanImageToVideoPipeline)(**tiny_wan_i2v_components(seed))


def tiny_pipeline_parts(name: str) -> tuple[type[DiffusionPipeline], Callable[[], Any], Callable[[Any], Any]]:
    """``(pipeline class, VAE factory, DiT factory taking the VAE)`` of ``tiny-flux``, ``tiny-wan`` or
    ``tiny-wan-i2v``: the factories the pipelines above are built with, unseeded, so a caller can build the VAE and
    DiT alone (``generate`` builds them on the meta device to check its arguments before any weights exist)."""
    parts = {
        "tiny-flux": (FluxPipeline, _flux_vae, _flux_transformer),
        "tiny-wan": (WanPipeline, _wan_vae, lambda vae: _wan_transformer(_WAN_LATENT_CHANNELS)),
        "tiny-wan-i2v": (WanImageToVideoPipeline, _wan_vae,
                         lambda vae: _wan_transformer(2 * _WAN_LATENT_CHANNELS + 4, image_dim=_CLIP_VISION_DIM)),
    }
    if name not in parts:
        raise ValueError(f"tiny model {name!r} is not one of {', '.join(parts)}")
    return parts[name]
