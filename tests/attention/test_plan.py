"""#27 item 2: kernel families declared in one value each, checked into one immutable plan per enable call, with no
wiring done by importing a module."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from diffusers_omni import AttentionConfig, AttentionSpec, AttnQuantSpec, apply_attention
from diffusers_omni.attention.backends.base import AttentionBackend, AttentionCall
from diffusers_omni.attention.backends.family import Alias, BackendFamily, Route
from diffusers_omni.attention.plan import AttentionPlan
from diffusers_omni.attention.platform import Platform
from diffusers_omni.attention.registry import (
    diffusers_backend_names,
    register_family,
    registered_backend_names,
    reset_family,
)
from diffusers_omni.attention.routing import platform_routes
from diffusers_omni.attention.backends.sdpa.backend import sdpa_bshd
from diffusers_omni.attention.selector import resolve
from diffusers_omni.installer import applied_attention_config
from diffusers_omni.testing import tiny_flux_components, tiny_flux_inputs

CPU = Platform(device_type="cpu", device_name="CPU")
CALL = AttentionCall(device_type="cpu", dtype=torch.float32, head_dim=64)


def test_fp8_rules_apply_in_an_interpreter_that_never_imports_routing():
    # Before: attention.routing pushed the FP8 rules into the flash backend when it was imported; a process that
    # never imported it ran every FP8 call in bf16, with a warning.
    script = """
import json, sys
from diffusers_omni import AttentionSpec
from diffusers_omni.attention.backends.flash.backend import FlashAttentionBackend, FlashKernels
from diffusers_omni.attention.platform import Platform, use_platform

fa3 = FlashKernels(func=lambda *a, **k: None, varlen_func=None, label="FA3")
spec = AttentionSpec("FLASH_ATTN", quant={"dtype_qk": "fp8_e4m3", "dtype_vo": "fp8_e4m3"})
backend = FlashAttentionBackend(spec, kernels=fa3)
with use_platform(Platform("cuda", "H200", (9, 0), 91900)):
    routes = [backend.fp8_route(32760, 32760, 128), backend.fp8_route(4608, 4608, 128)]
print(json.dumps({"routes": routes, "routing_imported": "diffusers_omni.attention.routing" in sys.modules}))
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out == {"routes": [True, False], "routing_imported": False}
    assert "no shape rules" not in run.stderr


