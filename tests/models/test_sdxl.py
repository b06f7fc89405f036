import pytest
import torch
from diffusers import (
    StableDiffusionXLImg2ImgPipeline,
    StableDiffusionXLInpaintPipeline,
    StableDiffusionXLInstructPix2PixPipeline,
    StableDiffusionXLPAGPipeline,
)
from diffusers.models.attention_processor import (
    AttnProcessor2_0,
    PAGCFGIdentitySelfAttnProcessor2_0,
    PAGIdentitySelfAttnProcessor2_0,
    XFormersAttnProcessor,
)
from PIL import Image

import diffusers_omni
from diffusers_omni import omnify
from diffusers_omni.attention.backends.sdpa import backend as sdpa
from diffusers_omni.attention.backends.base import AttentionBackend
from diffusers_omni.attention.processors import is_omni_processor
from diffusers_omni.attention.registry import reset_backend
from diffusers_omni.models.base import blocks_attrs_for
from diffusers_omni.pipelines.sdxl import (
    OmniStableDiffusionXLImg2ImgPipeline,
    OmniStableDiffusionXLInpaintPipeline,
    OmniStableDiffusionXLInstructPix2PixPipeline,
    OmniStableDiffusionXLPAGPipeline,
    OmniStableDiffusionXLPipeline,
)
from diffusers_omni.testing.tiny_sdxl import tiny_sdxl_pipeline

from .harness import ModelCase, standard_tests

_PAG = (PAGIdentitySelfAttnProcessor2_0, PAGCFGIdentitySelfAttnProcessor2_0)
SMALL = {"prompt": "a red fox", "height": 32, "width": 32, "num_inference_steps": 2, "output_type": "latent"}
IMAGE = Image.new("RGB", (32, 32), (120, 60, 30))
MASK = Image.new("L", (32, 32), 255)
ROLES = {"sdxl.self": "self", "sdxl.cross": "cross"}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny models gain nothing from intra-op threads, and on a shared 2-core runner threads spin against other
    # processes: one thread runs these tests about five times faster there.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


CASES = [ModelCase("sdxl", tiny_sdxl_pipeline, OmniStableDiffusionXLPipeline, SMALL, ROLES, dits=("unet",))]

globals().update(standard_tests(CASES))


def _run(pipe, **call):
    return pipe(**{**SMALL, **call}, generator=torch.Generator().manual_seed(0)).images


def _attention_modules(model):
    return {name: module for name, module in model.named_modules() if hasattr(module, "set_processor")}


def test_mid_block_is_a_streamed_unit_between_down_and_up_blocks():
    assert blocks_attrs_for(tiny_sdxl_pipeline().unet) == ("down_blocks", "mid_block", "up_blocks")


@pytest.mark.parametrize(
    "pipeline_cls, omni_cls, call",
    [
        (StableDiffusionXLImg2ImgPipeline, OmniStableDiffusionXLImg2ImgPipeline, {"image": IMAGE, "strength": 0.9}),
        (
            StableDiffusionXLInpaintPipeline,
            OmniStableDiffusionXLInpaintPipeline,
            {"image": IMAGE, "mask_image": MASK, "strength": 0.9},
        ),
        (StableDiffusionXLInstructPix2PixPipeline, OmniStableDiffusionXLInstructPix2PixPipeline, {"image": IMAGE}),
    ],
    ids=["img2img", "inpaint", "instruct_pix2pix"],
)
def test_other_pipelines_bitwise_equal_to_stock(pipeline_cls, omni_cls, call):
    expected = _run(tiny_sdxl_pipeline(pipeline_cls=pipeline_cls), **call)
    pipe = omnify(tiny_sdxl_pipeline(pipeline_cls=pipeline_cls), "TORCH_SDPA")
    assert type(pipe) is omni_cls
    assert {entry["role"]: entry["category"] for entry in pipe.omni_attention_report()} == ROLES
    assert torch.equal(_run(pipe, **call), expected)


@pytest.mark.parametrize("guidance_scale", [5.0, 1.0], ids=["cfg", "no_cfg"])
def test_pag_layers_run_omni_processors_and_stay_applied(guidance_scale):
    """During a PAG call the mid block's self-attention runs an omni PAG processor, the output equals stock PAG,
    and afterwards omni attention is applied exactly as before the call."""
    call = {"guidance_scale": guidance_scale, "pag_scale": 3.0, "num_inference_steps": 1}
    layers = ["mid", "up"]
    expected = _run(tiny_sdxl_pipeline(pipeline_cls=StableDiffusionXLPAGPipeline, pag_applied_layers=layers), **call)
    pipe = tiny_sdxl_pipeline(pipeline_cls=StableDiffusionXLPAGPipeline, pag_applied_layers=layers)
    pipe = omnify(pipe, "TORCH_SDPA")
    assert type(pipe) is OmniStableDiffusionXLPAGPipeline and pipe.pag_applied_layers == layers
    before = pipe.omni_attention_report()
    stock = {name: module.processor.original for name, module in _attention_modules(pipe.unet).items()}

    during = {}
    handles = [
        module.register_forward_pre_hook(lambda mod, args, name=name: during.setdefault(name, mod.processor) and None)
        for name, module in _attention_modules(pipe.unet).items()
    ]
    try:
        assert torch.equal(_run(pipe, **call), expected)
    finally:
        for handle in handles:
            handle.remove()
    assert all(is_omni_processor(processor) for processor in during.values())
    pag = {name for name, processor in during.items() if isinstance(processor, _PAG)}
    assert pag == {name for name in during if name.endswith("attn1") and not name.startswith("down_blocks")}
    assert {isinstance(during[name], PAGCFGIdentitySelfAttnProcessor2_0) for name in pag} == {guidance_scale > 1}

    assert pipe.omni_attention_report() == before
    assert torch.equal(_run(pipe, **call), expected)
    pipe.disable_omni_attention()
    for name, module in _attention_modules(pipe.unet).items():
        assert module.processor is stock[name]
        assert type(module.processor) is AttnProcessor2_0


