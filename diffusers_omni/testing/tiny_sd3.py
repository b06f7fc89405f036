"""Tiny, randomly initialised, fully local Stable Diffusion 3 / 3.5 pipelines for fast CPU tests.

The default transformer is SD3.5-Medium-like: RMS q/k norms and a dual-attention first block (image-only
``attn2``), three blocks so that a PAG layer (``"blocks.1"``) lands on an ordinary joint block; pass
``sd35_medium=False`` for an SD3-Medium-like one. Both CLIP text encoders and the T5 encoder are included.

Call kwargs that keep the pipelines fast: ``height``/``width`` multiples of 4 (e.g. 32), a short
``max_sequence_length`` (e.g. 16), ``num_inference_steps=2``. Pass ``pipeline_cls`` (any SD3 pipeline, Img2Img,
Inpaint, PAG, or an Omni subclass) and extra init kwargs (e.g. ``pag_applied_layers``) to build it from the same
components. Equal seeds give identical weights.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

from .tiny import _build_model, _seeded, _t5_config_kwargs, tiny_clip_tokenizer, tiny_t5_tokenizer

__all__ = ["TINY_SD3_IP_EMBED_DIM", "tiny_sd3_components", "tiny_sd3_ip_adapter_state_dict", "tiny_sd3_pipeline"]

TINY_SD3_IP_EMBED_DIM = 8

_CLIP_DIM = 32
_JOINT_DIM = 2 * _CLIP_DIM  # both CLIP hidden states side by side, padded to the T5 width
_LATENT_CHANNELS = 16  # SD3 VAEs have 16; the inpaint pipeline insists on it


def _clip_with_projection(tokenizer: CLIPTokenizer) -> CLIPTextModelWithProjection:
    config = CLIPTextConfig(
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
    )
    return CLIPTextModelWithProjection(config)


def _t5_text_encoder(tokenizer: T5Tokenizer) -> T5EncoderModel:
    # SD3 pads the CLIP hidden states to the T5 width, so T5 must be at least as wide as both CLIPs together.
    return T5EncoderModel(T5Config(**{**_t5_config_kwargs(tokenizer), "d_model": _JOINT_DIM}))


def _vae() -> AutoencoderKL:
    return AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(4, 8),
        layers_per_block=1,
        latent_channels=_LATENT_CHANNELS,
        norm_num_groups=4,
        sample_size=32,
        scaling_factor=1.5305,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def _transformer(sd35_medium: bool) -> SD3Transformer2DModel:
    return SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=_LATENT_CHANNELS,
        num_layers=3,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=_JOINT_DIM,
        caption_projection_dim=16,
        pooled_projection_dim=2 * _CLIP_DIM,
        out_channels=_LATENT_CHANNELS,
        pos_embed_max_size=16,
        qk_norm="rms_norm" if sd35_medium else None,
        dual_attention_layers=(0,) if sd35_medium else (),
    )


def tiny_sd3_components(seed: int = 0, sd35_medium: bool = True) -> dict[str, Any]:
    """Components for a tiny ``StableDiffusion3Pipeline`` (SD3.5-Medium-like unless ``sd35_medium=False``)."""
    tokenizer = tiny_clip_tokenizer()
    tokenizer_2 = tiny_clip_tokenizer()
    tokenizer_3 = tiny_t5_tokenizer()
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0),
        "vae": _build_model(seed, _vae),
        "text_encoder": _build_model(seed, lambda: _clip_with_projection(tokenizer)),
        "tokenizer": tokenizer,
        "text_encoder_2": _build_model(seed + 1, lambda: _clip_with_projection(tokenizer_2)),
        "tokenizer_2": tokenizer_2,
        "text_encoder_3": _build_model(seed, lambda: _t5_text_encoder(tokenizer_3)),
        "tokenizer_3": tokenizer_3,
        "transformer": _build_model(seed, lambda: _transformer(sd35_medium)),
        "image_encoder": None,
        "feature_extractor": None,
    }


def tiny_sd3_pipeline(
    seed: int = 0,
    pipeline_cls: type[DiffusionPipeline] | None = None,
    *,
    sd35_medium: bool = True,
    **pipeline_kwargs: Any,
) -> DiffusionPipeline:
    """Tiny ``StableDiffusion3Pipeline`` (or ``pipeline_cls``) built from :func:`tiny_sd3_components`."""
    pipeline_cls = pipeline_cls or StableDiffusion3Pipeline
    accepted = inspect.signature(pipeline_cls.__init__).parameters
    # PAG and ControlNet pipelines take no IP-adapter image encoder.
    components = {k: v for k, v in tiny_sd3_components(seed, sd35_medium=sd35_medium).items() if k in accepted}
    return pipeline_cls(**components, **pipeline_kwargs)


def tiny_sd3_ip_adapter_state_dict(transformer: SD3Transformer2DModel, seed: int = 0) -> dict[str, dict]:
    """A random IP-Adapter checkpoint in the layout ``SD3IPAdapterMixin.load_ip_adapter`` reads (a narrow
    time-conditioned perceiver image projection of the depth Diffusers assumes, 4 image tokens, and one ``SD3IPAdapterJointAttnProcessor2_0`` per
    attention module); pass it as the checkpoint: ``pipe.load_ip_adapter(state_dict,
    image_encoder_folder=None)``. Image embeddings are
    ``[batch, 1, 8]`` (``TINY_SD3_IP_EMBED_DIM``)."""
    from diffusers.models.attention_processor import SD3IPAdapterJointAttnProcessor2_0
    from diffusers.models.embeddings import IPAdapterTimeImageProjection

    config = transformer.config
    inner_dim = config.attention_head_dim * config.num_attention_heads
    # Diffusers rebuilds the projection from the weight shapes with its defaults (depth 4, 64-wide heads, heads =
    # to_q rows // 64); a single 64-wide head keeps it small.
    hidden_dim = 64

    def randomised(module: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {key: 0.2 * torch.randn_like(value) for key, value in module.state_dict().items()}

    with _seeded(seed):
        image_proj = randomised(
            IPAdapterTimeImageProjection(
                embed_dim=TINY_SD3_IP_EMBED_DIM,
                output_dim=inner_dim,
                hidden_dim=hidden_dim,
                heads=1,
                num_queries=4,
                timestep_in_dim=32,
            )
        )
        ip_adapter = {}
        for index in range(len(transformer.attn_processors)):
            processor = SD3IPAdapterJointAttnProcessor2_0(
                hidden_size=inner_dim,
                ip_hidden_states_dim=inner_dim,
                head_dim=config.attention_head_dim,
                timesteps_emb_dim=hidden_dim,
            )
            ip_adapter.update({f"{index}.{key}": value for key, value in randomised(processor).items()})
    return {"image_proj": image_proj, "ip_adapter": ip_adapter}
