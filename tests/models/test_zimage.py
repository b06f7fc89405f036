"""Z-Image: standard family tests, padding masks per stage, and processors swapped behind omni attention's back."""

from __future__ import annotations

import pytest
import torch
from diffusers import ZImageImg2ImgPipeline, ZImageInpaintPipeline
from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor
from PIL import Image

from diffusers_omni import omnify
from diffusers_omni.attention.backends.base import AttentionBackend
from diffusers_omni.attention.registry import register_backend, reset_backend
from diffusers_omni.pipelines.zimage import OmniZImageImg2ImgPipeline, OmniZImageInpaintPipeline, OmniZImagePipeline
from diffusers_omni.testing.tiny_zimage import tiny_zimage_pipeline

from .harness import ModelCase, check_bitwise_parity, check_omnify_report, standard_tests

SMALL = {
    "prompt": "a red fox",
    "height": 32,
    "width": 32,
    "num_inference_steps": 2,
    "max_sequence_length": 64,
    "guidance_scale": 0.0,
    "output_type": "latent",
}
ROLES = {"zimage.noise_refiner": "self", "zimage.context_refiner": "self", "zimage.joint": "self"}

CASES = [ModelCase("zimage", tiny_zimage_pipeline, OmniZImagePipeline, SMALL, ROLES)]

globals().update(standard_tests(CASES))

# Captions are padded to multiples of 32 tokens: 28 and 52 tokens give 32 and 64, 28 and 28 give 32 and 32.
TWO_LENGTHS = {**SMALL, "prompt": ["a red fox", "a red fox jumping over a lazy dog"]}
SAME_LENGTH = {**SMALL, "prompt": ["a red fox", "a tan cat"]}
IMAGE = Image.new("RGB", (32, 32), (120, 60, 30))


def _run(pipe, call: dict) -> torch.Tensor:
    # ZImagePipeline writes the chat-templated prompts back into the list it is given: pass a fresh list each call.
    call = {key: list(value) if isinstance(value, list) else value for key, value in call.items()}
    return pipe(**call, generator=torch.Generator().manual_seed(0)).images


def _factory(pipeline_cls):
    return lambda cls=None: tiny_zimage_pipeline(pipeline_cls=cls or pipeline_cls)


def test_img2img_and_inpaint_torch_sdpa_bitwise_equal_to_stock_diffusers():
    call = {**SMALL, "image": IMAGE, "strength": 0.9}
    check_bitwise_parity(ModelCase("img2img", _factory(ZImageImg2ImgPipeline), OmniZImageImg2ImgPipeline, call, ROLES))
    inpaint = ModelCase("inpaint", _factory(ZImageInpaintPipeline), OmniZImageInpaintPipeline, {}, ROLES)
    check_omnify_report(inpaint)


@pytest.fixture
def seen_masks(monkeypatch):
    """(role, mask) of every call that reaches SDPA, the mask as the backend receives it."""
    from diffusers_omni.attention.backends.sdpa import backend as sdpa
    from diffusers_omni.attention.processors import RoleAttention

    seen: list = []
    current = {}
    original_sdpa, original_call = sdpa.sdpa_bshd, RoleAttention.__call__

    def role_call(self, *args, **kwargs):
        current["role"] = self.role
        return original_call(self, *args, **kwargs)

    monkeypatch.setattr(RoleAttention, "__call__", role_call)
    monkeypatch.setattr(sdpa, "sdpa_bshd", lambda *a, **k: seen.append((current["role"], a[3])) or original_sdpa(*a, **k))
    return seen


@pytest.fixture
def maskless_backend():
    class NoMask(AttentionBackend):
        name = "NOMASK_ZIMAGE_TEST"
        devices = frozenset({"cpu"})
        supports_mask = False

        def __call__(self, q, k, v, attn_mask=None, *args):
            return q

    register_backend("NOMASK_ZIMAGE_TEST", NoMask)
    yield "NOMASK_ZIMAGE_TEST"
    reset_backend("NOMASK_ZIMAGE_TEST")


