"""Diffusers' attention backend names as aliases, and "did you mean" for near misses."""

import pytest
from diffusers.models.attention_dispatch import AttentionBackendName

from diffusers_omni import AttentionConfig, AttentionSpec
from diffusers_omni.attention.plan import AttentionPlan
from diffusers_omni.attention.registry import DIFFUSERS_BACKEND_NAMES, diffusers_backend_name, registered_backend_names
from diffusers_omni.config.names import did_you_mean


def checked(value):
    """Names and aliases are checked when the plan is built from the config (``AttentionPlan.build``)."""
    return AttentionPlan.build(value).config


def test_every_diffusers_backend_name_is_mapped_or_refused_with_a_reason():
    listed = {entry.diffusers for entry in DIFFUSERS_BACKEND_NAMES}
    assert listed == {member.value for member in AttentionBackendName}
    assert all(entry.note for entry in DIFFUSERS_BACKEND_NAMES)
    assert all(entry.omni in registered_backend_names() for entry in DIFFUSERS_BACKEND_NAMES if entry.omni)


@pytest.mark.parametrize(
    "diffusers_name, ours",
    [("native", "TORCH_SDPA"), ("_native_cudnn", "CUDNN_ATTN"), ("flash", "FLASH_ATTN"), ("_flash_3", "FLASH_ATTN"),
     ("flash_varlen", "FLASH_ATTN"), ("_flash_3_hub", "FLASH_ATTN_3_HUB"), ("sage", "SAGE_ATTN"), ("NATIVE", "TORCH_SDPA")],
)
def test_diffusers_names_resolve_to_ours(diffusers_name, ours):
    assert checked(AttentionSpec(diffusers_name)).default.backend == ours
    config = checked(AttentionConfig.parse({"default": diffusers_name, "per_role": {"cross": {"backend": diffusers_name}}}))
    assert config.default.backend == ours and config.per_role["cross"].backend == ours


@pytest.mark.parametrize("name", ["xformers", "_native_math", "flex", "sage_hub"])
def test_diffusers_names_without_an_equivalent_are_refused_with_the_reason(name):
    with pytest.raises(ValueError, match=f"backend='{name}' is a Diffusers attention backend with no equivalent here: "
                                         f"{diffusers_backend_name(name).note[:20]}"):
        checked(AttentionSpec(name))


@pytest.mark.parametrize("typo, suggestion", [("TORCH_SPDA", "TORCH_SDPA"), ("cudnn_atn", "CUDNN_ATTN"), ("flsh", "flash"),
                                              ("atuo", "auto")])
def test_near_misses_get_a_suggestion(typo, suggestion):
    with pytest.raises(ValueError, match=f"backend='{typo}' is not a known attention backend \\(did you mean '{suggestion}'\\?\\)"):
        checked(AttentionSpec(typo))


def test_did_you_mean_stays_quiet_for_far_values():
    assert did_you_mean("nonsense", ["TORCH_SDPA", "FLASH_ATTN"]) == ""
    assert did_you_mean(3, ["TORCH_SDPA"]) == ""
