"""Checks every supported architecture must pass, on tiny local pipelines.

A family's test module lists ``ModelCase``s and binds the standard tests:

    CASES = [ModelCase("flux", tiny_flux_pipeline, OmniFluxPipeline, FLUX_CALL, {"flux.joint": "self", ...})]
    globals().update(standard_tests(CASES))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

from diffusers_omni import omnify
from diffusers.models import attention_dispatch

from diffusers_omni.attention.processors import RoleAttention, is_omni_processor
from diffusers_omni.models.base import blocks_attrs_for, declaration_for
from diffusers_omni.pipelines.mixin import SupportsComponentDiscovery
from diffusers_omni.utils.modules import get_submodule_path


def default_attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {name: module for name, module in model.named_modules() if hasattr(module, "set_processor")}


@dataclass
class ModelCase:
    """One tiny pipeline of a family and what omni attention must find in it."""

    id: str
    factory: Callable[..., Any]  # factory(pipeline_cls=None) -> pipeline
    omni_cls: type
    call: dict
    roles: dict[str, str]  # every role expected in the report → its category
    dits: tuple[str, ...] = ("transformer",)
    attention_modules: Callable[[nn.Module], dict[str, nn.Module]] = default_attention_modules
    output: Callable[[Any], torch.Tensor] = field(default=None)

    def run(self, pipe) -> torch.Tensor:
        result = pipe(**self.call, generator=torch.Generator().manual_seed(0))
        if self.output is not None:
            return self.output(result)
        for attr in ("images", "frames", "videos", "audios"):
            value = getattr(result, attr, None)
            if isinstance(value, torch.Tensor):
                return value
        raise AssertionError(f"no tensor output in {type(result).__name__}; pass output_type='latent' or output=")


def check_omnify_report(case: ModelCase) -> None:
    pipe = omnify(case.factory(), "TORCH_SDPA")
    assert type(pipe) is case.omni_cls
    assert isinstance(pipe, SupportsComponentDiscovery)
    report = pipe.omni_attention_report()
    expected_modules = {
        f"{dit}.{name}" for dit in case.dits for name in case.attention_modules(get_submodule_path(pipe, dit))
    }
    assert {entry["module"] for entry in report} == expected_modules
    assert {entry["role"]: entry["category"] for entry in report} == case.roles
    for dit in case.dits:
        for module in case.attention_modules(get_submodule_path(pipe, dit)).values():
            assert is_omni_processor(module.processor), module


def check_bitwise_parity(case: ModelCase) -> None:
    expected = case.run(case.factory())
    pipe = omnify(case.factory(), "TORCH_SDPA")
    assert torch.equal(case.run(pipe), expected)
    pipe.disable_omni_attention()
    assert torch.equal(case.run(pipe), expected)


def check_every_call_reaches_its_role(case: ModelCase) -> None:
    """Every attention call of an omni forward goes to an omni backend through its role: none falls through to
    Diffusers' own dispatch (its registered backends raise while the pipeline runs), and every role of the report
    is called."""
    pipe = omnify(case.factory(), "TORCH_SDPA")
    called: dict[str, int] = {}
    stock_call = RoleAttention.__call__

    def counting(self, *args, **kwargs):
        called[self.role] = called.get(self.role, 0) + 1
        return stock_call(self, *args, **kwargs)

    def fell_through(*args, **kwargs):
        raise AssertionError("an attention call fell through to Diffusers' dispatch")

    registry = attention_dispatch._AttentionBackendRegistry._backends
    saved = dict(registry)
    RoleAttention.__call__ = counting
    registry.update({name: fell_through for name in registry})
    try:
        case.run(pipe)
    finally:
        RoleAttention.__call__ = stock_call
        registry.update(saved)
    assert set(called) == {entry["role"] for entry in pipe.omni_attention_report()}, called


def check_role_override(case: ModelCase) -> None:
    config = {"default": {"backend": "TORCH_SDPA"}, "per_role": {"cross": {"backend": "auto"}}}
    stock = case.factory()
    declared = {role.category for dit in case.dits for role in declaration_for(get_submodule_path(stock, dit)).roles}
    if "cross" not in declared | set(case.roles.values()):
        # A key naming no role or category of the model would be ignored: it is refused instead.
        with pytest.raises(ValueError, match=r"per_role key\(s\) 'cross' match no attention role or category"):
            omnify(stock, config)
        config = {"default": {"backend": "TORCH_SDPA"}}
    pipe = omnify(case.factory(), config)
    for entry in pipe.omni_attention_report():
        if entry["category"] == "cross":
            assert entry["source"].startswith("per_role['cross'] auto → platform default"), entry
        else:
            assert entry["source"] == "default", entry
    role = sorted(case.roles)[0]
    report = pipe.enable_omni_attention({"per_role": {role: "TORCH_SDPA"}})
    assert {e["source"] for e in report if e["role"] == role} == {f"per_role[{role!r}]"}


def declared_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    blocks = []
    for attr in blocks_attrs_for(model):
        container = model.get_submodule(attr)
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            blocks += [(f"{attr}.{i}", block) for i, block in enumerate(container)]
        else:
            blocks.append((attr, container))
    return blocks


def check_blocks_in_forward_order(case: ModelCase) -> None:
    pipe = omnify(case.factory(), "TORCH_SDPA")
    for dit in case.dits:
        model = get_submodule_path(pipe, dit)
        blocks = declared_blocks(model)
        assert blocks, f"{dit} declares no blocks"
        seen: list[str] = []
        handles = [
            block.register_forward_pre_hook(lambda module, args, name=name: seen.append(name) if name not in seen else None)
            for name, block in blocks
        ]
        try:
            case.run(pipe)
        finally:
            for handle in handles:
                handle.remove()
        assert seen == [name for name, _ in blocks], f"{dit}: forward order {seen}"


def check_offload_parity(case: ModelCase) -> None:
    """The family's component and block declarations drive both offload strategies (``device="cpu"`` runs the same
    code path without streams): output stays bitwise equal to stock Diffusers over repeated calls."""
    expected = case.run(case.factory())
    pipe = omnify(case.factory(), "TORCH_SDPA")
    for enable in (pipe.enable_layerwise_offload, pipe.enable_model_level_offload):
        enable(device="cpu")
        assert torch.equal(case.run(pipe), expected)
        assert torch.equal(case.run(pipe), expected)
        pipe.disable_omni_offload()


def _decoded(case: ModelCase, pipe) -> Any:
    """The case's output with the VAE run (``output_type="pt"``), as a flat list of its tensors."""
    result = pipe(**{**case.call, "output_type": "pt"}, generator=torch.Generator().manual_seed(0))
    values = result.values() if hasattr(result, "values") else [result]
    return [v for v in values if isinstance(v, torch.Tensor)] + [t for v in values if isinstance(v, (list, tuple))
                                                                for t in v if isinstance(t, torch.Tensor)]


