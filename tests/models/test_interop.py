"""Diffusers features with omni attention on, family by family (no offload): saving and loading under Diffusers'
names, class resolution by name, signatures, processor round trips, fused QKV, attention slicing, default
processors, IP-Adapter, caches, layerwise casting and ``torch.compile``. Where a feature works, the output is
bitwise equal to stock Diffusers doing the same thing (``TORCH_SDPA``)."""

from __future__ import annotations

import ast
import inspect
import json
import subprocess
import sys
import textwrap

import diffusers
import diffusers.pipelines
import pytest
import torch
from diffusers import DiffusionPipeline
from diffusers.models.attention_processor import (
    AttnProcessor,
    AttnProcessor2_0,
    FusedAttnProcessor2_0,
    FusedJointAttnProcessor2_0,
    IPAdapterAttnProcessor2_0,
    JointAttnProcessor2_0,
    SD3IPAdapterJointAttnProcessor2_0,
    SlicedAttnProcessor,
)

from diffusers_omni import omnify
from diffusers_omni.attention.processors import is_omni_processor, routed_processor_class
from diffusers_omni.pipelines.mixin import diffusers_pipeline_class
from diffusers_omni.pipelines.registry import omni_pipelines
from diffusers_omni.testing.tiny_sd3 import tiny_sd3_ip_adapter_state_dict, tiny_sd3_pipeline
from diffusers_omni.testing.tiny_sdxl import tiny_sdxl_ip_adapter_state_dict, tiny_sdxl_pipeline

from . import (
    test_chroma,
    test_cosmos3,
    test_flux2,
    test_flux_wan,
    test_hunyuanvideo15,
    test_longcat,
    test_ltx2,
    test_ovis,
    test_qwenimage,
    test_sd3,
    test_sdxl,
    test_zimage,
)
from .harness import ModelCase

# One pipeline per family: its first case.
FAMILIES: dict[str, ModelCase] = {
    case.id: case
    for case in (
        test_flux_wan.CASES[0],
        test_flux_wan.CASES[1],
        test_flux2.CASES[0],
        test_chroma.CASES[0],
        test_sd3.CASES[0],
        test_sdxl.CASES[0],
        test_qwenimage.CASES[0],
        test_zimage.CASES[0],
        test_longcat.CASES[0],
        test_ovis.CASES[0],
        test_hunyuanvideo15.CASES[0],
        test_ltx2.CASES[0],
        test_cosmos3.CASE,
    )
}


def _dit(pipe, case: ModelCase) -> torch.nn.Module:
    return getattr(pipe, case.dits[0])


DIT_CLASSES = {
    "flux": diffusers.FluxTransformer2DModel,
    "wan": diffusers.WanTransformer3DModel,
    "klein": diffusers.Flux2Transformer2DModel,
    "chroma": diffusers.ChromaTransformer2DModel,
    "sd35_medium": diffusers.SD3Transformer2DModel,
    "sdxl": diffusers.UNet2DConditionModel,
    "qwenimage": diffusers.QwenImageTransformer2DModel,
    "zimage": diffusers.ZImageTransformer2DModel,
    "longcat": diffusers.LongCatImageTransformer2DModel,
    "ovis": diffusers.OvisImageTransformer2DModel,
    "hunyuanvideo15": diffusers.HunyuanVideo15Transformer3DModel,
    "ltx2": diffusers.LTX2VideoTransformer3DModel,
    "cosmos3": diffusers.Cosmos3OmniTransformer,
}


def _dits_with(pipe, case: ModelCase, method: str) -> list[torch.nn.Module]:
    """The pipeline's declared DiTs that have ``method`` (LTX-2's text connectors, a DiT for omni attention, are
    not a Diffusers transformer with the full model API)."""
    return [getattr(pipe, dit) for dit in case.dits if hasattr(getattr(pipe, dit), method)]


def _families_where(check) -> list[str]:
    """Families whose DiT class has what ``check(model_class)`` asks for."""
    return [name for name in FAMILIES if check(DIT_CLASSES[name])]


