"""Gradients through omni attention: TORCH_SDPA matches a float64 reference; forward-only backends refuse backward."""

import pytest
import torch

from diffusers_omni import apply_attention, remove_attention
from diffusers_omni.testing import tiny_flux_components

from .helpers import pipeline_and_inputs


def _flux_transformer():
    return tiny_flux_components()["transformer"]


def _loss(model, inputs):
    out = model(**{**inputs.kwargs, "return_dict": False})[0]
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    return (out * weights).sum()


def test_gradients_through_torch_sdpa_match_a_float64_reference():
    _, inputs = pipeline_and_inputs("flux")
    model = _flux_transformer()
    apply_attention(model, "TORCH_SDPA")
    _loss(model, inputs).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    reference = _flux_transformer().double()  # stock Diffusers processors, float64
    _loss(reference, inputs.to(dtype=torch.float64)).backward()
    assert grads, "no gradient reached the parameters"
    attention_params = [n for n in grads if ".attn." in n]
    assert attention_params
    for name, param in reference.named_parameters():
        assert name in grads, f"{name} got no gradient through omni attention"
        torch.testing.assert_close(grads[name].double(), param.grad, atol=1e-4, rtol=1e-3, msg=name)


def test_torch_sdpa_gradients_are_bitwise_those_of_stock_diffusers():
    _, inputs = pipeline_and_inputs("flux")
    stock, omni = _flux_transformer(), _flux_transformer()
    apply_attention(omni, "TORCH_SDPA")
    _loss(stock, inputs).backward()
    _loss(omni, inputs).backward()
    for (name, a), (_, b) in zip(stock.named_parameters(), omni.named_parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_forward_only_backend_raises_on_backward_naming_backend_and_role(test_backends):
    _, inputs = pipeline_and_inputs("flux")
    model = _flux_transformer()
    apply_attention(model, {"default": "TORCH_SDPA", "per_role": {"flux.single": "FORWARD_ONLY_TEST"}})
    loss = _loss(model, inputs)
    with pytest.raises(RuntimeError, match=r"FORWARD_ONLY_TEST \(role 'flux.single'\) is forward-only") as info:
        loss.backward()
    assert "TORCH_SDPA" in str(info.value)  # names a fix


def test_forward_only_backend_forward_is_unchanged_and_inference_needs_no_guard(test_backends):
    _, inputs = pipeline_and_inputs("flux")
    model = _flux_transformer()
    apply_attention(model, "FORWARD_ONLY_TEST")
    with torch.no_grad():
        expected = model(**inputs.kwargs)[0]
    trained = model(**inputs.kwargs)[0]  # autograd on: goes through the guard
    assert trained.requires_grad and torch.equal(trained.detach(), expected)
    remove_attention(model)


def test_forward_only_backend_with_frozen_inputs_has_nothing_to_refuse(test_backends):
    model = _flux_transformer().requires_grad_(False)
    _, inputs = pipeline_and_inputs("flux")
    apply_attention(model, "FORWARD_ONLY_TEST")
    out = model(**inputs.kwargs)[0]
    assert not out.requires_grad
