"""HunyuanVideo-1.5: standard family checks plus its always-masked attention and the legacy token refiner."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.attention_processor import XFormersAttnProcessor
from PIL import Image

from diffusers_omni import omnify
from diffusers_omni.attention.backends.base import AttentionBackend
from diffusers_omni.attention.processors import is_omni_processor
from diffusers_omni.attention.registry import register_backend, reset_backend
from diffusers_omni.attention.selector import BackendNotSupportedError
from diffusers_omni.pipelines.hunyuanvideo15 import (
    OmniHunyuanVideo15ImageToVideoPipeline,
    OmniHunyuanVideo15Pipeline,
)
from diffusers_omni.testing.tiny_hunyuanvideo15 import tiny_hunyuanvideo15_i2v_pipeline, tiny_hunyuanvideo15_pipeline

from .harness import ModelCase, standard_tests

ROLES = {"hunyuanvideo15.joint": "self", "hunyuanvideo15.token_refiner": "self"}
T2V_CALL = {
    "prompt": 'a sign that says "hi"',
    "height": 16,
    "width": 16,
    "num_frames": 5,
    "num_inference_steps": 2,
    "output_type": "latent",
}
I2V_CALL = {**{k: v for k, v in T2V_CALL.items() if k not in ("height", "width")}, "image": Image.new("RGB", (16, 16), (120, 60, 30))}

CASES = [
    ModelCase("hunyuanvideo15", tiny_hunyuanvideo15_pipeline, OmniHunyuanVideo15Pipeline, T2V_CALL, ROLES),
    ModelCase("hunyuanvideo15_i2v", tiny_hunyuanvideo15_i2v_pipeline, OmniHunyuanVideo15ImageToVideoPipeline, I2V_CALL, ROLES),
]

globals().update(standard_tests(CASES))

CASE = CASES[0]


class _NoMaskBackend(AttentionBackend):
    name = "HY15_NOMASK_TEST"
    devices = frozenset({"cpu"})
    supports_mask = False

    def __call__(self, query, key, value, attn_mask=None, *args):
        return query


@pytest.fixture
def no_mask_backend():
    register_backend(_NoMaskBackend.name, _NoMaskBackend)
    yield _NoMaskBackend.name
    reset_backend(_NoMaskBackend.name)


@pytest.mark.parametrize("role", sorted(ROLES))
def test_maskless_backend_on_a_masked_role_raises_at_enable_time(no_mask_backend, role):
    pipe = omnify(tiny_hunyuanvideo15_pipeline(), enable_attention=False)
    with pytest.raises(BackendNotSupportedError, match=role.replace(".", r"\.")):
        pipe.enable_omni_attention({"default": "TORCH_SDPA", "per_role": {role: no_mask_backend}})
    assert pipe.omni_attention_report() == []
    assert not any(is_omni_processor(p) for p in pipe.transformer.attn_processors.values())


def _transformer_inputs(text_mask: torch.Tensor, glyph_mask: torch.Tensor) -> dict:
    generator = torch.Generator().manual_seed(0)
    batch = text_mask.shape[0]
    return {
        "hidden_states": torch.randn(batch, 9, 2, 4, 4, generator=generator),
        "timestep": torch.tensor([500.0] * batch),
        "encoder_hidden_states": torch.randn(batch, text_mask.shape[1], 16, generator=generator),
        "encoder_attention_mask": text_mask,
        "encoder_hidden_states_2": torch.randn(batch, glyph_mask.shape[1], 16, generator=generator),
        "encoder_attention_mask_2": glyph_mask,
        # Non-zero image embeddings: the image tokens are valid (all-zero ones mark text-to-video and are masked).
        "image_embeds": torch.randn(batch, 3, 12, generator=generator),
    }


def _spy_masks(monkeypatch) -> list:
    from diffusers_omni.attention.backends.sdpa import backend as sdpa

    seen = []
    real = sdpa.sdpa_bshd

    def spy(query, key, value, attn_mask=None, *args):
        seen.append(attn_mask)
        return real(query, key, value, attn_mask, *args)

    monkeypatch.setattr(sdpa, "sdpa_bshd", spy)
    return seen


def test_padding_masks_reach_the_backend_and_all_true_masks_are_dropped(monkeypatch):
    transformer = omnify(tiny_hunyuanvideo15_pipeline(), "TORCH_SDPA").transformer
    seen = _spy_masks(monkeypatch)
    full_text, full_glyph = torch.ones(2, 6, dtype=torch.long), torch.ones(2, 5, dtype=torch.long)
    with torch.no_grad():
        transformer(**_transformer_inputs(full_text, full_glyph))
    # One refiner block, two dual-stream blocks; no padding anywhere: every dense mask is all-True and dropped.
    assert seen == [None, None, None]

    text, glyph = full_text.clone(), full_glyph.clone()
    text[0, 4:] = 0
    glyph[1, 2:] = 0
    seen.clear()
    with torch.no_grad():
        transformer(**_transformer_inputs(text, glyph))
    assert len(seen) == 3 and all(mask is not None and mask.dtype == torch.bool for mask in seen)
    refiner_mask, joint_mask = seen[0], seen[1]
    assert refiner_mask.shape == (2, 2, 6, 6)  # [B, H, S, S], as Diffusers' AttnProcessor2_0 prepares it
    assert torch.equal(refiner_mask[0, 0, 0], text[0].bool())
    video_len, text_len = 2 * 4 * 4, 3 + 5 + 6
    assert joint_mask.shape == (2, 1, video_len + text_len, video_len + text_len)
    # Valid tokens first, then padding: row 0 of sample 0 sees the video, 3 image, 5 glyph and 4 prompt tokens.
    assert int(joint_mask[0, 0, 0].sum()) == video_len + 3 + 5 + 4
    assert int(joint_mask[1, 0, 0].sum()) == video_len + 3 + 2 + 6
    # Both dual-stream blocks get the very same dense mask: built once per key-padding mask, not once per layer.
    assert seen[2] is joint_mask


def test_restored_stock_processors_are_replaced_again_before_the_next_call():
    expected = CASE.run(tiny_hunyuanvideo15_pipeline())
    pipe = omnify(tiny_hunyuanvideo15_pipeline(), "TORCH_SDPA")
    report = pipe.omni_attention_report()
    # What Diffusers itself does with ``set_attn_processor``: put stock processors back on every module.
    originals = {f"{name}.processor": p.original for name, p in pipe.transformer.attn_processors.items()}
    pipe.transformer.set_attn_processor({name.replace(".processor", "") + ".processor": p for name, p in originals.items()})
    assert not any(is_omni_processor(p) for p in pipe.transformer.attn_processors.values())
    assert torch.equal(CASE.run(pipe), expected)
    assert all(is_omni_processor(p) for p in pipe.transformer.attn_processors.values())
    assert pipe.omni_attention_report() == report


def test_an_unknown_processor_swapped_in_raises_naming_the_module():
    pipe = omnify(tiny_hunyuanvideo15_pipeline(), "TORCH_SDPA")
    pipe.transformer.context_embedder.token_refiner.refiner_blocks[0].attn.set_processor(XFormersAttnProcessor())
    with pytest.raises(TypeError, match=r"context_embedder\.token_refiner\.refiner_blocks\.0\.attn.*XFormersAttnProcessor\b"):
        CASE.run(pipe)
