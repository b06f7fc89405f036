"""Tiny pipeline factories build fast, deterministic, fully local pipelines."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, FluxPipeline, WanImageToVideoPipeline, WanPipeline
from PIL import Image

from diffusers_omni.testing import (
    tiny_flux_components,
    tiny_flux_pipeline,
    tiny_wan_components,
    tiny_wan_i2v_components,
    tiny_wan_i2v_pipeline,
    tiny_wan_pipeline,
)

PROMPT = "A photo of a red fox in the snow, 4K!"

CASES: dict[str, tuple[Callable[..., DiffusionPipeline], type[DiffusionPipeline], dict[str, Any]]] = {
    "flux": (tiny_flux_pipeline, FluxPipeline, {"height": 32, "width": 32}),
    "wan": (tiny_wan_pipeline, WanPipeline, {"height": 32, "width": 32, "num_frames": 5}),
    "wan_i2v": (
        tiny_wan_i2v_pipeline,
        WanImageToVideoPipeline,
        {"height": 32, "width": 32, "num_frames": 5, "image": Image.new("RGB", (32, 32), (200, 80, 20))},
    ),
}

COMPONENT_FACTORIES = [tiny_flux_components, tiny_wan_components, tiny_wan_i2v_components]


def _generate(pipe: DiffusionPipeline, output_type: str, call_kwargs: dict[str, Any]) -> Any:
    output = pipe(
        prompt=PROMPT,
        generator=torch.Generator().manual_seed(0),
        num_inference_steps=2,
        output_type=output_type,
        **call_kwargs,
    )
    return output.images if hasattr(output, "images") else output.frames


@pytest.fixture(params=list(CASES), scope="module")
def case(request: pytest.FixtureRequest) -> tuple[DiffusionPipeline, type[DiffusionPipeline], dict[str, Any]]:
    factory, expected_cls, call_kwargs = CASES[request.param]
    pipe = factory(seed=0)
    pipe.set_progress_bar_config(disable=True)
    return pipe, expected_cls, call_kwargs


def test_pipeline_type_and_eval_mode(case: tuple[DiffusionPipeline, type[DiffusionPipeline], dict[str, Any]]) -> None:
    pipe, expected_cls, _ = case
    assert type(pipe) is expected_cls
    modules = [c for c in pipe.components.values() if isinstance(c, torch.nn.Module)]
    assert modules
    assert not any(module.training for module in modules)


def test_latents_are_reproducible_and_finite(
    case: tuple[DiffusionPipeline, type[DiffusionPipeline], dict[str, Any]],
) -> None:
    pipe, _, call_kwargs = case
    first = _generate(pipe, "latent", call_kwargs)
    second = _generate(pipe, "latent", call_kwargs)
    assert torch.isfinite(first).all()
    assert torch.equal(first, second)


def test_decoded_output_is_finite(case: tuple[DiffusionPipeline, type[DiffusionPipeline], dict[str, Any]]) -> None:
    pipe, _, call_kwargs = case
    decoded = np.asarray(_generate(pipe, "np", call_kwargs))
    assert decoded.shape[-3:] == (call_kwargs["height"], call_kwargs["width"], 3)
    assert np.isfinite(decoded).all()


@pytest.mark.parametrize("components_factory", COMPONENT_FACTORIES)
def test_same_seed_gives_identical_weights(components_factory: Callable[[int], dict[str, Any]]) -> None:
    first, second = components_factory(0), components_factory(0)
    for name, component in first.items():
        if isinstance(component, torch.nn.Module):
            reference = second[name].state_dict()
            assert all(torch.equal(tensor, reference[key]) for key, tensor in component.state_dict().items())


def test_building_leaves_global_rng_untouched() -> None:
    state = torch.random.get_rng_state()
    tiny_flux_components(seed=3)
    assert torch.equal(state, torch.random.get_rng_state())


def test_pipeline_cls_builds_subclass() -> None:
    class CustomFluxPipeline(FluxPipeline):
        pass

    pipe = tiny_flux_pipeline(0, CustomFluxPipeline)
    assert type(pipe) is CustomFluxPipeline