def check_layerwise_decoded_output(case: ModelCase) -> None:
    """Layerwise offload with every component managed (encoders streamed, the VAE for its phase): the decoded
    output, not only the latents, stays bitwise equal to stock Diffusers, and between calls no phase's weights stay
    on the device."""
    expected = _decoded(case, case.factory())
    assert expected, "no tensor output with output_type='pt'"
    pipe = omnify(case.factory(), "TORCH_SDPA")
    backend = pipe.enable_layerwise_offload(device="cpu")
    for _ in range(2):
        found = _decoded(case, pipe)
        assert len(found) == len(expected) and all(torch.equal(a, b) for a, b in zip(found, expected))
        assert not any(unit.onloaded for unit in backend._state.units)
    pipe.disable_omni_offload()


def standard_tests(cases: list[ModelCase]) -> dict[str, Callable]:
    """Parametrised test functions to bind into a test module's globals."""
    ids = [case.id for case in cases]
    checks = {
        "test_omnify_report_lists_every_attention_module": check_omnify_report,
        "test_torch_sdpa_bitwise_equal_to_stock_diffusers": check_bitwise_parity,
        "test_per_role_override_shows_its_source": check_role_override,
        "test_every_attention_call_reaches_its_role": check_every_call_reaches_its_role,
        "test_block_attrs_resolve_in_forward_order": check_blocks_in_forward_order,
        "test_offload_strategies_keep_bitwise_parity": check_offload_parity,
        "test_layerwise_decoded_output_bitwise_with_every_component_managed": check_layerwise_decoded_output,
    }

    def bind(name: str, check: Callable[[ModelCase], None]) -> Callable:
        def test(case: ModelCase) -> None:
            check(case)

        test.__name__ = name
        return pytest.mark.parametrize("case", cases, ids=ids)(test)

    return {name: bind(name, check) for name, check in checks.items()}
