"""Test helpers for ``diffusers_omni``."""

from diffusers_omni.testing.tiny import (
    tiny_clip_tokenizer,
    tiny_flux_components,
    tiny_flux_inputs,
    tiny_flux_pipeline,
    tiny_t5_tokenizer,
    tiny_wan_components,
    tiny_wan_i2v_components,
    tiny_wan_i2v_pipeline,
    tiny_wan_pipeline,
)

__all__ = [
    "tiny_clip_tokenizer",
    "tiny_flux_components",
    "tiny_flux_inputs",
    "tiny_flux_pipeline",
    "tiny_t5_tokenizer",
    "tiny_wan_components",
    "tiny_wan_i2v_components",
    "tiny_wan_i2v_pipeline",
    "tiny_wan_pipeline",
]
