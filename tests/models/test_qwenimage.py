"""Qwen-Image: standard family tests, the padding mask, and processors swapped behind omni attention's back."""

from __future__ import annotations

import pytest
import torch
from diffusers import QwenImageImg2ImgPipeline
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0
from PIL import Image

from diffusers_omni import omnify
from diffusers_omni.attention.backends.base import AttentionBackend
from diffusers_omni.attention.registry import register_backend, reset_backend
from diffusers_omni.pipelines import qwenimage as omni_qwenimage
from diffusers_omni.pipelines.qwenimage import OmniQwenImageImg2ImgPipeline, OmniQwenImagePipeline
from diffusers_omni.testing.tiny_qwenimage import tiny_qwenimage_edit_pipeline, tiny_qwenimage_pipeline

from .harness import ModelCase, check_bitwise_parity, check_omnify_report, standard_tests

SMALL = {"prompt": "a red fox", "height": 32, "width": 32, "num_inference_steps": 2, "output_type": "latent"}
ROLES = {"qwenimage.joint": "self"}

CASES = [ModelCase("qwenimage", tiny_qwenimage_pipeline, OmniQwenImagePipeline, SMALL, ROLES)]

globals().update(standard_tests(CASES))

IMAGE = Image.new("RGB", (32, 32), (120, 60, 30))


def test_img2img_torch_sdpa_bitwise_equal_to_stock_diffusers():
    call = {**SMALL, "image": IMAGE, "strength": 0.9}
    factory = lambda pipeline_cls=None: tiny_qwenimage_pipeline(pipeline_cls=pipeline_cls or QwenImageImg2ImgPipeline)
    check_bitwise_parity(ModelCase("qwenimage_img2img", factory, OmniQwenImageImg2ImgPipeline, call, ROLES))


# The Edit pipelines resize their input image to ~1024x1024 before encoding it (hard-coded in Diffusers), too slow
# to run on CPU in the suite; their omnify and report are checked on tiny pipelines that are built but not run.
@pytest.mark.parametrize(
    "name, factory",
    [
        ("QwenImageInpaintPipeline", tiny_qwenimage_pipeline),
        ("QwenImageEditPipeline", tiny_qwenimage_edit_pipeline),
        ("QwenImageEditPlusPipeline", tiny_qwenimage_edit_pipeline),
        ("QwenImageEditInpaintPipeline", tiny_qwenimage_edit_pipeline),
        ("QwenImageLayeredPipeline", tiny_qwenimage_edit_pipeline),
    ],
)
def test_every_qwenimage_pipeline_omnifies_with_the_joint_role(name, factory):
    import diffusers

    omni_cls = getattr(omni_qwenimage, f"Omni{name}")
    build = lambda pipeline_cls=None: factory(pipeline_cls=getattr(diffusers, name))
    check_omnify_report(ModelCase(name, build, omni_cls, {}, ROLES))

TWO_LENGTHS = {**SMALL, "prompt": ["a red fox", "a red fox jumping over a lazy brown dog"]}
SAME_LENGTH = {**SMALL, "prompt": ["a red fox", "a tan cat"]}


def _run(pipe, call: dict) -> torch.Tensor:
    return pipe(**call, generator=torch.Generator().manual_seed(0)).images


@pytest.fixture
def seen_masks(monkeypatch):
    from diffusers_omni.attention.backends.sdpa import backend as sdpa

    seen: list = []
    original = sdpa.sdpa_bshd
    monkeypatch.setattr(sdpa, "sdpa_bshd", lambda *a, **k: seen.append(a[3]) or original(*a, **k))
    return seen


@pytest.fixture
def maskless_backend():
    class NoMask(AttentionBackend):
        name = "NOMASK_QWEN_TEST"
        devices = frozenset({"cpu"})
        supports_mask = False

        def __call__(self, q, k, v, attn_mask=None, *args):
            return q

    register_backend("NOMASK_QWEN_TEST", NoMask)
    yield "NOMASK_QWEN_TEST"
    reset_backend("NOMASK_QWEN_TEST")


def test_an_explicit_maskless_backend_is_refused_at_enable_time_naming_the_role(maskless_backend):
    pipe = tiny_qwenimage_pipeline()
    with pytest.raises(Exception, match="qwenimage.joint") as raised:
        omnify(pipe, maskless_backend)
    assert "mask" in str(raised.value)
    assert all(isinstance(m.processor, QwenDoubleStreamAttnProcessor2_0) for m in _attention_modules(pipe))


def test_prompts_of_different_lengths_send_a_key_padding_mask_to_the_backend(seen_masks):
    expected = _run(tiny_qwenimage_pipeline(), TWO_LENGTHS)
    pipe = omnify(tiny_qwenimage_pipeline(), "TORCH_SDPA")
    assert torch.equal(_run(pipe, TWO_LENGTHS), expected)
    assert seen_masks and all(mask is not None for mask in seen_masks)
    mask = seen_masks[0]
    text_len = pipe.encode_prompt(TWO_LENGTHS["prompt"])[0].shape[1]
    image_len = (32 // 8) ** 2
    assert mask.dtype == torch.bool and mask.shape == (2, 1, 1, text_len + image_len)
    assert mask[0, 0, 0].logical_not().any() and mask[1, 0, 0].all()
    # One joint mask per forward, shared by every block.
    assert len({id(m) for m in seen_masks}) == len(seen_masks) // len(pipe.transformer.transformer_blocks)


def test_same_length_prompts_run_unmasked(seen_masks):
    pipe = omnify(tiny_qwenimage_pipeline(), "TORCH_SDPA")
    _run(pipe, SAME_LENGTH)
    assert seen_masks and all(mask is None for mask in seen_masks)


def test_an_all_true_text_mask_is_dropped_before_the_backend(seen_masks):
    pipe = omnify(tiny_qwenimage_pipeline(), "TORCH_SDPA")
    embeds, _ = pipe.encode_prompt("a red fox")
    call = {key: value for key, value in SMALL.items() if key != "prompt"}
    full = torch.ones(embeds.shape[:2], dtype=torch.long)
    masked = _run(pipe, {**call, "prompt_embeds": embeds, "prompt_embeds_mask": full})
    assert seen_masks and all(mask is None for mask in seen_masks)
    assert torch.equal(masked, _run(pipe, {**call, "prompt_embeds": embeds}))


def _attention_modules(pipe):
    return [m for m in pipe.transformer.modules() if hasattr(m, "set_processor")]


def test_processors_swapped_by_diffusers_are_replaced_again_on_the_next_call():
    expected = _run(tiny_qwenimage_pipeline(), SMALL)
    pipe = omnify(tiny_qwenimage_pipeline(), "TORCH_SDPA")
    pipe.transformer.set_attn_processor(QwenDoubleStreamAttnProcessor2_0())
    assert torch.equal(_run(pipe, SMALL), expected)
    assert all(type(m.processor).__name__ == "OmniQwenDoubleStreamAttnProcessor" for m in _attention_modules(pipe))


def test_an_unknown_swapped_processor_raises_naming_the_module():
    pipe = omnify(tiny_qwenimage_pipeline(), "TORCH_SDPA")
    pipe.transformer.transformer_blocks[1].attn.set_processor(object())
    with pytest.raises(TypeError, match="'transformer_blocks.1.attn' uses processor object"):
        _run(pipe, SMALL)