def test_an_explicit_maskless_backend_is_refused_at_enable_time_naming_a_masked_role(maskless_backend):
    pipe = tiny_zimage_pipeline()
    with pytest.raises(Exception, match="zimage.(context_refiner|joint)"):
        omnify(pipe, maskless_backend)
    assert all(isinstance(m.processor, ZSingleStreamAttnProcessor) for m in _attention_modules(pipe))
    # The noise refiner is unmasked in every Diffusers pipeline: the mask-less backend may serve it alone.
    pipe = omnify(pipe, {"default": "TORCH_SDPA", "per_role": {"zimage.noise_refiner": maskless_backend}})
    report = pipe.omni_attention_report()
    assert {e["backend"] for e in report if e["role"] == "zimage.noise_refiner"} == {maskless_backend}


def test_prompts_of_different_padded_lengths_send_key_padding_masks_to_the_backend(seen_masks):
    expected = _run(tiny_zimage_pipeline(), TWO_LENGTHS)
    pipe = omnify(tiny_zimage_pipeline(), "TORCH_SDPA")
    assert torch.equal(_run(pipe, TWO_LENGTHS), expected)
    by_role = {}
    for role, mask in seen_masks:
        by_role.setdefault(role, []).append(mask)
    image_len = (32 // 2 // 2) ** 2
    assert all(mask is None for mask in by_role["zimage.noise_refiner"])
    # The context refiner sees 64 caption slots, the joint layers the image tokens and 64 caption slots.
    for role, key_len in (("zimage.context_refiner", 64), ("zimage.joint", image_len + 64)):
        masks = by_role[role]
        assert all(mask is not None and mask.dtype == torch.bool and mask.shape == (2, key_len) for mask in masks)
        assert not masks[0][0].all() and masks[0][1].all()
        # One [B, S] mask per stage and forward, shared by its layers.
        assert len({id(mask) for mask in masks}) == 2  # two denoising steps


def test_same_padded_length_prompts_run_unmasked(seen_masks):
    pipe = omnify(tiny_zimage_pipeline(), "TORCH_SDPA")
    _run(pipe, SAME_LENGTH)
    assert seen_masks and all(mask is None for _, mask in seen_masks)


def _attention_modules(pipe):
    return [m for m in pipe.transformer.modules() if hasattr(m, "set_processor")]


def test_a_processor_swapped_on_a_module_is_replaced_again_on_the_next_call():
    expected = _run(tiny_zimage_pipeline(), SMALL)
    pipe = omnify(tiny_zimage_pipeline(), "TORCH_SDPA")
    pipe.transformer.context_refiner[0].attention.set_processor(ZSingleStreamAttnProcessor())
    assert torch.equal(_run(pipe, SMALL), expected)
    assert all(type(m.processor).__name__ == "OmniZImageAttnProcessor" for m in _attention_modules(pipe))


def test_an_unknown_swapped_processor_raises_naming_the_module():
    pipe = omnify(tiny_zimage_pipeline(), "TORCH_SDPA")
    pipe.transformer.layers[1].attention.set_processor(object())
    with pytest.raises(TypeError, match="'layers.1.attention' uses processor object"):
        _run(pipe, SMALL)


def test_the_omni_variant_gets_a_siglip_refiner_role_and_its_pipeline_an_omni_class():
    from diffusers import ZImageOmniPipeline, ZImageTransformer2DModel

    from diffusers_omni import apply_attention
    from diffusers_omni.pipelines.registry import omni_pipeline_class
    from diffusers_omni.pipelines.zimage import OmniZImageOmniPipeline

    assert omni_pipeline_class(ZImageOmniPipeline) is OmniZImageOmniPipeline
    model = ZImageTransformer2DModel(
        dim=32, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=16, siglip_feat_dim=8,
        axes_dims=[8, 4, 4], axes_lens=[256, 32, 32],
    )
    report = apply_attention(model, "TORCH_SDPA")
    assert {e["module"]: e["role"] for e in report if e["module"].startswith("siglip_refiner.")} == {
        "siglip_refiner.0.attention": "zimage.siglip_refiner"
    }