def _stock_and_omni(case: ModelCase, feature) -> tuple[torch.Tensor, object]:
    """Stock Diffusers output with ``feature(pipe)`` applied, and an omnified pipeline with the same feature."""
    stock = case.factory()
    feature(stock)
    expected = case.run(stock)
    pipe = omnify(case.factory(), "TORCH_SDPA")
    feature(pipe)
    return expected, pipe


def _all_omni(model: torch.nn.Module) -> bool:
    processors = [m.processor for m in model.modules() if hasattr(m, "set_processor")]
    return bool(processors) and all(is_omni_processor(p) for p in processors)


# Saving and loading ------------------------------------------------------------------------------------------------


# The tiny LongCat pipeline's text processor is a test-only class that transformers cannot save (stock fails alike).
SAVABLE = [family for family in FAMILIES if family != "longcat"]


@pytest.mark.parametrize("family", SAVABLE)
def test_save_pretrained_loads_with_diffusers_and_with_the_omni_class(family, tmp_path):
    case = FAMILIES[family]
    pipe = omnify(case.factory(), "TORCH_SDPA")
    base = diffusers_pipeline_class(case.omni_cls)
    pipe.save_pretrained(tmp_path)

    assert json.loads((tmp_path / "model_index.json").read_text())["_class_name"] == base.__name__
    stock = DiffusionPipeline.from_pretrained(tmp_path)
    assert type(stock) is base
    loaded = case.omni_cls.from_pretrained(tmp_path)
    assert type(loaded) is case.omni_cls
    for dit in case.dits:
        saved = getattr(pipe, dit).state_dict()
        for name, tensor in getattr(loaded, dit).state_dict().items():
            assert torch.equal(tensor, saved[name]), name
    for component in (*stock.components.values(), *loaded.components.values()):
        if isinstance(component, torch.nn.Module):
            component.eval()
    loaded.enable_omni_attention("TORCH_SDPA")
    assert torch.equal(case.run(loaded), case.run(stock))


