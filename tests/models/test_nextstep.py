"""NextStep-1.1: one causal grouped-query attention call per decoder layer, prefill then one token per step."""

from __future__ import annotations

import pytest
import torch

from diffusers_omni import omnify
from diffusers_omni.pipelines.nextstep import OmniNextStep11Pipeline
from diffusers_omni.testing.tiny_nextstep import tiny_nextstep_pipeline

from .harness import ModelCase, standard_tests

ROLES = {"nextstep.causal": "self"}
CALL = {
    "prompt": "a red cat",
    "negative_prompt": "blurry",
    "height": 16,
    "width": 16,
    "num_inference_steps": 2,
    "guidance_scale": 3.0,
    "use_norm": True,
    "output_type": "latent",
}


def _factory(seed: int = 0, pipeline_cls=None):
    pipe = tiny_nextstep_pipeline(seed, pipeline_cls=pipeline_cls)
    pipe.set_progress_bar_config(disable=True)
    return pipe


CASE = ModelCase("nextstep", _factory, OmniNextStep11Pipeline, CALL, ROLES, dits=("model",))

_tests = standard_tests([CASE])
# Model-level offload is refused for this pipeline (test below); layerwise parity is checked on its own.
_tests.pop("test_offload_strategies_keep_bitwise_parity")
globals().update(_tests)


def test_layerwise_offload_keeps_bitwise_parity():
    expected = CASE.run(_factory())
    pipe = omnify(_factory(), "TORCH_SDPA")
    pipe.enable_layerwise_offload(device="cpu")
    assert torch.equal(CASE.run(pipe), expected)
    assert torch.equal(CASE.run(pipe), expected)
    pipe.disable_omni_offload()


def test_model_level_offload_is_refused_with_the_reason():
    pipe = omnify(_factory(), "TORCH_SDPA")
    with pytest.raises(ValueError, match="does not support model-level offload.*layerwise"):
        pipe.enable_model_level_offload(device="cpu")
    # Nothing was enabled: layerwise still works afterwards.
    pipe.enable_layerwise_offload(device="cpu")
    pipe.disable_omni_offload()


def test_masks_and_causality_reach_the_backend(monkeypatch):
    from diffusers_omni.attention.backends.sdpa import backend as sdpa

    pipe = omnify(_factory(), "TORCH_SDPA")
    calls = []
    real = sdpa.sdpa_bshd

    def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        calls.append((query.shape, key.shape, None if attn_mask is None else attn_mask.shape, is_causal, enable_gqa))
        return real(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    monkeypatch.setattr(sdpa, "sdpa_bshd", spy)
    CASE.run(pipe)
    # Guidance pads the negative prompt: every call is masked; 2 layers x (prefill + 15 steps).
    assert len(calls) == 2 * 16
    prefill = calls[0]
    assert prefill[0][1] == prefill[1][1] > 1 and prefill[2] == (2, 1, prefill[0][1], prefill[1][1])
    for q, k, mask, is_causal, gqa in calls[2:]:
        assert q[1] == 1 and mask == (2, 1, 1, k[1]) and not is_causal and gqa
        assert (q[2], k[2]) == (4, 2)

    calls.clear()
    pipe(**{**CALL, "guidance_scale": 1.0}, generator=torch.Generator().manual_seed(0))
    assert calls[0][3] and calls[0][2] is None  # unpadded prefill: causal, no mask
    assert all(mask is None and not causal for _, _, mask, causal, _ in calls[2:])
