"""Routed processors: Diffusers' own processor code runs; only its ``dispatch_attention_fn`` calls are ours."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor2_0, JointAttnProcessor2_0
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

from diffusers_omni import omnify
from diffusers_omni.attention.processors import RoutedProcessor, bind_routed, is_routable, routed_classes
from diffusers_omni.installer import apply_attention, remove_attention
from diffusers_omni.models.base import declarations
from diffusers_omni.testing import tiny_flux_components, tiny_flux_pipeline


def test_every_routed_class_stands_for_a_processor_with_the_dispatch_seam():
    declarations()  # imports every architecture module: each makes its routed classes
    classes = routed_classes()
    assert FluxAttnProcessor in classes
    for stock, routed in classes.items():
        assert issubclass(routed, (RoutedProcessor, stock))
        # A Diffusers release that stopped calling dispatch_attention_fn in one of these would fail here, not
        # silently run stock attention under an omni report.
        assert is_routable(stock), stock.__name__


def test_classic_processors_have_no_seam_so_their_omni_versions_are_copies():
    assert not is_routable(AttnProcessor2_0)
    assert not is_routable(JointAttnProcessor2_0)


def test_a_routed_processor_shares_its_originals_attributes_and_leaves_it_unchanged():
    model = tiny_flux_components()["transformer"]
    attn = model.transformer_blocks[0].attn
    stock = attn.processor
    before = dict(vars(stock))
    apply_attention(model, "TORCH_SDPA")
    routed = attn.processor
    assert isinstance(routed, FluxAttnProcessor) and routed is not stock and routed.original is stock
    routed.some_setting = 3  # what Diffusers' setters (set_attention_backend, IP-adapter scale) do
    assert stock.some_setting == 3
    del routed.some_setting
    assert remove_attention(model)
    assert attn.processor is stock and type(stock) is FluxAttnProcessor and vars(stock) == before


def test_unbound_placeholder_names_the_fix():
    placeholder = type(bind_routed(FluxAttnProcessor(), {}))()
    assert placeholder.attend == {}
    with pytest.raises(RuntimeError, match="built without a backend"):
        placeholder(None, torch.zeros(1, 4, 8))


def test_routed_pipeline_is_bitwise_equal_after_enable_disable_enable():
    expected = tiny_flux_pipeline()(prompt="a cat", num_inference_steps=2, height=32, width=32,
                                    generator=torch.Generator().manual_seed(0), output_type="pt").images
    pipe = omnify(tiny_flux_pipeline(), "TORCH_SDPA")
    for _ in range(2):
        out = pipe(prompt="a cat", num_inference_steps=2, height=32, width=32,
                   generator=torch.Generator().manual_seed(0), output_type="pt").images
        assert torch.equal(out, expected)
        pipe.disable_omni_attention()
        pipe.enable_omni_attention("TORCH_SDPA")
