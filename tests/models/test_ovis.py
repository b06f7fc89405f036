"""Ovis-Image: standard family tests and processors swapped behind omni attention's back."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers.transformer_ovis_image import OvisImageAttnProcessor

from diffusers_omni import omnify
from diffusers_omni.pipelines.ovis import OmniOvisImagePipeline
from diffusers_omni.testing.tiny_ovis import tiny_ovis_pipeline

from .harness import ModelCase, standard_tests

SMALL = {
    "prompt": "a red fox",
    "height": 32,
    "width": 32,
    "num_inference_steps": 2,
    "guidance_scale": 1.0,
    "max_sequence_length": 32,
    "output_type": "latent",
}
ROLES = {"ovis.joint": "self", "ovis.single": "self"}

CASES = [ModelCase("ovis", tiny_ovis_pipeline, OmniOvisImagePipeline, SMALL, ROLES)]

globals().update(standard_tests(CASES))


def _run(pipe) -> torch.Tensor:
    return pipe(**SMALL, generator=torch.Generator().manual_seed(0)).images


def test_processors_swapped_by_diffusers_are_replaced_again_on_the_next_call():
    expected = _run(tiny_ovis_pipeline())
    pipe = omnify(tiny_ovis_pipeline(), "TORCH_SDPA")
    # OvisImageTransformer2DModel has no set_attn_processor: swap on the modules.
    modules = [m for m in pipe.transformer.modules() if hasattr(m, "set_processor")]
    for module in modules:
        module.set_processor(OvisImageAttnProcessor())
    assert torch.equal(_run(pipe), expected)
    assert all(type(m.processor).__name__ == "OmniOvisImageAttnProcessor" for m in modules)


def test_an_unknown_swapped_processor_raises_naming_the_module():
    pipe = omnify(tiny_ovis_pipeline(), "TORCH_SDPA")
    pipe.transformer.transformer_blocks[0].attn.set_processor(object())
    with pytest.raises(TypeError, match="'transformer_blocks.0.attn' uses processor object"):
        _run(pipe)
