"""The deterministic switch: config and environment, enable-time refusal, run-to-run and training == inference."""

import pytest
import torch

from diffusers_omni import AttentionConfig, apply_attention
from diffusers_omni.alignment import AlignmentSide, check_alignment
from diffusers_omni.attention.backends.base import AttentionCall
from diffusers_omni.attention.platform import Platform, use_platform
from diffusers_omni.attention.selector import BackendNotSupportedError, deterministic_requested, resolve
from diffusers_omni.cli.info import collect_info
from diffusers_omni.testing import tiny_flux_components

from .helpers import pipeline_and_inputs

HOPPER = Platform("cuda", "simulated H200", (9, 0), 91900)


def test_config_field_parses_round_trips_and_validates():
    config = AttentionConfig.parse('{"default": "TORCH_SDPA", "deterministic": true}')
    assert config.deterministic is True
    assert AttentionConfig.parse(config.to_dict()) == config
    assert "deterministic" not in AttentionConfig.parse("TORCH_SDPA").to_dict()
    with pytest.raises(TypeError, match="deterministic must be True, False or None, got str"):
        AttentionConfig(deterministic="yes")


def test_environment_variable_and_config_precedence(monkeypatch):
    assert deterministic_requested(None) == (False, "")
    monkeypatch.setenv("DIFFUSERS_OMNI_DETERMINISTIC", "1")
    assert deterministic_requested(None) == (True, "env DIFFUSERS_OMNI_DETERMINISTIC")
    assert deterministic_requested({"deterministic": False}) == (False, "config")
    monkeypatch.setenv("DIFFUSERS_OMNI_DETERMINISTIC", "maybe")
    with pytest.raises(ValueError, match="DIFFUSERS_OMNI_DETERMINISTIC='maybe' is not a boolean"):
        deterministic_requested(None)


def test_explicit_backend_that_cannot_be_deterministic_is_refused_with_reasons():
    call = AttentionCall("cuda", torch.bfloat16, 128, deterministic=True)
    config = AttentionConfig.parse({"default": "CUDNN_ATTN", "deterministic": True})
    with use_platform(HOPPER), pytest.raises(BackendNotSupportedError) as info:
        resolve(config, "flux.joint", "self", call)
    message = str(info.value)
    assert "CUDNN_ATTN" in message and "deterministic mode is requested" in message and "TORCH_SDPA" in message


def test_platform_default_skips_non_deterministic_candidates():
    blackwell = Platform("cuda", "B200", (10, 0), 91000)
    call = AttentionCall("cuda", torch.bfloat16, 128)
    with use_platform(blackwell):
        assert resolve(None, "r", "self", call).backend == "CUDNN_ATTN"
        chosen = resolve(None, "r", "self", AttentionCall("cuda", torch.bfloat16, 128, deterministic=True))
    assert chosen.backend == "TORCH_SDPA"
    skipped = {c.backend: c.reasons for c in chosen.candidates}
    assert any("deterministic mode is requested" in r for r in skipped["CUDNN_ATTN"])


def test_enable_refuses_a_backend_without_deterministic_mode_and_leaves_the_model(test_backends):
    model = tiny_flux_components()["transformer"]
    processors = {name: m.processor for name, m in model.named_modules() if hasattr(m, "processor")}
    with pytest.raises(BackendNotSupportedError, match="PERTURBED_TEST|FORWARD_ONLY_TEST"):
        apply_attention(model, {"default": "FORWARD_ONLY_TEST", "deterministic": True})
    assert processors == {name: m.processor for name, m in model.named_modules() if hasattr(m, "processor")}


def test_deterministic_mode_is_in_the_fingerprint_and_info(monkeypatch):
    model = tiny_flux_components()["transformer"]
    apply_attention(model, {"default": "TORCH_SDPA", "deterministic": True})
    roles = {name: ra for m in model.modules() for name, ra in getattr(getattr(m, "processor", None), "attend", {}).items()}
    assert all(ra.backend.describe()["deterministic"] for ra in roles.values())
    info = {b["name"]: b for b in collect_info(HOPPER)["backends"]}
    assert info["TORCH_SDPA"]["deterministic"] is True and info["TORCH_SDPA"]["deterministic_reasons"] == []
    assert info["CUDNN_ATTN"]["deterministic"] is False and info["CUDNN_ATTN"]["deterministic_reasons"]
    monkeypatch.setenv("DIFFUSERS_OMNI_DETERMINISTIC", "on")
    assert collect_info()["deterministic_mode"]["enabled"] is True


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_deterministic_runs_are_bitwise_identical(name):
    pipe, inputs = pipeline_and_inputs(name)
    side = {"default": "TORCH_SDPA", "deterministic": True}
    report = check_alignment(pipe.transformer, inputs, side, side)
    assert report.bitwise_equal and report.fingerprints.matches


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", ["flux", "wan"])
def test_training_mode_forward_equals_inference_forward_bitwise(name, deterministic):
    pipe, inputs = pipeline_and_inputs(name)
    config = {"default": "TORCH_SDPA", "deterministic": deterministic}
    report = check_alignment(
        pipe.transformer, inputs, AlignmentSide(config, mode="training"), AlignmentSide(config, mode="inference")
    )
    assert report.bitwise_equal, report.table()
    assert not pipe.transformer.training  # the training-mode run restores eval()
