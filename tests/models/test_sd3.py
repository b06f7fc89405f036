import pytest
import torch
from diffusers import StableDiffusion3Img2ImgPipeline, StableDiffusion3InpaintPipeline, StableDiffusion3PAGPipeline
from diffusers.models.attention_processor import (
    JointAttnProcessor2_0,
    PAGCFGJointAttnProcessor2_0,
    PAGJointAttnProcessor2_0,
    XFormersJointAttnProcessor,
)
from PIL import Image

import diffusers_omni
from diffusers_omni import omnify
from diffusers_omni.attention.backends.sdpa import backend as sdpa
from diffusers_omni.attention.backends.base import AttentionBackend
from diffusers_omni.attention.processors import is_omni_processor
from diffusers_omni.attention.registry import reset_backend
from diffusers_omni.pipelines.sd3 import (
    OmniStableDiffusion3Img2ImgPipeline,
    OmniStableDiffusion3InpaintPipeline,
    OmniStableDiffusion3PAGPipeline,
    OmniStableDiffusion3Pipeline,
)
from diffusers_omni.testing.tiny_sd3 import tiny_sd3_pipeline

from .harness import ModelCase, standard_tests

_PAG = (PAGJointAttnProcessor2_0, PAGCFGJointAttnProcessor2_0)
SMALL = {
    "prompt": "a red fox",
    "height": 32,
    "width": 32,
    "num_inference_steps": 2,
    "output_type": "latent",
    "max_sequence_length": 16,
}
IMAGE = Image.new("RGB", (32, 32), (120, 60, 30))
MASK = Image.new("L", (32, 32), 255)
SD35 = {"sd3.joint": "self", "sd3.image_self": "self"}
PAG_LAYERS = ["blocks.1"]  # an ordinary joint block (block 0 is the dual-attention one)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny models gain nothing from intra-op threads, and on a shared 2-core runner threads spin against other
    # processes: one thread runs these tests about five times faster there.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pag_pipeline(pipeline_cls=StableDiffusion3PAGPipeline, layers=PAG_LAYERS):
    return tiny_sd3_pipeline(pipeline_cls=pipeline_cls, pag_applied_layers=layers)


CASES = [ModelCase("sd35_medium", tiny_sd3_pipeline, OmniStableDiffusion3Pipeline, SMALL, SD35)]

globals().update(standard_tests(CASES))


def _run(pipe, **call):
    return pipe(**{**SMALL, **call}, generator=torch.Generator().manual_seed(0)).images


def _attention_modules(model):
    return {name: module for name, module in model.named_modules() if hasattr(module, "set_processor")}


def test_sd3_medium_has_only_joint_attention():
    pipe = omnify(tiny_sd3_pipeline(sd35_medium=False), "TORCH_SDPA")
    report = pipe.omni_attention_report()
    assert {entry["module"] for entry in report} == {f"transformer.transformer_blocks.{i}.attn" for i in range(3)}
    assert {entry["role"] for entry in report} == {"sd3.joint"}


@pytest.mark.parametrize(
    "pipeline_cls, omni_cls, call",
    [
        (StableDiffusion3Img2ImgPipeline, OmniStableDiffusion3Img2ImgPipeline, {"image": IMAGE}),
        (StableDiffusion3InpaintPipeline, OmniStableDiffusion3InpaintPipeline, {"image": IMAGE, "mask_image": MASK}),
    ],
    ids=["img2img", "inpaint"],
)
def test_img2img_and_inpaint_bitwise_equal_to_stock(pipeline_cls, omni_cls, call):
    call = {**call, "strength": 0.9, "num_inference_steps": 2}
    expected = _run(tiny_sd3_pipeline(pipeline_cls=pipeline_cls), **call)
    pipe = omnify(tiny_sd3_pipeline(pipeline_cls=pipeline_cls), "TORCH_SDPA")
    assert type(pipe) is omni_cls
    assert torch.equal(_run(pipe, **call), expected)


