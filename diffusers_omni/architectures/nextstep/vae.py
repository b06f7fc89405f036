"""NextStep's image tokenizer (``vae/``: a FLUX-style autoencoder, 16 latent channels, 8x downsampling) as a
Diffusers ``AutoencoderKL``.

The published folder holds ``config.json`` (the authors' field names: ``ch``, ``ch_mult``, ``num_res_blocks``,
``z_channels``, ``scaling_factor``, ``shift_factor``) and ``checkpoint.pt`` (the original ``encoder.down.0.block.0``
key layout; ``psz``/``encoder_norm`` change only the encoder's posterior, which text-to-image never uses).
``load_nextstep_vae`` maps both onto ``AutoencoderKL`` (Diffusers' own LDM key conversion);
``nextstep_vae_state_dict`` maps back, so a pipeline can be written in the published layout.
"""

from __future__ import annotations

import json
import os
import re

import torch
from diffusers import AutoencoderKL

__all__ = ["autoencoder_config_from_published", "load_nextstep_vae", "nextstep_vae_state_dict", "published_vae_config"]

# Defaults of the reference's autoencoder parameters (FLUX's autoencoder).
_PUBLISHED_DEFAULTS = {
    "resolution": 256, "in_channels": 3, "ch": 128, "out_ch": 3, "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2,
    "z_channels": 16, "scaling_factor": 0.3611, "shift_factor": 0.1159,
}


def autoencoder_config_from_published(published: dict) -> dict:
    """``AutoencoderKL`` init arguments for the published ``vae/config.json``."""
    params = {**_PUBLISHED_DEFAULTS, **{k: v for k, v in published.items() if k in _PUBLISHED_DEFAULTS}}
    levels = len(params["ch_mult"])
    return {
        "in_channels": params["in_channels"],
        "out_channels": params["out_ch"],
        "down_block_types": ["DownEncoderBlock2D"] * levels,
        "up_block_types": ["UpDecoderBlock2D"] * levels,
        "block_out_channels": [params["ch"] * m for m in params["ch_mult"]],
        "layers_per_block": params["num_res_blocks"],
        "latent_channels": params["z_channels"],
        "norm_num_groups": 32,
        "sample_size": params["resolution"],
        "scaling_factor": params["scaling_factor"],
        "shift_factor": params["shift_factor"],
        "use_quant_conv": False,
        "use_post_quant_conv": False,
    }


def published_vae_config(vae: AutoencoderKL) -> dict:
    """The published ``vae/config.json`` fields describing ``vae`` (inverse of ``autoencoder_config_from_published``)."""
    channels = list(vae.config.block_out_channels)
    ch = channels[0]
    if any(c % ch for c in channels) or vae.config.norm_num_groups != 32:
        raise ValueError(
            f"block_out_channels={channels} (norm_num_groups={vae.config.norm_num_groups}) has no published "
            "NextStep form: channels must be multiples of the first and groups 32"
        )
    return {
        "resolution": vae.config.sample_size, "in_channels": vae.config.in_channels, "ch": ch,
        "out_ch": vae.config.out_channels, "ch_mult": [c // ch for c in channels],
        "num_res_blocks": vae.config.layers_per_block, "z_channels": vae.config.latent_channels,
        "scaling_factor": vae.config.scaling_factor, "shift_factor": vae.config.shift_factor,
    }


def load_nextstep_vae(path: str | os.PathLike, torch_dtype: torch.dtype | None = None) -> AutoencoderKL:
    """``AutoencoderKL`` from a published ``vae`` folder (``config.json`` + ``checkpoint.pt``)."""
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    config_path, checkpoint_path = os.path.join(path, "config.json"), os.path.join(path, "checkpoint.pt")
    for file in (config_path, checkpoint_path):
        if not os.path.isfile(file):
            raise FileNotFoundError(f"NextStep VAE folder {os.fspath(path)!r} has no {os.path.basename(file)}")
    with open(config_path, encoding="utf-8") as f:
        config = autoencoder_config_from_published(json.load(f))
    state_dict = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
    converted = convert_ldm_vae_checkpoint(state_dict, config)
    with torch.device("meta"):
        vae = AutoencoderKL(**config)
    vae.load_state_dict(converted, strict=True, assign=True)
    if torch_dtype is not None:
        vae = vae.to(torch_dtype)
    return vae.eval()


_RULES = (
    (r"^(encoder|decoder)\.conv_norm_out\.", r"\1.norm_out."),
    (r"\.mid_block\.resnets\.0\.", ".mid.block_1."),
    (r"\.mid_block\.resnets\.1\.", ".mid.block_2."),
    (r"\.mid_block\.attentions\.0\.group_norm\.", ".mid.attn_1.norm."),
    (r"\.mid_block\.attentions\.0\.to_q\.", ".mid.attn_1.q."),
    (r"\.mid_block\.attentions\.0\.to_k\.", ".mid.attn_1.k."),
    (r"\.mid_block\.attentions\.0\.to_v\.", ".mid.attn_1.v."),
    (r"\.mid_block\.attentions\.0\.to_out\.0\.", ".mid.attn_1.proj_out."),
    (r"\.down_blocks\.(\d+)\.resnets\.(\d+)\.", r".down.\1.block.\2."),
    (r"\.down_blocks\.(\d+)\.downsamplers\.0\.", r".down.\1.downsample."),
    (r"\.conv_shortcut\.", ".nin_shortcut."),
)


def nextstep_vae_state_dict(vae: AutoencoderKL) -> dict[str, torch.Tensor]:
    """``vae``'s weights under the published ``checkpoint.pt`` key names."""
    levels = len(vae.config.block_out_channels)
    out = {}
    for name, tensor in vae.state_dict().items():
        key = name
        for pattern, repl in _RULES:
            key = re.sub(pattern, repl, key)
        key = re.sub(r"\.up_blocks\.(\d+)\.resnets\.(\d+)\.",
                     lambda m: f".up.{levels - 1 - int(m.group(1))}.block.{m.group(2)}.", key)
        key = re.sub(r"\.up_blocks\.(\d+)\.upsamplers\.0\.",
                     lambda m: f".up.{levels - 1 - int(m.group(1))}.upsample.", key)
        if ".mid.attn_1." in key and key.endswith(".weight") and tensor.ndim == 2:
            tensor = tensor[:, :, None, None]
        out[key] = tensor.detach().clone().contiguous()
    return out
