"""Chroma: every call is masked (padding mask expanded to ``[B, 1, S, S]`` in every block)."""

from __future__ import annotations

import pytest
import torch
from diffusers import ChromaImg2ImgPipeline, ChromaInpaintPipeline
from PIL import Image

import diffusers_omni
from diffusers_omni import omnify
from diffusers_omni.attention.backends.sdpa import backend as sdpa
from diffusers_omni.attention.backends.base import AttentionBackend
from diffusers_omni.pipelines.chroma import OmniChromaImg2ImgPipeline, OmniChromaInpaintPipeline, OmniChromaPipeline
from diffusers_omni.testing.tiny_chroma import tiny_chroma_pipeline
from diffusers_omni.testing.tiny_flux_variants import load_tiny_flux_ip_adapter

from .harness import ModelCase, standard_tests

IMAGE = Image.new("RGB", (32, 32), (120, 60, 30))
MASK = Image.new("L", (32, 32), 0)
MASK.paste(255, (8, 8, 24, 24))
SMALL = {
    "prompt": "a red fox",
    "height": 32,
    "width": 32,
    "num_inference_steps": 2,
    "output_type": "latent",
    "max_sequence_length": 16,
}
IMG2IMG = {**SMALL, "image": IMAGE, "strength": 0.7, "num_inference_steps": 3}
ROLES = {"chroma.joint": "self", "chroma.single": "self"}


def tiny_chroma_inpaint_pipeline(pipeline_cls=None):
    pipe = tiny_chroma_pipeline(pipeline_cls=pipeline_cls or ChromaInpaintPipeline)
    # Diffusers 0.42.1 ChromaInpaintPipeline reads transformer.config.guidance_embeds, which
    # ChromaTransformer2DModel's config does not have (AttributeError with real checkpoints too).
    pipe.transformer.register_to_config(guidance_embeds=False)
    return pipe


CASES = [
    ModelCase("chroma", tiny_chroma_pipeline, OmniChromaPipeline, SMALL, ROLES),
    ModelCase(
        "chroma_img2img",
        lambda pipeline_cls=None: tiny_chroma_pipeline(pipeline_cls=pipeline_cls or ChromaImg2ImgPipeline),
        OmniChromaImg2ImgPipeline,
        IMG2IMG,
        ROLES,
    ),
    ModelCase(
        "chroma_inpaint", tiny_chroma_inpaint_pipeline, OmniChromaInpaintPipeline, {**IMG2IMG, "mask_image": MASK}, ROLES
    ),
]

globals().update(standard_tests(CASES))


class _NoMaskBackend(AttentionBackend):
    name = "NOMASK_CHROMA_TEST"
    devices = frozenset({"cpu"})
    supports_mask = False

    def __call__(self, q, k, v, attn_mask=None, *args):
        return q


@pytest.fixture
def nomask_backend():
    diffusers_omni.register_backend(_NoMaskBackend.name, _NoMaskBackend)
    yield _NoMaskBackend.name
    from diffusers_omni.attention.registry import reset_backend

    reset_backend(_NoMaskBackend.name)


def test_declares_masked_roles():
    pipe = omnify(tiny_chroma_pipeline(), "TORCH_SDPA")
    from diffusers_omni.models.base import declaration_for

    declaration = declaration_for(pipe.transformer)
    assert not declaration.mask_free
    assert {role.role: role.masked for role in declaration.roles} == {
        "chroma.joint": True,
        "chroma.single": True,
        "chroma.ip_adapter": False,
    }


def test_explicit_maskless_backend_raises_at_enable_time_naming_the_role(nomask_backend):
    pipe = tiny_chroma_pipeline()
    with pytest.raises(Exception, match="chroma.joint") as excinfo:
        omnify(pipe, nomask_backend)
    assert "mask" in str(excinfo.value).lower()
    assert not any(type(p).__name__.startswith("Omni") for p in pipe.transformer.attn_processors.values())
    # A single masked role on it is refused too, naming that role.
    with pytest.raises(Exception, match="chroma.single"):
        omnify(tiny_chroma_pipeline(), {"default": "TORCH_SDPA", "per_role": {"chroma.single": nomask_backend}})


