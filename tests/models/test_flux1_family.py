"""FLUX.1 family: every pipeline on ``FluxTransformer2DModel``, IP-adapter attention, and staying applied after
Diffusers' own IP-adapter loading/unloading, QKV fusion and LoRA loading."""

from __future__ import annotations

import pytest
import torch
from diffusers import (
    FluxControlImg2ImgPipeline,
    FluxControlInpaintPipeline,
    FluxImg2ImgPipeline,
    FluxInpaintPipeline,
    FluxKontextInpaintPipeline,
    FluxKontextPipeline,
)
from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor
from PIL import Image

from diffusers_omni import omnify
from diffusers_omni.attention.processors import is_omni_processor
from diffusers_omni.models.flux import OmniFluxAttnProcessor, OmniFluxIPAdapterAttnProcessor
from diffusers_omni.pipelines import flux as omni_flux
from diffusers_omni.testing import tiny_flux_pipeline
from diffusers_omni.testing.tiny_flux_variants import (
    TINY_FLUX_IP_EMBED_DIM,
    load_tiny_flux_ip_adapter,
    tiny_flux_control_pipeline,
    tiny_flux_fill_pipeline,
    tiny_flux_variant_pipeline,
)

from .harness import ModelCase, standard_tests

IMAGE = Image.new("RGB", (32, 32), (120, 60, 30))
MASK = Image.new("L", (32, 32), 0)
MASK.paste(255, (8, 8, 24, 24))
SMALL = {
    "prompt": "a red fox",
    "height": 32,
    "width": 32,
    "num_inference_steps": 2,
    "output_type": "latent",
    "max_sequence_length": 16,
}
# img2img-like pipelines keep int(steps * strength) steps: 3 × 0.7 → 2.
IMG2IMG = {**SMALL, "image": IMAGE, "strength": 0.7, "num_inference_steps": 3}
FLUX_ROLES = {"flux.joint": "self", "flux.single": "self"}


def _factory(pipeline_cls, builder=tiny_flux_variant_pipeline):
    if builder is tiny_flux_variant_pipeline:
        return lambda pipeline_cls_=None: tiny_flux_variant_pipeline(pipeline_cls)
    return lambda pipeline_cls_=None: builder(pipeline_cls=pipeline_cls)


CASES = [
    ModelCase("img2img", _factory(FluxImg2ImgPipeline), omni_flux.OmniFluxImg2ImgPipeline, IMG2IMG, FLUX_ROLES),
    ModelCase(
        "inpaint", _factory(FluxInpaintPipeline), omni_flux.OmniFluxInpaintPipeline, {**IMG2IMG, "mask_image": MASK}, FLUX_ROLES
    ),
    ModelCase(
        "fill", tiny_flux_fill_pipeline, omni_flux.OmniFluxFillPipeline, {**SMALL, "image": IMAGE, "mask_image": MASK}, FLUX_ROLES
    ),
    ModelCase(
        "kontext",
        _factory(FluxKontextPipeline),
        omni_flux.OmniFluxKontextPipeline,
        {**SMALL, "image": IMAGE, "max_area": 32 * 32, "_auto_resize": False},
        FLUX_ROLES,
    ),
    ModelCase(
        "kontext_inpaint",
        _factory(FluxKontextInpaintPipeline),
        omni_flux.OmniFluxKontextInpaintPipeline,
        {**IMG2IMG, "mask_image": MASK, "max_area": 32 * 32, "_auto_resize": False},
        FLUX_ROLES,
    ),
    ModelCase(
        "control", tiny_flux_control_pipeline, omni_flux.OmniFluxControlPipeline, {**SMALL, "control_image": IMAGE}, FLUX_ROLES
    ),
    ModelCase(
        "control_img2img",
        _factory(FluxControlImg2ImgPipeline, tiny_flux_control_pipeline),
        omni_flux.OmniFluxControlImg2ImgPipeline,
        {**IMG2IMG, "control_image": IMAGE},
        FLUX_ROLES,
    ),
    ModelCase(
        "control_inpaint",
        _factory(FluxControlInpaintPipeline, tiny_flux_control_pipeline),
        omni_flux.OmniFluxControlInpaintPipeline,
        {**IMG2IMG, "mask_image": MASK, "control_image": IMAGE},
        FLUX_ROLES,
    ),
]

