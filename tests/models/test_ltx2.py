"""LTX-2: audio-video transformer and text connectors, masked text cross-attention, perturbed attention."""

from __future__ import annotations

import pytest
import torch
from diffusers.pipelines.ltx2 import LTX2VideoCondition
from diffusers.models.transformers.transformer_ltx2 import LTX2PerturbedAttnProcessor
from PIL import Image

from diffusers_omni import omnify
from diffusers_omni.attention.backends.base import AttentionBackend
from diffusers_omni.attention.processors import is_omni_processor
from diffusers_omni.attention.registry import register_backend, reset_backend
from diffusers_omni.attention.selector import BackendNotSupportedError
from diffusers_omni.pipelines.ltx2 import OmniLTX2ConditionPipeline, OmniLTX2ImageToVideoPipeline, OmniLTX2Pipeline
from diffusers_omni.testing.tiny_ltx2 import (
    tiny_ltx23_pipeline,
    tiny_ltx2_condition_pipeline,
    tiny_ltx2_i2v_pipeline,
    tiny_ltx2_pipeline,
)

from .harness import ModelCase, standard_tests

ROLES = {
    "ltx2.video_self": "self",
    "ltx2.audio_self": "self",
    "ltx2.video_text": "cross",
    "ltx2.audio_text": "cross",
    "ltx2.audio_to_video": "cross",
    "ltx2.video_to_audio": "cross",
    "ltx2.video_connector": "self",
    "ltx2.audio_connector": "self",
}
MASKED = ("ltx2.video_text", "ltx2.audio_text", "ltx2.video_connector", "ltx2.audio_connector")
CALL = {
    "prompt": "a robot dancing",
    "height": 32,
    "width": 32,
    "num_frames": 5,
    "frame_rate": 25.0,
    "max_sequence_length": 16,
    "num_inference_steps": 2,
    "guidance_scale": 1.0,
    "output_type": "latent",
}
IMAGE = Image.new("RGB", (32, 32), (120, 60, 30))
DITS = ("transformer", "connectors")


def _video_and_audio(output) -> torch.Tensor:
    return torch.cat([output.frames.flatten(), output.audio.flatten()])


def _case(id, factory, omni_cls, call):
    return ModelCase(id, factory, omni_cls, call, ROLES, dits=DITS, output=_video_and_audio)


CASES = [
    _case("ltx2", tiny_ltx2_pipeline, OmniLTX2Pipeline, CALL),
    _case("ltx2_i2v", tiny_ltx2_i2v_pipeline, OmniLTX2ImageToVideoPipeline, {**CALL, "image": IMAGE, "image_crf": 0}),
    _case(
        "ltx2_condition",
        tiny_ltx2_condition_pipeline,
        OmniLTX2ConditionPipeline,
        {**CALL, "conditions": [LTX2VideoCondition(frames=IMAGE, index=0, crf=0)]},
    ),
    # LTX-2.3 style: perturbed-attention processors, per-head gates, spatio-temporal guidance on block 1.
    _case(
        "ltx23_stg",
        tiny_ltx23_pipeline,
        OmniLTX2Pipeline,
        {**CALL, "spatio_temporal_guidance_blocks": [1], "stg_scale": 1.0},
    ),
]

# Every check on text-to-video (2.0 and 2.3 style); the conditioned pipelines share the transformer and the
# connectors, so they run the parity check only (keeps this module fast on 2 CPU cores).
globals().update(standard_tests([CASES[0], CASES[3]]))
test_conditioned_pipelines_torch_sdpa_bitwise_equal_to_stock_diffusers = standard_tests(CASES[1:3])[
    "test_torch_sdpa_bitwise_equal_to_stock_diffusers"
]


def test_ltx23_uses_the_perturbed_processor():
    pipe = omnify(tiny_ltx23_pipeline(), "TORCH_SDPA")
    originals = [p.original for p in pipe.transformer.attn_processors.values()]
    assert originals and all(type(p) is LTX2PerturbedAttnProcessor for p in originals)


class _NoMaskBackend(AttentionBackend):
    name = "LTX2_NOMASK_TEST"
    devices = frozenset({"cpu"})
    supports_mask = False

    def __call__(self, query, key, value, attn_mask=None, *args):
        return query