@pytest.fixture
def seen_masks(monkeypatch):
    seen: list = []
    original = sdpa.sdpa_bshd

    def spy(query, key, value, attn_mask=None, *args):
        seen.append(attn_mask)
        return original(query, key, value, attn_mask, *args)

    monkeypatch.setattr(sdpa, "sdpa_bshd", spy)
    return seen


def test_pipeline_padding_mask_reaches_the_backend_unchanged(seen_masks):
    pipe = omnify(tiny_chroma_pipeline(), "TORCH_SDPA")
    pipe(**SMALL, generator=torch.Generator().manual_seed(0))
    assert len(seen_masks) == 2 * 2 * 2  # 2 steps × (cond + uncond, Chroma does real CFG) × 2 blocks
    text_len, image_len = SMALL["max_sequence_length"], (32 // 4) ** 2
    for mask in seen_masks:
        # Diffusers 0.42 builds Chroma's mask as float 0/1 (an additive bias to SDPA), not boolean.
        assert mask is not None and mask.shape == (1, 1, text_len + image_len, text_len + image_len)
        assert mask.dtype == torch.float32 and not bool(mask.all())


def _transformer_inputs(transformer, attention_mask):
    text_len, image_len = 6, 16
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hidden = torch.randn(1, image_len, transformer.config.in_channels)
        text = torch.randn(1, text_len, transformer.config.joint_attention_dim)
    return {
        "hidden_states": hidden,
        "encoder_hidden_states": text,
        "timestep": torch.tensor([0.5]),
        "img_ids": torch.zeros(image_len, 3),
        "txt_ids": torch.zeros(text_len, 3),
        "attention_mask": attention_mask,
    }


def test_boolean_key_padding_mask_reaches_the_backend_and_all_true_is_dropped(seen_masks):
    stock = tiny_chroma_pipeline().transformer
    pipe = omnify(tiny_chroma_pipeline(), "TORCH_SDPA")
    padded = torch.ones(1, 22, dtype=torch.bool)
    padded[0, 3:6] = False  # three padding text tokens
    with torch.no_grad():
        expected = stock(**_transformer_inputs(stock, padded)).sample
        seen_masks.clear()
        out = pipe.transformer(**_transformer_inputs(pipe.transformer, padded)).sample
    assert torch.equal(out, expected)
    assert len(seen_masks) == 2
    for mask in seen_masks:
        assert mask.dtype == torch.bool and mask.shape == (1, 1, 22, 22)
        assert torch.equal(mask[0, 0], padded[0, None, :] & padded[0, :, None])

    seen_masks.clear()
    with torch.no_grad():
        pipe.transformer(**_transformer_inputs(pipe.transformer, torch.ones(1, 22, dtype=torch.bool)))
    assert seen_masks == [None, None]


def test_ip_adapter_loaded_after_enable_is_reapplied_with_its_role():
    """Chroma shares FLUX.1's IP-adapter processor (``FluxIPAdapterMixin``): ``chroma.ip_adapter``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        embeds = torch.randn(1, 1, 8)
    call = {**SMALL, "ip_adapter_image_embeds": [embeds], "negative_ip_adapter_image_embeds": [embeds * 0]}
    stock = tiny_chroma_pipeline()
    load_tiny_flux_ip_adapter(stock.transformer)
    expected = stock(**call, generator=torch.Generator().manual_seed(0)).images

    pipe = omnify(tiny_chroma_pipeline(), "TORCH_SDPA")
    load_tiny_flux_ip_adapter(pipe.transformer)
    assert torch.equal(pipe(**call, generator=torch.Generator().manual_seed(0)).images, expected)
    assert {(e["role"], e["category"]) for e in pipe.omni_attention_report()} == {
        ("chroma.joint", "self"),
        ("chroma.single", "self"),
        ("chroma.ip_adapter", "cross"),
    }