globals().update(standard_tests(CASES))


# IP-adapter -----------------------------------------------------------------------------------------------------


def _ip_call(scale_embeds: float = 1.0) -> dict:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        embeds = torch.randn(1, 1, TINY_FLUX_IP_EMBED_DIM)
    return {
        **SMALL,
        "ip_adapter_image_embeds": [embeds * scale_embeds],
        "negative_ip_adapter_image_embeds": [torch.zeros_like(embeds)],
        "true_cfg_scale": 1.5,
        "negative_prompt": "blurry",
    }


def _run(pipe, call: dict) -> torch.Tensor:
    return pipe(**call, generator=torch.Generator().manual_seed(0)).images


def _stock_with_ip_adapter():
    stock = tiny_flux_pipeline()
    load_tiny_flux_ip_adapter(stock.transformer)
    return stock


def test_ip_adapter_loaded_after_enable_is_reapplied_with_its_role_and_bitwise_equal():
    stock = _stock_with_ip_adapter()
    expected = _run(stock, _ip_call())
    stock.set_ip_adapter_scale(0.0)
    assert not torch.equal(_run(stock, _ip_call()), expected)  # the IP-adapter attention does contribute

    pipe = omnify(tiny_flux_pipeline(), "TORCH_SDPA")
    load_tiny_flux_ip_adapter(pipe.transformer)  # what FluxIPAdapterMixin.load_ip_adapter does to the transformer
    joint = pipe.transformer.transformer_blocks[0].attn
    single = pipe.transformer.single_transformer_blocks[0].attn
    assert type(joint.processor) is FluxIPAdapterAttnProcessor
    # Diffusers re-instantiated type(processor)() on the single-stream blocks: an unbound omni placeholder.
    assert type(single.processor) is OmniFluxAttnProcessor and not single.processor.attend

    assert torch.equal(_run(pipe, _ip_call()), expected)

    assert isinstance(joint.processor, OmniFluxIPAdapterAttnProcessor)
    assert isinstance(single.processor, OmniFluxAttnProcessor) and single.processor.attend
    report = pipe.omni_attention_report()
    assert {(e["module"], e["role"], e["category"]) for e in report if e["role"] == "flux.ip_adapter"} == {
        ("transformer.transformer_blocks.0.attn", "flux.ip_adapter", "cross")
    }
    assert {e["role"] for e in report} == {"flux.joint", "flux.single", "flux.ip_adapter"}

    # The adapter weights stay visible where Diffusers keeps them (same state_dict keys, same tensors).
    assert pipe.transformer.state_dict().keys() == stock.transformer.state_dict().keys()
    ip_weight = joint.processor.to_k_ip[0].weight
    assert ip_weight is joint.processor.original.to_k_ip[0].weight
    assert any(p is ip_weight for p in pipe.transformer.parameters())
    assert joint._modules["processor"] is joint.processor

    pipe.disable_omni_attention()
    assert type(joint.processor) is FluxIPAdapterAttnProcessor
    assert torch.equal(_run(pipe, _ip_call()), expected)


def test_ip_adapter_scale_and_model_to_reach_the_omni_processor():
    stock = _stock_with_ip_adapter()
    stock.set_ip_adapter_scale(0.5)
    expected = _run(stock, _ip_call())

    pipe = tiny_flux_pipeline()
    load_tiny_flux_ip_adapter(pipe.transformer)
    pipe = omnify(pipe, "TORCH_SDPA")  # IP-adapter loaded before enabling: replaced right away
    joint = pipe.transformer.transformer_blocks[0].attn
    assert isinstance(joint.processor, OmniFluxIPAdapterAttnProcessor)
    pipe.set_ip_adapter_scale(0.5)
    assert joint.processor.original.scale == [0.5]
    assert torch.equal(_run(pipe, _ip_call()), expected)

    pipe.transformer.to(torch.float64)
    assert joint.processor.to_v_ip[0].weight.dtype == torch.float64
    assert joint.processor.original.to_v_ip[0].weight.dtype == torch.float64
    pipe.transformer.to(torch.float32)