def _cross_attention_call(attn, mask):
    torch.manual_seed(0)
    hidden = torch.randn(2, 16, attn.to_q.in_features)
    context = torch.randn(2, 77, attn.to_k.in_features)
    return attn(hidden, encoder_hidden_states=context, attention_mask=mask)


def test_boolean_padding_mask_reaches_the_backend_and_all_true_is_dropped(monkeypatch):
    calls = []
    original = sdpa.sdpa_bshd

    def spy(query, key, value, attn_mask=None, *args, **kwargs):
        calls.append(attn_mask)
        return original(query, key, value, attn_mask, *args, **kwargs)

    monkeypatch.setattr(sdpa, "sdpa_bshd", spy)
    stock_pipe = tiny_sdxl_pipeline()
    stock_attn = stock_pipe.unet.mid_block.attentions[0].transformer_blocks[0].attn2
    padding = torch.ones(2, 1, 77, dtype=torch.bool)
    padding[:, :, 40:] = False
    expected_padded = _cross_attention_call(stock_attn, padding)
    expected_plain = _cross_attention_call(stock_attn, None)

    pipe = omnify(tiny_sdxl_pipeline(), "TORCH_SDPA")
    attn = pipe.unet.mid_block.attentions[0].transformer_blocks[0].attn2
    assert torch.equal(_cross_attention_call(attn, padding), expected_padded)
    mask = calls[-1]
    assert mask.dtype == torch.bool and mask.shape == (2, attn.heads, 1, 77)
    assert torch.equal(mask, padding[:, None].expand(2, attn.heads, 1, 77))

    assert torch.equal(_cross_attention_call(attn, torch.ones(2, 1, 77, dtype=torch.bool)), expected_plain)
    assert calls[-1] is None


class MaskLessBackend(AttentionBackend):
    name = "SDXL_TEST_MASKLESS"
    devices = frozenset({"cpu"})
    supports_mask = False

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return sdpa.sdpa_bshd(query, key, value, None, dropout_p, is_causal, scale, enable_gqa)


def test_maskless_backend_runs_the_mask_free_pipeline_but_refuses_a_mask_by_role():
    diffusers_omni.register_backend(MaskLessBackend.name, MaskLessBackend)
    try:
        expected = _run(tiny_sdxl_pipeline(), num_inference_steps=1)
        pipe = omnify(tiny_sdxl_pipeline(), MaskLessBackend.name)
        assert {entry["backend"] for entry in pipe.omni_attention_report()} == {MaskLessBackend.name}
        assert torch.equal(_run(pipe, num_inference_steps=1), expected)
        attn = pipe.unet.mid_block.attentions[0].transformer_blocks[0].attn2
        padding = torch.ones(2, 1, 77, dtype=torch.bool)
        padding[:, :, 40:] = False
        with pytest.raises(ValueError, match="sdxl.cross"):
            _cross_attention_call(attn, padding)
    finally:
        reset_backend(MaskLessBackend.name)


def test_unknown_processor_swap_raises_naming_the_module():
    pipe = omnify(tiny_sdxl_pipeline(), "TORCH_SDPA")
    attn = pipe.unet.mid_block.attentions[0].transformer_blocks[0].attn2
    attn.set_processor(XFormersAttnProcessor())
    module = r"mid_block\.attentions\.0\.transformer_blocks\.0\.attn2"
    with pytest.raises(TypeError, match=module + ".*XFormersAttnProcessor"):
        _run(pipe, num_inference_steps=1)


def test_every_sdxl_pipeline_has_its_omni_class():
    import diffusers

    from diffusers_omni.pipelines import sdxl
    from diffusers_omni.pipelines.registry import omni_pipeline_class

    for name in ("", "Img2Img", "Inpaint", "InstructPix2Pix", "PAG", "PAGImg2Img", "PAGInpaint"):
        stock = getattr(diffusers, f"StableDiffusionXL{name}Pipeline")
        omni = omni_pipeline_class(stock)
        assert omni is getattr(sdxl, f"OmniStableDiffusionXL{name}Pipeline")
        assert omni._omni_family == "sdxl" and omni._dit_modules == ("unet",)