def test_saved_omni_pipeline_loads_with_plain_diffusers_in_a_fresh_process(tmp_path):
    for family in ("flux", "sdxl"):
        omnify(FAMILIES[family].factory(), "TORCH_SDPA").save_pretrained(tmp_path / family)
    code = textwrap.dedent(
        f"""
        import sys
        from diffusers import DiffusionPipeline
        for family in ("flux", "sdxl"):
            print(type(DiffusionPipeline.from_pretrained({str(tmp_path)!r} + "/" + family)).__name__)
        print(any(name.startswith("diffusers_omni") for name in sys.modules))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["FluxPipeline", "StableDiffusionXLPipeline", "False"]


def test_model_index_naming_an_omni_class_loads_it(tmp_path):
    """Directories saved by earlier versions name the Omni class; Diffusers resolves it by name once defined."""
    case = FAMILIES["flux"]
    case.factory().save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    index["_class_name"] = case.omni_cls.__name__
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    assert type(DiffusionPipeline.from_pretrained(tmp_path)) is case.omni_cls


def test_every_omni_class_resolves_by_name_where_diffusers_looks():
    """``DiffusionPipeline.from_pretrained`` resolves ``getattr(diffusers, name)``; Diffusers' test helpers
    (``encode_prompt`` isolation) read the source of ``getattr(diffusers.pipelines, name).encode_prompt``."""
    classes = omni_pipelines()
    assert classes
    for cls in classes.values():
        assert getattr(diffusers, cls.__name__) is cls
        assert getattr(diffusers.pipelines, cls.__name__) is cls
        if hasattr(cls, "encode_prompt"):
            source = inspect.getsource(getattr(getattr(diffusers.pipelines, cls.__name__), "encode_prompt"))
            assert isinstance(ast.parse(textwrap.dedent(source)), ast.Module)
    # Omni names never shadow a Diffusers name.
    assert all(not name.startswith("Omni") for name in classes)


def test_every_omni_class_keeps_the_diffusers_signatures():
    mismatches = []
    for name, cls in omni_pipelines().items():
        base = diffusers_pipeline_class(cls)
        assert base.__name__ == name
        for attr in ("__call__", "__init__", "encode_prompt"):
            if hasattr(base, attr) and inspect.signature(getattr(cls, attr)) != inspect.signature(getattr(base, attr)):
                mismatches.append(f"{cls.__name__}.{attr}")
    assert mismatches == []


def test_pag_call_keeps_name_and_docstring():
    from diffusers import StableDiffusionXLPAGPipeline

    from diffusers_omni.pipelines.sdxl import OmniStableDiffusionXLPAGPipeline

    assert OmniStableDiffusionXLPAGPipeline.__call__.__doc__ == StableDiffusionXLPAGPipeline.__call__.__doc__
    assert "guidance_scale" in inspect.signature(OmniStableDiffusionXLPAGPipeline.__call__).parameters


# Processor round trips, fused QKV ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", _families_where(lambda cls: hasattr(cls, "set_attn_processor")))
def test_set_attn_processor_round_trip_stays_omni(family):
    case = FAMILIES[family]

    def round_trip(pipe):
        for model in _dits_with(pipe, case, "set_attn_processor"):
            model.set_attn_processor(dict(model.attn_processors))

    expected, pipe = _stock_and_omni(case, round_trip)
    assert torch.equal(case.run(pipe), expected)
    assert _all_omni(_dit(pipe, case))


# LTX-2: Diffusers' own ``fuse_projections`` fails on its audio-video cross-attention (mismatched K/V widths).
FUSABLE = [f for f in _families_where(lambda cls: hasattr(cls, "fuse_qkv_projections")) if f != "ltx2"]


@pytest.mark.parametrize("family", FUSABLE)
def test_fuse_qkv_projections_bitwise_equal_to_stock_fused(family):
    case = FAMILIES[family]
    if family == "sd35_medium":
        # Diffusers' FusedJointAttnProcessor2_0 fails on SD3.5-Medium's image-only attn2 (see the test below).
        case = ModelCase(
            family, lambda pipeline_cls=None: tiny_sd3_pipeline(sd35_medium=False), case.omni_cls, case.call, case.roles
        )

    def fuse(pipe):
        for model in _dits_with(pipe, case, "fuse_qkv_projections"):
            model.fuse_qkv_projections()

    expected, pipe = _stock_and_omni(case, fuse)
    assert torch.equal(case.run(pipe), expected)
    assert _all_omni(_dit(pipe, case))
    if hasattr(_dit(pipe, case), "unfuse_qkv_projections"):
        stock = case.factory()
        fuse(stock)
        for model in (_dit(stock, case), _dit(pipe, case)):
            model.unfuse_qkv_projections()
        assert torch.equal(case.run(pipe), case.run(stock))
        assert _all_omni(_dit(pipe, case))


@pytest.mark.parametrize("family", ["sdxl", "sd3"])
def test_fused_processors_use_the_fused_projections(family):
    if family == "sdxl":
        pipe = omnify(tiny_sdxl_pipeline(), "TORCH_SDPA")
        model, call = pipe.unet, test_sdxl.SMALL
        attn = model.mid_block.attentions[0].transformer_blocks[0].attn1
    else:
        pipe = omnify(tiny_sd3_pipeline(sd35_medium=False), "TORCH_SDPA")
        model, call = pipe.transformer, test_sd3.SMALL
        attn = model.transformer_blocks[0].attn
    model.fuse_qkv_projections()
    calls = {"to_q": 0, "to_qkv": 0}
    handles = [
        getattr(attn, name).register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
        for name in calls
    ]
    try:
        pipe(**{**call, "num_inference_steps": 1}, generator=torch.Generator().manual_seed(0))
    finally:
        for handle in handles:
            handle.remove()
    assert calls["to_qkv"] > 0 and calls["to_q"] == 0
    assert is_omni_processor(attn.processor)
    assert isinstance(attn.processor, (FusedAttnProcessor2_0, FusedJointAttnProcessor2_0))


def test_sd35_medium_fused_image_attention_runs_where_diffusers_fails():
    stock = tiny_sd3_pipeline()
    stock.transformer.fuse_qkv_projections()
    with pytest.raises(AttributeError):
        test_sd3._run(stock, num_inference_steps=1)
    pipe = omnify(tiny_sd3_pipeline(), "TORCH_SDPA")
    pipe.transformer.fuse_qkv_projections()
    out = test_sd3._run(pipe, num_inference_steps=1)
    assert torch.isfinite(out).all()
    # Diffusers' fused processor needs text tokens: JointAttnProcessor2_0's code runs for it there.
    attn2 = pipe.transformer.transformer_blocks[0].attn2.processor
    assert type(attn2) is routed_processor_class(JointAttnProcessor2_0)
    assert type(attn2.original) is FusedJointAttnProcessor2_0


# SDXL: default processors, attention slicing, IP-Adapter ----------------------------------------------------------

SDXL = FAMILIES["sdxl"]


def test_set_default_attn_processor_removes_omni_and_matches_stock_including_the_shared_original():
    expected, _ = _stock_and_omni(SDXL, lambda pipe: pipe.unet.set_default_attn_processor())
    original = tiny_sdxl_pipeline()
    pipe = omnify(original, "TORCH_SDPA")
    original.unet.set_default_attn_processor()  # the user's original pipeline shares the UNet
    assert {type(p) for p in pipe.unet.attn_processors.values()} == {AttnProcessor}
    assert pipe.omni_attention_report() == []
    assert "set_default_attn_processor" not in pipe.unet.__dict__
    assert torch.equal(SDXL.run(pipe), expected)
    assert torch.equal(SDXL.run(original), expected)


def test_unet_on_the_classic_processor_can_be_omnified_and_restored():
    stock = tiny_sdxl_pipeline()
    expected = SDXL.run(stock)  # AttnProcessor2_0: the attention omni's TORCH_SDPA runs
    classic = tiny_sdxl_pipeline()
    classic.unet.set_default_attn_processor()
    originals = dict(classic.unet.attn_processors)
    pipe = omnify(classic, "TORCH_SDPA")
    assert _all_omni(pipe.unet)
    assert torch.equal(SDXL.run(pipe), expected)
    pipe.disable_omni_attention()
    assert all(pipe.unet.attn_processors[name] is processor for name, processor in originals.items())


@pytest.mark.parametrize("slice_size", [1, "max", "auto"])
def test_attention_slicing_runs_sliced_through_the_backend(slice_size):
    expected = SDXL.run(tiny_sdxl_pipeline())
    stock = tiny_sdxl_pipeline()
    stock.enable_attention_slicing(slice_size)
    stock_sliced = SDXL.run(stock)

    pipe = omnify(tiny_sdxl_pipeline(), "TORCH_SDPA")
    pipe.enable_attention_slicing(slice_size)
    attn = pipe.unet.mid_block.attentions[0].transformer_blocks[0].attn1
    calls = []
    out = SDXL.run(pipe)  # re-applies omni over the sliced processors
    processor = attn.processor
    assert type(processor) is routed_processor_class(AttnProcessor2_0)
    assert isinstance(processor.original, SlicedAttnProcessor)
    (attention,) = processor.attend.values()
    backend = attention.backend
    attention.backend = lambda q, *rest: calls.append(q.shape) or backend(q, *rest)
    try:
        again = SDXL.run(pipe)
    finally:
        attention.backend = backend
    # Slices of ``slice_size`` batch × head rows, one head each, as Diffusers slices.
    rows = 2 * attn.heads  # classifier-free guidance doubles the batch
    assert len(calls) == 2 * -(-rows // processor.slice_size)  # two steps
    assert all(shape[0] <= processor.slice_size and shape[2] == 1 for shape in calls)
    # TORCH_SDPA per slice gives the unsliced SDPA result; Diffusers' sliced path is the explicit softmax.
    assert torch.equal(out, expected) and torch.equal(again, expected)
    torch.testing.assert_close(out, stock_sliced, rtol=1e-4, atol=1e-4)

    pipe.disable_attention_slicing()
    assert torch.equal(SDXL.run(pipe), expected)
    assert type(attn.processor.original) is AttnProcessor2_0


def _sdxl_ip_call(embeds):
    return {**SDXL.call, "ip_adapter_image_embeds": [embeds]}


def _load_sdxl_ip_adapter(pipe):
    pipe.load_ip_adapter(
        tiny_sdxl_ip_adapter_state_dict(pipe.unet), subfolder="", weight_name="", image_encoder_folder=None
    )


def test_sdxl_ip_adapter_loads_through_omni_attention_with_its_role():
    embeds = torch.randn(2, 1, 8, generator=torch.Generator().manual_seed(3))  # [negative | positive]
    stock = tiny_sdxl_pipeline()
    _load_sdxl_ip_adapter(stock)
    expected = stock(**_sdxl_ip_call(embeds), generator=torch.Generator().manual_seed(0)).images
    assert not torch.equal(expected, SDXL.run(tiny_sdxl_pipeline()))  # the adapter does contribute

    pipe = omnify(tiny_sdxl_pipeline(), "TORCH_SDPA")
    _load_sdxl_ip_adapter(pipe)  # Diffusers re-creates the current processor classes with no arguments
    out = pipe(**_sdxl_ip_call(embeds), generator=torch.Generator().manual_seed(0)).images
    assert torch.equal(out, expected)
    cross = pipe.unet.mid_block.attentions[0].transformer_blocks[0].attn2
    assert isinstance(cross.processor, IPAdapterAttnProcessor2_0) and is_omni_processor(cross.processor)
    assert {e["role"] for e in pipe.omni_attention_report()} == {"sdxl.self", "sdxl.cross", "sdxl.ip_adapter"}

    for target in (stock, pipe):
        target.set_ip_adapter_scale(0.4)
    assert cross.processor.original.scale == [0.4]
    run = lambda p: p(**_sdxl_ip_call(embeds), generator=torch.Generator().manual_seed(0)).images  # noqa: E731
    assert torch.equal(run(pipe), run(stock))

    for target in (stock, pipe):
        target.unload_ip_adapter()
    assert torch.equal(SDXL.run(pipe), SDXL.run(stock))
    assert {e["role"] for e in pipe.omni_attention_report()} == {"sdxl.self", "sdxl.cross"}
    assert _all_omni(pipe.unet)


def test_sdxl_ip_adapter_loaded_before_omnify_and_restored_on_disable():
    stock = tiny_sdxl_pipeline()
    _load_sdxl_ip_adapter(stock)
    cross = stock.unet.mid_block.attentions[0].transformer_blocks[0].attn2
    ip_processor = cross.processor
    keys = set(stock.unet.state_dict())
    pipe = omnify(stock, "TORCH_SDPA")
    assert isinstance(cross.processor, IPAdapterAttnProcessor2_0) and is_omni_processor(cross.processor)
    assert set(pipe.unet.state_dict()) == keys  # the adapter weights keep their keys, once
    pipe.disable_omni_attention()
    assert cross.processor is ip_processor


# SD3: IP-Adapter -----------------------------------------------------------------------------------------------


def test_sd3_ip_adapter_loads_through_omni_attention_with_its_role():
    embeds = torch.randn(2, 1, 8, generator=torch.Generator().manual_seed(3))

    def run(pipe, **call):
        return test_sd3._run(pipe, **call)

    def load(pipe):
        pipe.load_ip_adapter(tiny_sd3_ip_adapter_state_dict(pipe.transformer), image_encoder_folder=None)

    stock = tiny_sd3_pipeline(sd35_medium=False)
    load(stock)
    expected = run(stock, ip_adapter_image_embeds=embeds)
    assert not torch.equal(expected, run(tiny_sd3_pipeline(sd35_medium=False)))

    pipe = omnify(tiny_sd3_pipeline(sd35_medium=False), "TORCH_SDPA")
    load(pipe)
    assert torch.equal(run(pipe, ip_adapter_image_embeds=embeds), expected)
    assert pipe.is_ip_adapter_active  # Diffusers finds the omni processor by isinstance
    assert isinstance(pipe.transformer.transformer_blocks[0].attn.processor, SD3IPAdapterJointAttnProcessor2_0)
    assert {e["role"] for e in pipe.omni_attention_report()} == {"sd3.joint", "sd3.ip_adapter"}
    # The IP-Adapter's image projection keeps Diffusers' processors (it is not part of the DiT's blocks).
    assert not any(e["module"].startswith("transformer.image_proj") for e in pipe.omni_attention_report())

    for target in (stock, pipe):
        target.set_ip_adapter_scale(0.2)
    assert torch.equal(run(pipe, ip_adapter_image_embeds=embeds), run(stock, ip_adapter_image_embeds=embeds))
    for target in (stock, pipe):
        target.unload_ip_adapter()
    assert torch.equal(run(pipe), run(stock))
    assert {e["role"] for e in pipe.omni_attention_report()} == {"sd3.joint"}


# Caches, layerwise casting, torch.compile --------------------------------------------------------------------------


def _cache(config_factory):
    def enable(pipe, case):
        for model in _dits_with(pipe, case, "enable_cache"):
            model.enable_cache(config_factory())

    return enable


def _first_block_cache():
    from diffusers import FirstBlockCacheConfig

    return FirstBlockCacheConfig(threshold=0.2)


def _pyramid_attention_broadcast():
    from diffusers import PyramidAttentionBroadcastConfig

    return PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2,
        spatial_attention_timestep_skip_range=(-1, 1001),
        current_timestep_callback=lambda: 500,
    )


# Where Diffusers' own hooks run on the stock model (FirstBlockCache needs Diffusers to know the block class;
# Pyramid Attention Broadcast fails on LTX-2's audio attention in Diffusers itself).
CACHES = [
    ("first_block_cache", "flux", _first_block_cache),
    ("first_block_cache", "qwenimage", _first_block_cache),
    *[
        ("pyramid_attention_broadcast", family, _pyramid_attention_broadcast)
        for family in ("flux", "wan", "klein", "chroma", "qwenimage", "longcat", "ovis", "hunyuanvideo15", "cosmos3")
    ],
]


@pytest.mark.parametrize("cache, family, config", CACHES, ids=[f"{c}-{f}" for c, f, _ in CACHES])
def test_diffusers_cache_hooks_bitwise_equal_to_stock(cache, family, config):
    case = FAMILIES[family]
    enable = _cache(config)
    expected, pipe = _stock_and_omni(case, lambda pipe: enable(pipe, case))
    assert torch.equal(case.run(pipe), expected)
    assert _all_omni(_dit(pipe, case))


@pytest.mark.parametrize("family", FAMILIES)
def test_layerwise_casting_bitwise_equal_to_stock(family):
    case = FAMILIES[family]

    def cast(pipe):
        for dit in case.dits:
            getattr(pipe, dit).enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)

    expected, pipe = _stock_and_omni(case, cast)
    assert torch.equal(case.run(pipe), expected)
    assert not torch.equal(expected, case.run(case.factory()))  # the storage dtype does round the weights


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_compile_bitwise_equal_to_stock(family):
    case = FAMILIES[family]

    def compile_dits(pipe):
        for dit in case.dits:
            getattr(pipe, dit).compile(backend="eager")

    torch._dynamo.reset()
    expected, pipe = _stock_and_omni(case, compile_dits)
    assert torch.equal(case.run(pipe), expected)
    assert _all_omni(_dit(pipe, case))


def _faster_cache(pipe, timestep_skip_range=(-1, 999)):
    from diffusers import FasterCacheConfig

    # FLUX.1 [dev]-style pipelines are guidance-distilled (one batch, no unconditional branch to skip).
    pipe.transformer.enable_cache(FasterCacheConfig(
        spatial_attention_block_skip_range=2,
        spatial_attention_timestep_skip_range=timestep_skip_range,
        current_timestep_callback=lambda: pipe.current_timestep,
        attention_weight_callback=lambda _: 0.5,
        is_guidance_distilled=True,
        tensor_format="BFCHW",
    ))


def test_faster_cache_bitwise_equal_to_stock():
    case = FAMILIES["flux"]
    expected, pipe = _stock_and_omni(case, _faster_cache)
    assert torch.equal(case.run(pipe), expected)
    assert _all_omni(_dit(pipe, case))
    assert not torch.equal(expected, case.run(case.factory()))  # the cache did skip attention


def test_faster_cache_skipping_the_first_step_fails_in_diffusers_and_omni_alike():
    # Diffusers' FasterCacheBlockHook skips attention at iteration 0 when the first timestep lies inside
    # spatial_attention_timestep_skip_range and is_guidance_distilled=True, before anything is cached.
    case = FAMILIES["flux"]
    for pipe in (case.factory(), omnify(case.factory(), "TORCH_SDPA")):
        _faster_cache(pipe, timestep_skip_range=(-1, 1001))
        with pytest.raises(TypeError, match="'NoneType' object is not subscriptable"):
            case.run(pipe)


# Quantization configs and device_map at load time -------------------------------------------------------------------


@pytest.fixture
def saved_flux(tmp_path):
    FAMILIES["flux"].factory().save_pretrained(tmp_path)
    return tmp_path


def _load_flux(folder, **kwargs):
    pipe = DiffusionPipeline.from_pretrained(folder, **kwargs)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.eval()
    return pipe


def test_torchao_quantization_config_at_load_bitwise_equal_to_stock(saved_flux):
    from diffusers import PipelineQuantizationConfig, TorchAoConfig
    from torchao.quantization import Int8WeightOnlyConfig

    def load():
        config = PipelineQuantizationConfig(quant_mapping={"transformer": TorchAoConfig(Int8WeightOnlyConfig())})
        return _load_flux(saved_flux, quantization_config=config)

    case = FAMILIES["flux"]
    expected = case.run(load())
    pipe = omnify(load(), "TORCH_SDPA")
    kinds = {type(m.weight).__name__ for m in pipe.transformer.modules() if isinstance(m, torch.nn.Linear)}
    assert "Int8Tensor" in kinds
    assert torch.equal(case.run(pipe), expected)
    assert _all_omni(pipe.transformer)
    assert not torch.equal(expected, case.run(case.factory()))  # int8 weights do change the output


def test_gguf_transformer_bitwise_equal_to_stock(saved_flux):
    from diffusers import FluxTransformer2DModel, GGUFQuantizationConfig
    from diffusers.quantizers.gguf.utils import GGUFParameter

    from diffusers_omni.testing.quantized import write_gguf_checkpoint

    path = saved_flux / "transformer.gguf"
    write_gguf_checkpoint(_load_flux(saved_flux).transformer, path, prefer="Q8_0")

    def load():
        pipe = _load_flux(saved_flux)
        transformer = FluxTransformer2DModel.from_single_file(
            str(path), config=str(saved_flux / "transformer"), torch_dtype=torch.float32,
            quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
        ).eval()
        pipe.register_modules(transformer=transformer)
        return pipe

    case = FAMILIES["flux"]
    expected = case.run(load())
    pipe = omnify(load(), "TORCH_SDPA")
    assert any(isinstance(p, GGUFParameter) for p in pipe.transformer.parameters())
    assert torch.equal(case.run(pipe), expected)
    assert _all_omni(pipe.transformer)


@pytest.mark.parametrize("level", ["pipeline", "model"])
def test_device_map_at_load_bitwise_equal_to_stock(level, saved_flux):
    from diffusers import FluxTransformer2DModel

    def load():
        if level == "pipeline":
            return _load_flux(saved_flux, device_map="cpu")
        pipe = _load_flux(saved_flux)
        pipe.register_modules(transformer=FluxTransformer2DModel.from_pretrained(
            saved_flux / "transformer", device_map="cpu").eval())
        return pipe

    case = FAMILIES["flux"]
    expected = case.run(load())
    loaded = load()
    # Diffusers recorded the placement (no Accelerate hooks: a one-device map places weights only).
    if level == "pipeline":
        assert loaded.hf_device_map == "cpu"
    else:
        assert loaded.transformer.hf_device_map == {"": torch.device("cpu")}
    assert not hasattr(loaded.transformer, "_hf_hook")
    pipe = omnify(loaded, "TORCH_SDPA")
    assert getattr(pipe, "hf_device_map", None) == getattr(loaded, "hf_device_map", None)  # placement kept
    assert torch.equal(case.run(pipe), expected)
    assert _all_omni(pipe.transformer)
