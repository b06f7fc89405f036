"""Cosmos3: one packed transformer, a causal understanding call and a full generation call per layer, GQA."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor2_0

from diffusers_omni import omnify
from diffusers_omni.attention.processors import is_omni_processor
from diffusers_omni.pipelines.cosmos3 import OmniCosmos3OmniPipeline
from diffusers_omni.utils.modules import get_submodule_path
from diffusers_omni.testing.tiny_cosmos3 import tiny_cosmos3_pipeline

from .harness import ModelCase, standard_tests

ROLES = {"cosmos3.understanding": "self", "cosmos3.generation": "self"}
CALL = {
    "prompt": "a dog",
    "height": 16,
    "width": 16,
    "num_frames": 5,
    "num_inference_steps": 2,
    "guidance_scale": 1.0,
    "use_system_prompt": False,
    "add_resolution_template": False,
    "add_duration_template": False,
    "output_type": "latent",
}
CASE = ModelCase("cosmos3", tiny_cosmos3_pipeline, OmniCosmos3OmniPipeline, CALL, ROLES, output=lambda out: out.video)

globals().update(standard_tests([CASE]))


def test_causal_and_gqa_flags_reach_the_backend_per_role(monkeypatch):
    from diffusers_omni.attention.backends.sdpa import backend as sdpa

    pipe = omnify(tiny_cosmos3_pipeline(), "TORCH_SDPA")
    calls = []
    real = sdpa.sdpa_bshd

    def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        calls.append((query.shape, key.shape, attn_mask, is_causal, enable_gqa))
        return real(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    monkeypatch.setattr(sdpa, "sdpa_bshd", spy)
    CASE.run(pipe)
    assert calls and len(calls) % 2 == 0
    understanding, generation = calls[0::2], calls[1::2]
    for q, k, mask, is_causal, gqa in understanding:
        assert is_causal and gqa and mask is None and q[1] == k[1]  # self, causal
        assert (q[2], k[2]) == (2, 1)  # two query heads share one key/value head
    for q, k, mask, is_causal, gqa in generation:
        assert not is_causal and gqa and mask is None and k[1] > q[1]  # keys: understanding + generation tokens
        assert (q[2], k[2]) == (2, 1)


def test_split_model_components_resolve():
    pipe = omnify(tiny_cosmos3_pipeline(), "TORCH_SDPA")
    assert set(pipe.omni_dits()) == {"transformer"}
    assert pipe._encoder_modules == ()
    assert get_submodule_path(pipe, "vae") is pipe.vae
    assert get_submodule_path(pipe, "transformer.embed_tokens") is pipe.transformer.embed_tokens


def test_restored_stock_processors_are_replaced_again_before_the_next_call():
    expected = CASE.run(tiny_cosmos3_pipeline())
    pipe = omnify(tiny_cosmos3_pipeline(), "TORCH_SDPA")
    pipe.transformer.set_attn_processor({k: p.original for k, p in pipe.transformer.attn_processors.items()})
    assert not any(is_omni_processor(p) for p in pipe.transformer.attn_processors.values())
    assert torch.equal(CASE.run(pipe), expected)
    assert all(is_omni_processor(p) for p in pipe.transformer.attn_processors.values())


def test_an_unknown_processor_swapped_in_raises_naming_the_module():
    pipe = omnify(tiny_cosmos3_pipeline(), "TORCH_SDPA")
    pipe.transformer.layers[1].self_attn.set_processor(AttnProcessor2_0())
    with pytest.raises(TypeError, match=r"layers\.1\.self_attn.*AttnProcessor2_0"):
        CASE.run(pipe)