@pytest.mark.parametrize("guidance_scale", [5.0, 1.0], ids=["cfg", "no_cfg"])
def test_pag_layers_run_omni_processors_and_stay_applied(guidance_scale):
    """During a PAG call the PAG layer runs an omni PAG processor (identity role on the perturbed half), the
    output equals stock PAG, and afterwards omni attention is applied exactly as before the call."""
    call = {"guidance_scale": guidance_scale, "pag_scale": 3.0, "num_inference_steps": 1}
    expected = _run(pag_pipeline(), **call)
    pipe = omnify(pag_pipeline(), "TORCH_SDPA")
    assert type(pipe) is OmniStableDiffusion3PAGPipeline
    before = pipe.omni_attention_report()
    stock = {name: module.processor.original for name, module in _attention_modules(pipe.transformer).items()}

    during = {}
    handles = [
        module.register_forward_pre_hook(lambda mod, args, name=name: during.setdefault(name, mod.processor) and None)
        for name, module in _attention_modules(pipe.transformer).items()
    ]
    try:
        assert torch.equal(_run(pipe, **call), expected)
    finally:
        for handle in handles:
            handle.remove()
    assert all(is_omni_processor(processor) for processor in during.values())
    pag = during["transformer_blocks.1.attn"]
    assert isinstance(pag, _PAG) and isinstance(pag, PAGCFGJointAttnProcessor2_0) == (guidance_scale > 1)
    assert set(pag.attend) == {"sd3.joint", "sd3.pag_identity"}

    assert pipe.omni_attention_report() == before
    assert torch.equal(_run(pipe, **call), expected)
    pipe.disable_omni_attention()
    for name, module in _attention_modules(pipe.transformer).items():
        assert module.processor is stock[name]
        assert type(module.processor) is JointAttnProcessor2_0


