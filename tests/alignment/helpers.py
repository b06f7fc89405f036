"""Tiny transformers and their recorded inputs, shared by the alignment tests."""

import functools

import torch

from diffusers_omni.alignment import record_transformer_inputs
from diffusers_omni.testing import tiny_flux_pipeline, tiny_wan_pipeline

FLUX_CALL = {"prompt": "a red fox", "height": 32, "width": 32, "num_inference_steps": 2, "max_sequence_length": 32}
WAN_CALL = {"prompt": "a red fox", "height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2}


@functools.lru_cache(maxsize=None)
def _recorded(name):
    if name == "flux":
        pipe = tiny_flux_pipeline()
        inputs = record_transformer_inputs(pipe, generator=torch.Generator().manual_seed(0), **FLUX_CALL)
    else:
        pipe = tiny_wan_pipeline()
        inputs = record_transformer_inputs(pipe, generator=torch.Generator().manual_seed(0), **WAN_CALL)
    return pipe, inputs


def pipeline_and_inputs(name):
    """A fresh pipeline's transformer state is shared across tests; tests must leave attention as they found it."""
    return _recorded(name)
