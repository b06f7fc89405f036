"""SoulX-Singer: the flow-matching estimator ``DiffLlama`` at ``cfm_decoder.model.diff_estimator``, one
bidirectional self-attention call per layer, run twice a step (conditional and unconditional passes)."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor2_0

from diffusers_omni import omnify
from diffusers_omni.pipelines.soulx_singer import OmniSoulXSingerPipeline, OmniSoulXSingerSVCPipeline
from diffusers_omni.testing.tiny_soulx_singer import (
    tiny_soulx_singer_inputs,
    tiny_soulx_singer_pipeline,
    tiny_soulx_singer_svc_inputs,
    tiny_soulx_singer_svc_pipeline,
)

from .harness import ModelCase, standard_tests

DIT = "cfm_decoder.model.diff_estimator"
ROLES = {"soulx_singer.self": "self"}


def _svs(pipeline_cls=None):
    return (pipeline_cls.from_pipe(tiny_soulx_singer_pipeline()) if pipeline_cls else tiny_soulx_singer_pipeline())


def _svc(pipeline_cls=None):
    return (pipeline_cls.from_pipe(tiny_soulx_singer_svc_pipeline()) if pipeline_cls
            else tiny_soulx_singer_svc_pipeline())


CASES = [
    ModelCase("soulx_singer_svs", _svs, OmniSoulXSingerPipeline,
              {**tiny_soulx_singer_inputs(), "num_inference_steps": 2, "output_type": "mel"}, ROLES, dits=(DIT,)),
    ModelCase("soulx_singer_score", _svs, OmniSoulXSingerPipeline,
              {**tiny_soulx_singer_inputs("score"), "num_inference_steps": 2, "output_type": "mel",
               "guidance_scale": 0.0}, ROLES, dits=(DIT,)),
    ModelCase("soulx_singer_svc", _svc, OmniSoulXSingerSVCPipeline,
              {**tiny_soulx_singer_svc_inputs(), "num_inference_steps": 2, "output_type": "mel"}, ROLES, dits=(DIT,)),
]

globals().update(standard_tests(CASES))


def test_both_guidance_passes_reach_the_role_without_a_mask(monkeypatch):
    from diffusers_omni.attention.backends.sdpa import backend as sdpa

    pipe = omnify(tiny_soulx_singer_pipeline(), "TORCH_SDPA")
    calls = []
    real = sdpa.sdpa_bshd

    def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        calls.append((query.shape[1], key.shape[1], attn_mask, is_causal))
        return real(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    monkeypatch.setattr(sdpa, "sdpa_bshd", spy)
    CASES[0].run(pipe)
    # 2 steps x (conditional over prompt + target = 18 frames, unconditional over the target's 10) x 2 layers.
    assert [(q, k) for q, k, _, _ in calls] == [(18, 18)] * 2 + [(10, 10)] * 2 + [(18, 18)] * 2 + [(10, 10)] * 2
    assert all(mask is None and not causal for _, _, mask, causal in calls)


def test_a_frame_mask_reaches_the_backend_as_one_tensor(monkeypatch):
    from diffusers_omni.attention.backends.sdpa import backend as sdpa

    pipe = omnify(tiny_soulx_singer_pipeline(), "TORCH_SDPA")
    estimator = pipe.cfm_decoder.model.diff_estimator
    masks = []
    real = sdpa.sdpa_bshd

    def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        masks.append(attn_mask)
        return real(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    monkeypatch.setattr(sdpa, "sdpa_bshd", spy)
    x, cond, t = torch.randn(1, 6, 16), torch.randn(1, 6, 32), torch.tensor([0.5])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    with torch.no_grad():
        routed = estimator(x, t, cond, mask)
    assert len(masks) == 2 and masks[0] is masks[1] and masks[0].dtype == torch.bool
    pipe.disable_omni_attention()
    with torch.no_grad():
        assert torch.equal(estimator(x, t, cond, mask), routed)


def test_an_unknown_processor_swapped_in_raises_naming_the_module():
    pipe = omnify(tiny_soulx_singer_pipeline(), "TORCH_SDPA")
    pipe.cfm_decoder.model.diff_estimator.layers[1].self_attn.set_processor(AttnProcessor2_0())
    with pytest.raises(TypeError, match=r"layers\.1\.self_attn.*AttnProcessor2_0"):
        CASES[0].run(pipe)


def test_components_and_block_attributes_are_declared():
    pipe = omnify(tiny_soulx_singer_svc_pipeline(), "TORCH_SDPA")
    assert set(pipe.omni_dits()) == {DIT}
    assert pipe._encoder_modules == ("whisper_encoder", "condition_encoder", "mel")
    assert pipe._vae_modules == ("vocoder",) and pipe._resident_modules == ("cfm_decoder.model.cond_emb",)
    assert pipe.cfm_decoder.model.diff_estimator._layerwise_offload_blocks_attrs == ("layers",)


def test_omni_save_pretrained_names_the_architecture_class_and_loads_back(tmp_path):
    import json

    pipe = omnify(tiny_soulx_singer_pipeline(), "TORCH_SDPA")
    pipe.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "model_index.json").read_text())["_class_name"] == "SoulXSingerPipeline"
    loaded = OmniSoulXSingerPipeline.from_pretrained(tmp_path)
    assert type(loaded) is OmniSoulXSingerPipeline
    assert torch.equal(CASES[0].run(loaded), CASES[0].run(pipe))