def test_names_and_options_are_known_without_importing_a_backend():
    script = """
import json, sys
from diffusers_omni.attention.plan import AttentionPlan
plan = AttentionPlan.build({"default": "_flash_3", "per_role": {"cross": {"backend": "trtllm_attn",
                                                                           "quant": {"dtype_qk": "int8"}}}})
loaded = sorted(m for m in sys.modules if m.startswith("diffusers_omni.attention.backends.") and m.endswith(".backend"))
print(json.dumps({"default": plan.config.default.backend, "cross": plan.config.per_role["cross"].backend,
                  "backends_loaded": loaded}))
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out == {"default": "FLASH_ATTN", "cross": "TRTLLM_ATTN", "backends_loaded": []}


def test_the_plan_is_immutable_and_canonical():
    plan = AttentionPlan.build({"default": "native", "per_role": {"cross": "_native_cudnn"}, "deterministic": True},
                               CPU)
    assert plan.config == AttentionConfig(default=AttentionSpec("TORCH_SDPA"),
                                          per_role={"cross": AttentionSpec("CUDNN_ATTN")}, deterministic=True)
    assert (plan.platform, plan.deterministic, plan.deterministic_source) == (CPU, True, "config")
    assert plan.spec_for("flux.single", "self") == (AttentionSpec("TORCH_SDPA"), "default")
    assert plan.spec_for("flux.cross", "cross") == (AttentionSpec("CUDNN_ATTN"), "per_role['cross']")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.config = AttentionConfig()
    assert AttentionPlan.build(plan) is plan and AttentionPlan.build(plan, CPU) is plan


def test_the_plan_is_built_once_per_enable_call(monkeypatch):
    built, parsed = [], []
    build, parse = AttentionPlan.build.__func__, AttentionConfig.parse.__func__

    def counting_build(cls, config=None, platform=None):
        built.append(config)
        return build(cls, config, platform)

    def counting_parse(cls, value):
        parsed.append(value)
        return parse(cls, value)

    monkeypatch.setattr(AttentionPlan, "build", classmethod(counting_build))
    monkeypatch.setattr(AttentionConfig, "parse", classmethod(counting_parse))
    transformer = tiny_flux_components()["transformer"]
    report = apply_attention(transformer, {"default": "native", "per_role": {"flux.joint": "TORCH_SDPA"}})
    assert {entry["backend"] for entry in report} == {"TORCH_SDPA"}
    assert len(built) == 1 and len(parsed) == 1
    # Every role resolved from that one plan; the model keeps its canonical config.
    assert applied_attention_config(transformer).default == AttentionSpec("TORCH_SDPA")


def test_errors_reach_the_enable_call_with_field_value_and_allowed():
    transformer = tiny_flux_components()["transformer"]
    with pytest.raises(ValueError, match="quant.dtype_qk='bfloat16' is not allowed with TRTLLM_ATTN; allowed: 'int8', "
                                         "'fp8_e4m3'"):
        apply_attention(transformer, {"default": {"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "bfloat16"}}})
    with pytest.raises(ValueError, match="backend='NOPE' is not a known attention backend"):
        apply_attention(transformer, "NOPE")


# A new kernel family, declared the way the built-in ones are: a package (here: this module) with one descriptor.


class ToyBackend(AttentionBackend):
    """SDPA under another name: a kernel family of its own for the test."""

    name = "TOY_ATTN"
    devices = frozenset({"cpu"})
    supports_mask = True
    calls = 0

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        type(self).calls += 1
        return sdpa_bshd(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def check_toy_quant(backend, quant):
    if quant.dtype_qk != "toy8":
        raise ValueError(f"quant.dtype_qk={quant.dtype_qk!r} is not allowed with {backend}; allowed: 'toy8'")


TOY_FAMILY = BackendFamily(
    "toy",
    backends={"TOY_ATTN": f"{__name__}:ToyBackend"},
    aliases=(Alias("toy", "TOY_ATTN", "the toy kernel"),),
    options={"quant": check_toy_quant},
    routes=(Route("TOY_ATTN", when=("toy_enabled",), platforms=("cpu",), priority=10),),
    conditions={"toy_enabled": lambda platform, call: call.head_dim == 64},
)


@pytest.fixture
def toy_family():
    register_family(TOY_FAMILY)  # the one registration
    yield
    reset_family("toy")


def test_a_new_family_is_selectable_with_its_aliases_options_and_routes(toy_family):
    assert "TOY_ATTN" in registered_backend_names()
    plan = AttentionPlan.build({"default": "Toy", "per_role": {"cross": {"backend": "toy_attn",
                                                                          "quant": {"dtype_qk": "toy8"}}}}, CPU)
    assert plan.config.default == AttentionSpec("TOY_ATTN")
    assert plan.config.per_role["cross"] == AttentionSpec("TOY_ATTN", quant=AttnQuantSpec(dtype_qk="toy8"))
    with pytest.raises(ValueError, match="quant.dtype_qk='int8' is not allowed with TOY_ATTN; allowed: 'toy8'"):
        AttentionPlan.build(AttentionSpec("TOY_ATTN", quant={"dtype_qk": "int8"}))
    with pytest.raises(ValueError, match="block_sparse is not allowed with backend='TOY_ATTN'; allowed only with "
                                         "RAINFUSION_ATTN"):
        AttentionPlan.build(AttentionSpec("TOY", block_sparse={}))
    # Its option reaches the other families' messages too.
    with pytest.raises(ValueError, match="quant is not allowed with backend='TORCH_SDPA'; allowed only with .*TOY_ATTN"):
        AttentionPlan.build(AttentionSpec("TORCH_SDPA", quant={"dtype_qk": "int8"}))
    # Its route is a platform default where its condition holds, ahead of TORCH_SDPA.
    assert [route.backend for route in platform_routes(CPU)] == ["TOY_ATTN", "TORCH_SDPA"]
    assert resolve(None, "x.self", "self", CALL, CPU).backend == "TOY_ATTN"
    other = dataclasses.replace(CALL, head_dim=32)
    assert resolve(None, "x.self", "self", other, CPU).backend == "TORCH_SDPA"
    # And it runs: installed on a model, every call goes through it, bitwise equal to TORCH_SDPA.
    transformer = tiny_flux_components()["transformer"]
    inputs = tiny_flux_inputs()
    apply_attention(transformer, "TORCH_SDPA")
    with torch.no_grad():
        expected = transformer(**inputs).sample
    report = apply_attention(transformer, "toy")
    assert {entry["backend"] for entry in report} == {"TOY_ATTN"}
    ToyBackend.calls = 0
    with torch.no_grad():
        assert torch.equal(transformer(**inputs).sample, expected)
    assert ToyBackend.calls == len(report)
    # A Diffusers name is not claimed by accident.
    assert all(entry.omni != "TOY_ATTN" for entry in diffusers_backend_names())


def test_a_family_is_refused_when_it_contradicts_itself_or_another():
    with pytest.raises(ValueError, match="alias 'x' names 'OTHER_ATTN', which is not one of its backends"):
        BackendFamily("bad", backends={"BAD_ATTN": "m:C"}, aliases=(Alias("x", "OTHER_ATTN", ""),))
    with pytest.raises(ValueError, match="unknown option"):
        BackendFamily("bad", backends={"BAD_ATTN": "m:C"}, options={"sparsity": None})
    with pytest.raises(ValueError, match="already registered by family 'sdpa'"):
        register_family(BackendFamily("bad", backends={"TORCH_SDPA": "m:C"}))
    with pytest.raises(ValueError, match="'flash' of 'bad' is already an alias of FLASH_ATTN"):
        register_family(BackendFamily("bad", backends={"BAD_ATTN": "m:C"}, aliases=(Alias("flash", "BAD_ATTN", ""),)))
    assert "BAD_ATTN" not in registered_backend_names()


# One parse at the entry point; the layers below take the plan -----------------------------------------------------


def _count_parses(monkeypatch) -> list:
    """Records every ``AttentionPlan.build`` that parses a config (a plan handed back as is is not a parse)."""
    parses = []
    build = AttentionPlan.build.__func__

    def counting(cls, config=None, platform=None):
        if not isinstance(config, AttentionPlan):
            parses.append(config)
        return build(cls, config, platform)

    monkeypatch.setattr(AttentionPlan, "build", classmethod(counting))
    return parses


def test_the_layers_below_the_entry_points_take_a_plan_only():
    from diffusers_omni.attention.selector import check_per_role_keys, resolve_role, select_spec
    from diffusers_omni.installer import check_roles_of_plans, plan_attention

    model = tiny_flux_components()["transformer"]
    config = {"default": "TORCH_SDPA", "per_role": {"cross": "TORCH_SDPA"}}
    for call in (
        lambda: plan_attention(model, config),
        lambda: check_roles_of_plans(AttentionConfig.parse(config), []),
        lambda: check_per_role_keys(config, [], [], "Model"),
        lambda: resolve_role("TORCH_SDPA", "x.self", "self", CALL),
        lambda: select_spec(None, "x.self", "self"),
    ):
        with pytest.raises(TypeError, match=r"takes an AttentionPlan.*AttentionPlan\.build\(config\)"):
            call()
    plan = AttentionPlan.build(config, CPU)
    _, sites = plan_attention(model, plan)
    assert {r.backend for _, resolutions in sites for r in resolutions.values()} == {"TORCH_SDPA"}


def test_apply_attention_parses_its_config_once(monkeypatch):
    parses = _count_parses(monkeypatch)
    report = apply_attention(tiny_flux_components()["transformer"], {"default": "TORCH_SDPA"})
    assert parses == [{"default": "TORCH_SDPA"}]
    assert {entry["backend"] for entry in report} == {"TORCH_SDPA"}
    # The public entries still take what they took: a plan too, handed down as is.
    plan = AttentionPlan.build("TORCH_SDPA")
    parses.clear()
    apply_attention(tiny_flux_components()["transformer"], plan)
    assert resolve(plan, "x.self", "self", CALL).backend == "TORCH_SDPA"
    assert parses == []