def test_ip_adapter_unload_after_enable_goes_back_to_plain_joint_attention():
    expected = _run(tiny_flux_pipeline(), SMALL)
    pipe = tiny_flux_pipeline()
    load_tiny_flux_ip_adapter(pipe.transformer)
    pipe = omnify(pipe, "TORCH_SDPA")
    pipe.unload_ip_adapter()  # does type(processor)() for every non-IP-adapter processor: ours
    assert torch.equal(_run(pipe, SMALL), expected)
    assert {e["role"] for e in pipe.omni_attention_report()} == {"flux.joint", "flux.single"}
    for name, processor in pipe.transformer.attn_processors.items():
        assert type(processor) is OmniFluxAttnProcessor and processor.attend, name


def test_ip_adapter_role_can_take_its_own_backend():
    pipe = tiny_flux_pipeline()
    load_tiny_flux_ip_adapter(pipe.transformer)
    pipe = omnify(pipe, {"default": {"backend": "TORCH_SDPA"}, "per_role": {"flux.ip_adapter": "TORCH_SDPA"}})
    sources = {e["role"]: e["source"] for e in pipe.omni_attention_report()}
    assert sources["flux.ip_adapter"] == "per_role['flux.ip_adapter']"
    assert sources["flux.joint"] == "default"


# QKV fusion and LoRA ---------------------------------------------------------------------------------------------


def test_fuse_qkv_projections_after_enable_stays_omni_and_bitwise_equal_to_stock_fused():
    stock = tiny_flux_pipeline()
    stock.transformer.fuse_qkv_projections()
    expected = _run(stock, SMALL)

    pipe = omnify(tiny_flux_pipeline(), "TORCH_SDPA")
    pipe.transformer.fuse_qkv_projections()
    assert torch.equal(_run(pipe, SMALL), expected)
    assert all(is_omni_processor(p) for p in pipe.transformer.attn_processors.values())
    assert pipe.transformer.transformer_blocks[0].attn.fused_projections


def _tiny_lora(transformer) -> dict[str, torch.Tensor]:
    """A random rank-2 LoRA on every attention's ``to_q``/``to_v``, in Diffusers' PEFT key layout."""
    generator = torch.Generator().manual_seed(5)
    state_dict = {}
    for name, module in transformer.named_modules():
        if name.endswith(("attn.to_q", "attn.to_v")):
            state_dict[f"transformer.{name}.lora_A.weight"] = 0.3 * torch.randn(2, module.in_features, generator=generator)
            state_dict[f"transformer.{name}.lora_B.weight"] = 0.3 * torch.randn(module.out_features, 2, generator=generator)
    return state_dict


def test_lora_loaded_after_enable_stays_omni_and_bitwise_equal_to_stock_lora():
    pytest.importorskip("peft")
    stock = tiny_flux_pipeline()
    stock.load_lora_weights(_tiny_lora(stock.transformer), adapter_name="tiny")
    expected = _run(stock, SMALL)
    assert not torch.equal(expected, _run(tiny_flux_pipeline(), SMALL))  # the LoRA does change the output

    pipe = omnify(tiny_flux_pipeline(), "TORCH_SDPA")
    pipe.load_lora_weights(_tiny_lora(pipe.transformer), adapter_name="tiny")
    assert torch.equal(_run(pipe, SMALL), expected)
    assert all(is_omni_processor(p) for p in pipe.transformer.attn_processors.values())

    stock.fuse_lora()
    pipe.fuse_lora()
    assert torch.equal(_run(pipe, SMALL), _run(stock, SMALL))
    assert all(is_omni_processor(p) for p in pipe.transformer.attn_processors.values())


def test_unbound_placeholder_refuses_to_run():
    pipe = omnify(tiny_flux_pipeline(), "TORCH_SDPA")
    attn = pipe.transformer.single_transformer_blocks[0].attn
    attn.set_processor(OmniFluxAttnProcessor())
    with pytest.raises(RuntimeError, match="built without a backend"):
        attn(torch.zeros(1, 4, 32))