def test_pag_perturbed_path_passes_its_identity_mask_to_the_backend(monkeypatch):
    calls = []
    original = sdpa.sdpa_bshd

    def spy(query, key, value, attn_mask=None, *args, **kwargs):
        calls.append((query.shape, None if attn_mask is None else attn_mask.clone()))
        return original(query, key, value, attn_mask, *args, **kwargs)

    monkeypatch.setattr(sdpa, "sdpa_bshd", spy)
    pipe = omnify(pag_pipeline(), "TORCH_SDPA")
    _run(pipe, guidance_scale=1.0, pag_scale=3.0, num_inference_steps=1)
    masks = [mask for _, mask in calls if mask is not None]
    assert len(masks) == 1  # one PAG layer, one step
    image_len = (32 // 2 // 2) ** 2
    mask = masks[0][0, 0]
    text_len = 77 + 16  # CLIP tokens, then T5 tokens (max_sequence_length)
    assert mask.dtype == torch.float32 and mask.shape == (image_len + text_len, image_len + text_len)
    expected = torch.zeros_like(mask)
    expected[:image_len, :image_len] = float("-inf")
    expected[:image_len, :image_len].fill_diagonal_(0)
    assert torch.equal(mask, expected)
    # every other call (4 attention modules, batch halves of the PAG layer) is unmasked
    assert len(calls) - len(masks) == 4


class MaskLessBackend(AttentionBackend):
    name = "SD3_TEST_MASKLESS"
    devices = frozenset({"cpu"})
    supports_mask = False

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return sdpa.sdpa_bshd(query, key, value, None, dropout_p, is_causal, scale, enable_gqa)


@pytest.fixture
def maskless_backend():
    diffusers_omni.register_backend(MaskLessBackend.name, MaskLessBackend)
    try:
        yield MaskLessBackend.name
    finally:
        reset_backend(MaskLessBackend.name)


def test_maskless_backend_refused_at_enable_for_the_pag_identity_role(maskless_backend):
    # SD3's own roles are unmasked: a mask-less backend is fine without PAG.
    plain = omnify(tiny_sd3_pipeline(), maskless_backend)
    assert {entry["backend"] for entry in plain.omni_attention_report()} == {maskless_backend}

    pipe = pag_pipeline()
    with pytest.raises(Exception, match="sd3.pag_identity"):
        omnify(pipe, maskless_backend)
    assert not any(is_omni_processor(m.processor) for m in _attention_modules(pipe.transformer).values())

    # Routing only the identity role to a mask-capable backend works.
    config = {"default": {"backend": maskless_backend}, "per_role": {"sd3.pag_identity": "TORCH_SDPA"}}
    pipe = omnify(pag_pipeline(), config)
    assert {entry["backend"] for entry in pipe.omni_attention_report()} == {maskless_backend}
    _run(pipe, guidance_scale=1.0, pag_scale=3.0, num_inference_steps=1)


def test_from_pipe_keeps_pag_applied_layers():
    pipe = omnify(pag_pipeline(layers=["blocks.2"]), "TORCH_SDPA")
    assert pipe.pag_applied_layers == ["blocks.2"]


def test_pag_on_a_dual_attention_block_raises_naming_the_module():
    pipe = omnify(pag_pipeline(layers=["blocks.0"]), "TORCH_SDPA")
    with pytest.raises(ValueError, match=r"transformer_blocks\.0\.attn2.*dual_attention_layers"):
        _run(pipe, guidance_scale=1.0, pag_scale=3.0, num_inference_steps=1)
    # the failed call leaves omni attention applied, PAG processors gone
    assert all(is_omni_processor(m.processor) for m in _attention_modules(pipe.transformer).values())
    modules = _attention_modules(pipe.transformer).values()
    assert not any(isinstance(module.processor, _PAG) for module in modules)


def test_attention_mask_is_never_dropped_silently():
    # Diffusers' JointAttnProcessor2_0 ignores a mask without a word; the omni processor refuses it.
    pipe = omnify(tiny_sd3_pipeline(), "TORCH_SDPA")
    mask = torch.ones(1, 64 + 16, dtype=torch.bool)
    with pytest.raises(ValueError, match="attention_mask"):
        _run(pipe, guidance_scale=1.0, joint_attention_kwargs={"attention_mask": mask}, num_inference_steps=1)


def test_unknown_processor_swap_raises_naming_the_module():
    pipe = omnify(tiny_sd3_pipeline(), "TORCH_SDPA")
    attn = pipe.transformer.transformer_blocks[1].attn
    attn.set_processor(XFormersJointAttnProcessor())
    with pytest.raises(TypeError, match=r"transformer_blocks\.1\.attn.*XFormersJointAttnProcessor"):
        _run(pipe, num_inference_steps=1)


def test_every_sd3_pipeline_has_its_omni_class():
    import diffusers

    from diffusers_omni.pipelines import sd3
    from diffusers_omni.pipelines.registry import omni_pipeline_class

    for name in ("", "Img2Img", "Inpaint", "PAG", "PAGImg2Img"):
        stock = getattr(diffusers, f"StableDiffusion3{name}Pipeline")
        omni = omni_pipeline_class(stock)
        assert omni is getattr(sd3, f"OmniStableDiffusion3{name}Pipeline")
        assert omni._omni_family == "sd3" and omni._dit_modules == ("transformer",)


def test_pag_pipeline_parses_the_attention_config_once_for_planning_and_install(monkeypatch):
    from diffusers_omni.attention.plan import AttentionPlan

    parses = []
    build = AttentionPlan.build.__func__

    def counting(cls, config=None, platform=None):
        if not isinstance(config, AttentionPlan):
            parses.append(config)
        return build(cls, config, platform)

    pipe = omnify(pag_pipeline(), "TORCH_SDPA")
    monkeypatch.setattr(AttentionPlan, "build", classmethod(counting))
    report = pipe.enable_omni_attention({"default": "TORCH_SDPA", "per_role": {"sd3.pag_identity": "TORCH_SDPA"}})
    # One parse: PAG's roles are planned (twice: with and without guidance) and installed from the same plan.
    assert parses == [{"default": "TORCH_SDPA", "per_role": {"sd3.pag_identity": "TORCH_SDPA"}}]
    assert {e["role"] for e in report} == {"sd3.joint", "sd3.image_self"}
