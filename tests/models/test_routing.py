"""Routed processors: Diffusers' own processor code runs; only its ``dispatch_attention_fn`` calls are ours."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0, JointAttnProcessor2_0
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


def test_classic_processors_are_routed_through_their_sdpa_calls():
    # They call F.scaled_dot_product_attention inline: routed like dispatch_attention_fn, no copy of their code.
    assert is_routable(AttnProcessor2_0)
    assert is_routable(JointAttnProcessor2_0)
    assert not is_routable(AttnProcessor)  # explicit softmax: AttnProcessor2_0 runs for it (models.sdxl.STAND_INS)


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


def test_roles_follow_diffusers_call_order_in_a_two_call_processor():
    """Wan 2.1 I2V's ``attn2`` attends the image context first, then the text: each call reaches its own role."""
    from PIL import Image

    from diffusers_omni.attention.processors import RoleAttention
    from diffusers_omni.testing import tiny_wan_i2v_pipeline

    pipe = omnify(tiny_wan_i2v_pipeline(), "TORCH_SDPA")
    lengths: dict[str, set[int]] = {}
    inputs: dict[str, int] = {}
    stock_call = RoleAttention.__call__

    def recording(self, query, key, *args, **kwargs):
        lengths.setdefault(self.role, set()).add(key.shape[1])
        return stock_call(self, query, key, *args, **kwargs)

    def seen(module, args, kwargs):
        inputs["text"] = kwargs["encoder_hidden_states"].shape[1]
        inputs["image"] = kwargs["encoder_hidden_states_image"].shape[1]

    handle = pipe.transformer.register_forward_pre_hook(seen, with_kwargs=True)
    RoleAttention.__call__ = recording
    try:
        pipe(prompt="a red fox", image=Image.new("RGB", (32, 32), (120, 60, 30)), height=32, width=32, num_frames=5,
             num_inference_steps=1, output_type="latent", generator=torch.Generator().manual_seed(0))
    finally:
        RoleAttention.__call__ = stock_call
        handle.remove()
    assert inputs["image"] != inputs["text"]
    assert lengths["wan.image_cross"] == {inputs["image"]}
    assert lengths["wan.cross"] == {inputs["text"]}