@pytest.fixture
def no_mask_backend():
    register_backend(_NoMaskBackend.name, _NoMaskBackend)
    yield _NoMaskBackend.name
    reset_backend(_NoMaskBackend.name)


@pytest.mark.parametrize("role", MASKED)
def test_maskless_backend_on_a_masked_role_raises_at_enable_time(no_mask_backend, role):
    pipe = omnify(tiny_ltx2_pipeline(), enable_attention=False)
    with pytest.raises(BackendNotSupportedError, match=role.replace(".", r"\.")):
        pipe.enable_omni_attention({"default": "TORCH_SDPA", "per_role": {role: no_mask_backend}})
    assert pipe.omni_attention_report() == []


def test_maskless_backend_on_unmasked_roles_runs(no_mask_backend):
    pipe = omnify(tiny_ltx2_pipeline(), enable_attention=False)
    unmasked = sorted(set(ROLES) - set(MASKED))
    report = pipe.enable_omni_attention({"default": "TORCH_SDPA", "per_role": {r: no_mask_backend for r in unmasked}})
    assert {e["role"] for e in report if e["backend"] == no_mask_backend} == set(unmasked)
    CASES[0].run(pipe)  # none of these calls carries a mask


def test_prompt_padding_bias_reaches_the_backend(monkeypatch):
    from diffusers_omni.attention.backends.sdpa import backend as sdpa

    pipe = omnify(tiny_ltx2_pipeline(), "TORCH_SDPA")
    seen = []
    real = sdpa.sdpa_bshd

    def spy(query, key, value, attn_mask=None, *args):
        seen.append((tuple(query.shape), attn_mask))
        return real(query, key, value, attn_mask, *args)

    monkeypatch.setattr(sdpa, "sdpa_bshd", spy)
    pipe(**{**CALL, "prompt": "a cat"})
    masks = {shape: mask for shape, mask in seen if mask is not None}
    assert masks and all(mask.is_floating_point() and mask.ndim == 4 for mask in masks.values())
    # Connectors (4 heads of 4, 16 text tokens): the additive padding bias (-finfo.max on padded keys) arrives intact.
    connector = [mask for shape, mask in seen if shape[1:] == (16, 4, 4)]
    assert connector and all(mask.shape[1:] == (4, 1, 16) and bool((mask < -1e30).any()) for mask in connector)
    # Video→text and audio→text: a [B, H, 1, 16] bias reaches the backend on every block. Diffusers 0.42 binarises
    # the connectors' additive mask with ``< 1e-6``, which every entry passes, so this bias is all zeros; a float
    # mask is never dropped, only all-True boolean ones are.
    text = [mask for shape, mask in seen if mask is not None and shape[1] in (768, 5) and mask.shape[-1] == 16]
    assert len(text) == 2 * 2 * 6 and all(mask.shape[1:] == (2, 1, 16) for mask in text)


def test_restored_stock_processors_are_replaced_again_before_the_next_call():
    expected = CASES[0].run(tiny_ltx2_pipeline())
    pipe = omnify(tiny_ltx2_pipeline(), "TORCH_SDPA")
    for dit in DITS:
        model = getattr(pipe, dit)
        for name, module in model.named_modules():
            if is_omni_processor(getattr(module, "processor", None)):
                module.set_processor(module.processor.original)
    assert torch.equal(CASES[0].run(pipe), expected)
    for dit in DITS:
        modules = [m for m in getattr(pipe, dit).modules() if hasattr(m, "set_processor")]
        assert modules and all(is_omni_processor(m.processor) for m in modules)


def test_an_unknown_processor_swapped_in_raises_naming_the_module():
    from diffusers.models.attention_processor import AttnProcessor2_0

    pipe = omnify(tiny_ltx2_pipeline(), "TORCH_SDPA")
    pipe.transformer.transformer_blocks[1].audio_to_video_attn.set_processor(AttnProcessor2_0())
    with pytest.raises(TypeError, match=r"transformer_blocks\.1\.audio_to_video_attn.*AttnProcessor2_0"):
        CASES[0].run(pipe)
