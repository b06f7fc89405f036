"""LongCat-Image: standard family tests, the Edit pipeline's report, and processors swapped behind omni attention."""

from __future__ import annotations

import pytest
import torch
from diffusers import LongCatImageEditPipeline
from diffusers.models.transformers.transformer_longcat_image import LongCatImageAttnProcessor

from diffusers_omni import omnify
from diffusers_omni.pipelines.longcat import OmniLongCatImageEditPipeline, OmniLongCatImagePipeline
from diffusers_omni.testing.tiny_longcat import tiny_longcat_pipeline

from .harness import ModelCase, check_omnify_report, standard_tests

SMALL = {
    "prompt": "a red fox",
    "height": 32,
    "width": 32,
    "num_inference_steps": 2,
    "guidance_scale": 1.0,
    "enable_prompt_rewrite": False,
    "output_type": "latent",
}
ROLES = {"longcat.joint": "self", "longcat.single": "self"}

CASES = [ModelCase("longcat", tiny_longcat_pipeline, OmniLongCatImagePipeline, SMALL, ROLES)]

globals().update(standard_tests(CASES))


def test_edit_pipeline_omnifies_with_both_roles():
    # Built, not run: the Edit pipeline encodes its input image with the Qwen2.5-VL vision tower at full size.
    build = lambda pipeline_cls=None: tiny_longcat_pipeline(pipeline_cls=LongCatImageEditPipeline)
    check_omnify_report(ModelCase("longcat_edit", build, OmniLongCatImageEditPipeline, {}, ROLES))


def _run(pipe) -> torch.Tensor:
    return pipe(**SMALL, generator=torch.Generator().manual_seed(0)).images


def test_processors_swapped_by_diffusers_are_replaced_again_on_the_next_call():
    expected = _run(tiny_longcat_pipeline())
    pipe = omnify(tiny_longcat_pipeline(), "TORCH_SDPA")
    pipe.transformer.set_attn_processor(LongCatImageAttnProcessor())
    assert torch.equal(_run(pipe), expected)
    modules = [m for m in pipe.transformer.modules() if hasattr(m, "set_processor")]
    assert all(type(m.processor).__name__ == "OmniLongCatImageAttnProcessor" for m in modules)


def test_an_unknown_swapped_processor_raises_naming_the_module():
    pipe = omnify(tiny_longcat_pipeline(), "TORCH_SDPA")
    pipe.transformer.single_transformer_blocks[0].attn.set_processor(object())
    with pytest.raises(TypeError, match="'single_transformer_blocks.0.attn' uses processor object"):
        _run(pipe)
