"""DIFFUSERS_ATTN_BACKEND (Diffusers' own variable, Diffusers' names) is the default when DIFFUSION_ATTENTION_BACKEND
(ours) is unset; ours wins when both are set; a value either cannot take is one ValueError line."""

import pytest
import torch

from diffusers_omni import AttentionConfig
from diffusers_omni.attention.backends.base import AttentionCall
from diffusers_omni.attention.platform import Platform
from diffusers_omni.attention.selector import ENV_BACKEND, ENV_DIFFUSERS_BACKEND, environment_backend, resolve

CPU = Platform(device_type="cpu", device_name="CPU")
CALL = AttentionCall(device_type="cpu", dtype=torch.float32, head_dim=64)
SOURCE = f"environment variable {ENV_DIFFUSERS_BACKEND}"


@pytest.fixture(autouse=True)
def _no_diffusers_variable(monkeypatch):
    monkeypatch.delenv(ENV_DIFFUSERS_BACKEND, raising=False)


@pytest.mark.parametrize("value, ours", [("native", "TORCH_SDPA"), ("_native_cudnn", "CUDNN_ATTN"),
                                         ("flash", "FLASH_ATTN"), ("_flash_3", "FLASH_ATTN"), ("sage", "SAGE_ATTN")])
def test_diffusers_variable_is_the_default_in_our_names(monkeypatch, value, ours):
    monkeypatch.setenv(ENV_DIFFUSERS_BACKEND, value)
    spec, source = environment_backend()
    assert (spec.backend, source) == (ours, SOURCE)


def test_diffusers_variable_decides_a_role_and_explain_shows_it(monkeypatch):
    assert resolve(None, "wan.self", "self", CALL, CPU).source == "platform default (CPU)"
    monkeypatch.setenv(ENV_DIFFUSERS_BACKEND, "native")
    resolution = resolve(None, "wan.self", "self", CALL, CPU)
    assert (resolution.backend, resolution.source) == ("TORCH_SDPA", SOURCE)
    assert resolution.spec is not None  # an explicit choice, validated as one, not the platform default
    # A config default still outranks every environment variable.
    assert resolve(AttentionConfig.parse("TORCH_SDPA"), "wan.self", "self", CALL, CPU).source == "default"


def test_ours_wins_when_both_are_set(monkeypatch):
    monkeypatch.setenv(ENV_DIFFUSERS_BACKEND, "_native_cudnn")
    monkeypatch.setenv(ENV_BACKEND, "TORCH_SDPA")
    assert resolve(None, "wan.self", "self", CALL, CPU).source == f"env {ENV_BACKEND}"
    # A Diffusers name with no equivalent here is fine while ours decides: it only matters to Diffusers then.
    monkeypatch.setenv(ENV_DIFFUSERS_BACKEND, "flex")
    assert environment_backend()[1] == f"env {ENV_BACKEND}"


@pytest.mark.parametrize("value, hint", [("bogus", ""), ("NATIVE", " (did you mean 'native'?)"),
                                         ("TORCH_SDPA", ""), ("", ""), ("native ", " (did you mean 'native'?)")])
def test_a_value_diffusers_refuses_is_one_line_naming_variable_value_and_names(monkeypatch, value, hint):
    monkeypatch.setenv(ENV_DIFFUSERS_BACKEND, value)
    with pytest.raises(ValueError) as info:
        resolve(None, "wan.self", "self", CALL, CPU)
    message = str(info.value)
    assert message.startswith(f"environment variable {ENV_DIFFUSERS_BACKEND}={value!r} is not one of Diffusers' "
                              f"attention backend names{hint}; allowed: native, _native_cudnn, ")
    assert "\n" not in message and "_flash_3" in message
    # Refused even when ours decides: Diffusers raises on it at import either way.
    monkeypatch.setenv(ENV_BACKEND, "TORCH_SDPA")
    with pytest.raises(ValueError, match=ENV_DIFFUSERS_BACKEND):
        environment_backend()


def test_the_names_refused_are_exactly_the_ones_diffusers_refuses():
    from diffusers.models.attention_dispatch import AttentionBackendName

    from diffusers_omni.attention.registry import check_diffusers_env_name

    for member in AttentionBackendName:
        assert check_diffusers_env_name(member.value, ENV_DIFFUSERS_BACKEND).diffusers == member.value
    for value in ("NATIVE", "", " flash", "TORCH_SDPA"):
        with pytest.raises(ValueError):
            AttentionBackendName(value)
        with pytest.raises(ValueError):
            check_diffusers_env_name(value, ENV_DIFFUSERS_BACKEND)


@pytest.mark.parametrize("value", ["flex", "xformers", "_native_math"])
def test_a_diffusers_name_without_an_equivalent_says_how_to_override(monkeypatch, value):
    monkeypatch.setenv(ENV_DIFFUSERS_BACKEND, value)
    with pytest.raises(ValueError) as info:
        resolve(None, "wan.self", "self", CALL, CPU)
    message = str(info.value)
    assert message.startswith(f"environment variable {ENV_DIFFUSERS_BACKEND}={value!r} is a Diffusers attention "
                              "backend with no equivalent here (")
    assert f"set {ENV_BACKEND} (it takes precedence) to one of TORCH_SDPA, " in message and "\n" not in message


def test_unknown_value_of_ours_is_one_line(monkeypatch):
    monkeypatch.setenv(ENV_BACKEND, "FAST_ATTN")
    with pytest.raises(ValueError) as info:
        environment_backend()
    assert str(info.value).startswith(f"environment variable {ENV_BACKEND}='FAST_ATTN' is not a known attention "
                                      "backend")
    assert "TORCH_SDPA" in str(info.value) and "\n" not in str(info.value)


def test_the_mapping_is_logged_once_not_once_per_role(monkeypatch, caplog):
    caplog.set_level("INFO", logger="diffusers_omni.attention")
    monkeypatch.setenv(ENV_DIFFUSERS_BACKEND, "_native_cudnn")
    for _ in range(3):
        environment_backend()
    lines = [r.getMessage() for r in caplog.records if "is Diffusers' name for" in r.getMessage()]
    assert lines == ["environment variable DIFFUSERS_ATTN_BACKEND='_native_cudnn' is Diffusers' name for CUDNN_ATTN "
                     "(torch's cuDNN attention kernel)"]
