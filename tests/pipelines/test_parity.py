"""Omni pipelines against stock Diffusers on tiny local pipelines: bitwise parity, reports, restore."""

import pytest
import torch
from PIL import Image

from diffusers_omni import OmniFluxPipeline, OmniWanImageToVideoPipeline, OmniWanPipeline, omnify
from diffusers_omni.attention.processors import is_omni_processor
from diffusers_omni.pipelines.mixin import SupportsComponentDiscovery
from diffusers_omni.testing import tiny_flux_pipeline, tiny_wan_i2v_pipeline, tiny_wan_pipeline

FLUX_CALL = {"prompt": "a red fox", "height": 32, "width": 32, "num_inference_steps": 2, "output_type": "latent"}
WAN_CALL = {"prompt": "a red fox", "height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2, "output_type": "latent"}

CASES = {
    "flux": (tiny_flux_pipeline, OmniFluxPipeline, FLUX_CALL, {"flux.joint": 1, "flux.single": 1}),
    "wan": (tiny_wan_pipeline, OmniWanPipeline, WAN_CALL, {"wan.self": 1, "wan.cross": 1}),
    "wan_i2v": (
        tiny_wan_i2v_pipeline,
        OmniWanImageToVideoPipeline,
        {**WAN_CALL, "image": Image.new("RGB", (32, 32), (120, 60, 30))},
        {"wan.self": 1, "wan.cross": 1, "wan.image_cross": 1},
    ),
}


def run(pipe, call):
    output = pipe(**call, generator=torch.Generator().manual_seed(0))
    return output.frames if hasattr(output, "frames") else output.images


@pytest.mark.parametrize("case", CASES)
def test_torch_sdpa_is_bitwise_equal_to_stock_diffusers(case):
    factory, omni_cls, call, expected_roles = CASES[case]
    stock = factory()
    expected = run(stock, call)
    pipe = omnify(factory(), "TORCH_SDPA")
    assert type(pipe) is omni_cls
    assert isinstance(pipe, SupportsComponentDiscovery)
    report = pipe.omni_attention_report()
    counts = {}
    for entry in report:
        counts[entry["role"]] = counts.get(entry["role"], 0) + 1
        assert entry["backend"] == "TORCH_SDPA" and entry["source"] == "default"
        assert entry["module"].startswith("transformer.")
    assert counts == expected_roles
    assert torch.equal(run(pipe, call), expected)


@pytest.mark.parametrize("case", CASES)
def test_report_covers_every_attention_module(case):
    factory, omni_cls, _, _ = CASES[case]
    pipe = factory(pipeline_cls=omni_cls)
    report = pipe.enable_omni_attention()
    attention_modules = {
        f"transformer.{name}" for name, module in pipe.transformer.named_modules() if hasattr(module, "processor")
    }
    assert {entry["module"] for entry in report} == attention_modules
    assert all(is_omni_processor(pipe.transformer.get_submodule(m.split(".", 1)[1]).processor) for m in attention_modules)


def test_per_role_override_shows_its_source():
    pipe = tiny_wan_i2v_pipeline(pipeline_cls=OmniWanImageToVideoPipeline)
    report = pipe.enable_omni_attention({"default": {"backend": "TORCH_SDPA"}, "per_role": {"cross": {"backend": "auto"}}})
    sources = {entry["role"]: entry["source"] for entry in report}
    assert sources["wan.self"] == "default"
    assert sources["wan.cross"].startswith("per_role['cross'] auto → platform default")
    assert sources["wan.image_cross"].startswith("per_role['cross'] auto → platform default")
    report = pipe.enable_omni_attention({"per_role": {"wan.image_cross": "TORCH_SDPA"}})
    assert {e["role"]: e["source"] for e in report}["wan.image_cross"] == "per_role['wan.image_cross']"


def test_disable_restores_diffusers_processors_and_output():
    stock = tiny_flux_pipeline()
    originals = {name: m.processor for name, m in stock.transformer.named_modules() if hasattr(m, "processor")}
    expected = run(stock, FLUX_CALL)
    pipe = omnify(stock, "TORCH_SDPA")
    assert pipe.transformer is stock.transformer  # omnify shares components
    pipe.disable_omni_attention()
    assert pipe.omni_attention_report() == []
    restored = {name: m.processor for name, m in stock.transformer.named_modules() if hasattr(m, "processor")}
    assert all(restored[name] is originals[name] for name in originals)
    assert torch.equal(run(pipe, FLUX_CALL), expected)


def test_wan22_second_expert_gets_omni_attention():
    pipe = tiny_wan_pipeline(pipeline_cls=OmniWanPipeline)
    from diffusers_omni.testing.tiny import tiny_wan_components

    pipe.register_modules(transformer_2=tiny_wan_components(seed=1)["transformer"])
    report = pipe.enable_omni_attention("TORCH_SDPA")
    assert {entry["module"].split(".")[0] for entry in report} == {"transformer", "transformer_2"}


def test_omnify_rejects_unsupported_pipelines():
    from diffusers import DDPMPipeline, UNet2DModel, DDPMScheduler

    unet = UNet2DModel(
        sample_size=8,
        block_out_channels=(8, 8),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
    )
    pipe = DDPMPipeline(unet=unet, scheduler=DDPMScheduler())
    with pytest.raises(TypeError, match="DDPMPipeline is not supported.*supported families: .*FLUX.1.*Wan 2.1"):
        omnify(pipe)


def test_omnify_of_an_omni_pipeline_is_itself():
    pipe = tiny_flux_pipeline(pipeline_cls=OmniFluxPipeline)
    assert omnify(pipe, enable_attention=False) is pipe
    assert pipe.omni_attention_report() == []


def test_explicit_backend_that_cannot_run_fails_before_any_change():
    pipe = tiny_wan_pipeline(pipeline_cls=OmniWanPipeline)
    with pytest.raises(ValueError, match="CUDNN_ATTN .*'wan.cross'"):
        pipe.enable_omni_attention({"default": "TORCH_SDPA", "per_role": {"wan.cross": "CUDNN_ATTN"}})
    assert pipe.omni_attention_report() == []


def test_from_pretrained_and_from_pipe(tmp_path):
    stock = tiny_flux_pipeline()
    stock.save_pretrained(tmp_path)
    loaded = OmniFluxPipeline.from_pretrained(tmp_path)
    for component in loaded.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    assert type(loaded) is OmniFluxPipeline
    loaded.enable_omni_attention("TORCH_SDPA")
    reference = OmniFluxPipeline.from_pipe(loaded)
    assert reference.transformer is loaded.transformer
    out = run(loaded, FLUX_CALL)
    # Weights reload identically; CPU kernels may differ in the last bit for differently aligned tensors.
    torch.testing.assert_close(out, run(stock, FLUX_CALL), atol=1e-5, rtol=1e-5)


def test_omnify_shares_components_without_casting_them():
    stock = tiny_flux_pipeline()
    for component in stock.components.values():
        if isinstance(component, torch.nn.Module) and component is not stock.vae:
            component.to(torch.bfloat16)
    pipe = omnify(stock, "TORCH_SDPA")
    assert pipe.transformer.dtype == torch.bfloat16 and pipe.vae.dtype == torch.float32
    pipe.vae.to(torch.bfloat16)
    pipe.disable_omni_attention()
    expected = run(stock, FLUX_CALL)
    pipe.enable_omni_attention("TORCH_SDPA")
    assert torch.equal(run(pipe, FLUX_CALL), expected)
    # Plain from_pipe keeps Diffusers' own semantics (it casts to float32 by default).
    assert OmniFluxPipeline.from_pipe(stock).transformer.dtype == torch.float32


def test_from_pipe_and_from_pretrained_enable_omni_attention_like_omnify(tmp_path):
    stock = tiny_flux_pipeline()
    converted = OmniFluxPipeline.from_pipe(stock)
    assert [e["backend"] for e in converted.omni_attention_report()] == ["TORCH_SDPA", "TORCH_SDPA"]
    assert {e["role"] for e in converted.omni_attention_report()} == {
        e["role"] for e in omnify(tiny_flux_pipeline()).omni_attention_report()
    }
    stock.save_pretrained(tmp_path)
    loaded = OmniFluxPipeline.from_pretrained(tmp_path)
    assert len(loaded.omni_attention_report()) == 2
    assert OmniFluxPipeline.from_pretrained(tmp_path, omni_attention=False).omni_attention_report() == []
    assert OmniFluxPipeline.from_pipe(tiny_flux_pipeline(), omni_attention=False).omni_attention_report() == []


def test_from_pipe_keeps_the_attention_config_already_installed():
    pipe = omnify(tiny_flux_pipeline(), {"default": "TORCH_SDPA", "per_role": {"flux.single": "native"}})
    sources = {e["role"]: e["source"] for e in pipe.omni_attention_report()}
    again = OmniFluxPipeline.from_pipe(pipe)
    assert {e["role"]: e["source"] for e in again.omni_attention_report()} == sources
    assert sources["flux.single"] == "per_role['flux.single']"


def test_every_omni_class_is_importable_from_the_root_and_registered():
    import diffusers_omni
    from diffusers_omni.pipelines.registry import OMNI_CLASS_MODULES, omni_pipelines
    from diffusers_omni.pipelines.mixin import OmniPipelineMixin

    discovered = omni_pipelines()
    assert len(discovered) == len(OMNI_CLASS_MODULES) >= 55
    for diffusers_name, cls in discovered.items():
        assert getattr(diffusers_omni, f"Omni{diffusers_name}") is cls
        assert issubclass(cls, OmniPipelineMixin) and cls.__bases__[-1].__name__ == diffusers_name
    # No family module defines an Omni class the table misses.
    import importlib
    import inspect

    for module in set(OMNI_CLASS_MODULES.values()):
        for name, cls in inspect.getmembers(importlib.import_module(module), inspect.isclass):
            if issubclass(cls, OmniPipelineMixin) and cls.__module__ == module:
                assert name in OMNI_CLASS_MODULES, name


def test_omnify_imports_only_the_family_in_use():
    import subprocess
    import sys

    code = ("import sys; from diffusers_omni import omnify; from diffusers_omni.testing import tiny_flux_pipeline; "
            "omnify(tiny_flux_pipeline()); "
            "print(sorted(m for m in sys.modules if m.startswith('diffusers_omni.pipelines.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['diffusers_omni.pipelines.flux', 'diffusers_omni.pipelines.mixin', 'diffusers_omni.pipelines.registry']"


def test_untested_diffusers_release_is_named_once(monkeypatch, caplog):
    import diffusers

    from diffusers_omni.pipelines import registry

    registry.check_diffusers_version.cache_clear()
    assert registry.check_diffusers_version() is None
    registry.check_diffusers_version.cache_clear()
    monkeypatch.setattr(diffusers, "__version__", "0.43.0")
    with caplog.at_level("WARNING", logger="diffusers_omni"):
        message = registry.check_diffusers_version()
        registry.check_diffusers_version()
    registry.check_diffusers_version.cache_clear()
    assert message == "diffusers 0.43.0 is installed; diffusers-omni is tested against 0.42.x. Report problems with `diffusers-omni info` output."
    assert [r.getMessage() for r in caplog.records].count(message) == 1


def test_reports_and_offload_backends_print_readably():
    pipe = omnify(tiny_flux_pipeline(), {"default": "TORCH_SDPA", "per_role": {"flux.single": "native"}})
    report = pipe.omni_attention_report()
    assert isinstance(report, list) and report == [dict(e) for e in report]
    assert repr(report) == (
        "AttentionReport(\n  flux.joint (self): TORCH_SDPA — default [1 module]\n"
        "  flux.single (self): TORCH_SDPA — per_role['flux.single'] [1 module]\n)"
    )
    backend = pipe.enable_layerwise_offload(device="cpu")
    assert repr(backend) == "LayerwiseOffloadBackend(strategy='layerwise', device='cpu', enabled)"
    pipe.disable_omni_offload()
    assert repr(backend).endswith("disabled)")
    pipe.disable_omni_attention()
    assert repr(pipe.omni_attention_report()) == "AttentionReport(omni attention is off)"
