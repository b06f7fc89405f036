"""``per_role`` keys are matched against the model's roles and categories at enable time (issue 13, item 6): a key
that would be ignored is refused with "did you mean", and nothing changes."""

import logging

import pytest
import torch
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

from diffusers_omni import apply_attention, omnify
from diffusers_omni.attention.processors import is_omni_processor
from diffusers_omni.cli.explain import explain_pipeline
from diffusers_omni.testing import (
    tiny_flux_components,
    tiny_flux_inputs,
    tiny_flux_pipeline,
    tiny_wan_components,
    tiny_wan_pipeline,
)
from diffusers_omni.testing.tiny_flux2 import tiny_flux2_klein_components

from diffusers_omni.pipelines.wan import OmniWanPipeline


def processors(model):
    return {name: m.processor for name, m in model.named_modules() if hasattr(m, "processor")}


@pytest.mark.parametrize(
    "key, fragments",
    [
        ("flux.jiont", ["'flux.jiont' (did you mean 'flux.joint'?)"]),
        ("crosss", ["'crosss' (did you mean 'cross'?)"]),
        ("Self", ["'Self' (did you mean 'self'?)"]),
        ("wan.cross", ["'wan.cross'"]),
        ("zzz", ["'zzz' match no"]),
    ],
)
def test_a_key_that_matches_no_role_or_category_is_refused_and_nothing_changes(key, fragments):
    pipe = omnify(tiny_flux_pipeline(), enable_attention=False)
    before = processors(pipe.transformer)
    with pytest.raises(ValueError) as info:
        pipe.enable_omni_attention({"default": "TORCH_SDPA", "per_role": {key: "auto"}})
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    # The message lists what the model has.
    assert "roles: flux.ip_adapter, flux.joint, flux.single; categories: cross, self" in message
    assert "FluxTransformer2DModel" in message
    assert all(processors(pipe.transformer)[n] is p for n, p in before.items())
    assert pipe.omni_attention_report() == []


def test_cross_on_a_model_without_cross_attention_is_refused():
    model = tiny_flux2_klein_components()["transformer"]
    with pytest.raises(ValueError, match=r"'cross' match no attention role or category of Flux2Transformer2DModel"):
        apply_attention(model, {"per_role": {"cross": "TORCH_SDPA"}})
    assert not any(is_omni_processor(p) for p in processors(model).values())


def test_a_declared_role_absent_from_the_model_is_accepted_with_a_warning(caplog):
    # FLUX's only cross role is its IP-Adapter attention: "cross" serves it once an IP-Adapter is loaded.
    pipe = omnify(tiny_flux_pipeline(), enable_attention=False)
    with caplog.at_level(logging.WARNING, logger="diffusers_omni.attention"):
        report = pipe.enable_omni_attention({"default": "TORCH_SDPA", "per_role": {"cross": "auto"}})
    assert {entry["source"] for entry in report} == {"default"}
    assert "per_role['cross'] matches no attention call FluxTransformer2DModel makes now" in caplog.text
    assert "flux.ip_adapter" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="diffusers_omni.attention"):
        pipe.enable_omni_attention({"default": "TORCH_SDPA", "per_role": {"cross": "auto"}})
    assert "per_role['cross']" not in caplog.text  # once per key and model


def test_a_reapply_after_diffusers_swaps_processors_does_not_recheck_keys():
    model = tiny_flux_components()["transformer"].eval()
    apply_attention(model, {"default": "TORCH_SDPA", "per_role": {"flux.ip_adapter": "auto"}})
    model.set_attn_processor(FluxAttnProcessor())
    with torch.no_grad():
        model(**tiny_flux_inputs())
    assert all(is_omni_processor(p) for p in processors(model).values())


def test_keys_are_checked_against_all_dits_of_a_pipeline():
    components = tiny_wan_components(seed=0)
    pipe = OmniWanPipeline(**{**components, "transformer_2": tiny_wan_components(seed=1)["transformer"]},
                           boundary_ratio=0.5)
    report = pipe.enable_omni_attention({"default": "TORCH_SDPA", "per_role": {"wan.cross": "auto", "self": "auto"}})
    assert {e["module"].split(".")[0] for e in report} == {"transformer", "transformer_2"}
    with pytest.raises(ValueError, match=r"'wan.crosss' \(did you mean 'wan.cross'"):
        pipe.enable_omni_attention({"per_role": {"wan.crosss": "auto"}})
    assert pipe.omni_attention_report() == report  # the previous install is untouched


def test_explain_refuses_an_unknown_key_too():
    with pytest.raises(ValueError, match=r"'wan.slef' \(did you mean 'wan.self'\?\)"):
        explain_pipeline(tiny_wan_pipeline(), {"per_role": {"wan.slef": "TORCH_SDPA"}})
    rows = explain_pipeline(tiny_wan_pipeline(), {"per_role": {"wan.self": "TORCH_SDPA"}})
    assert {r["source"] for r in rows if r["role"] == "wan.self"} == {"per_role['wan.self']"}
