import json

import pytest
import torch

from PIL import Image

from diffusers_omni.cli.main import main


def test_info_json_parses(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    backends = {b["name"]: b for b in info["backends"]}
    assert backends["TORCH_SDPA"]["available"] is True
    assert backends["CUDNN_ATTN"]["available"] is False
    assert any("requires one of ['cuda']" in r for r in backends["CUDNN_ATTN"]["reasons"])
    assert info["platform"]["family"] == "cpu"
    assert info["routing"][-1]["backend"] == "TORCH_SDPA"


def test_info_simulated_hopper(capsys):
    assert main(["info", "--platform", "sm_90,cudnn=91900"]) == 0
    out = capsys.readouterr().out
    assert "Hopper sm_90, cuDNN 91900" in out
    assert "default routing: TORCH_SDPA" in out
    assert any(line.split()[:2] == ["q2/kv2/d128/dense", "FLASH_ATTN"] for line in out.splitlines() if line.strip())


def test_explain_prints_each_role_and_source(capsys):
    config = '{"default": {"backend": "TORCH_SDPA"}, "per_role": {"cross": {"backend": "auto"}}}'
    assert main(["explain", "--model", "tiny-wan-i2v", "--attention", config, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    by_role = {row["role"]: row for row in rows}
    assert by_role["wan.self"]["source"] == "default"
    assert by_role["wan.image_cross"]["source"].startswith("per_role['cross'] auto")


def test_explain_reports_bad_config_as_error(capsys):
    assert main(["explain", "--attention", "NOPE"]) == 2
    assert "backend='NOPE' is not a known attention backend" in capsys.readouterr().err


def test_generate_writes_an_image(tmp_path, capsys):
    output = tmp_path / "out.png"
    assert main(["generate", "--steps", "2", "--height", "32", "--width", "32", "--output", str(output)]) == 0
    out = capsys.readouterr().out
    assert "flux.joint" in out and "TORCH_SDPA" in out and f"wrote {output}" in out
    with Image.open(output) as image:
        assert image.size == (32, 32)


def test_generate_wan_writes_every_frame(tmp_path):
    output = tmp_path / "video.gif"
    args = ["generate", "--model", "tiny-wan", "--steps", "2", "--height", "32", "--width", "32", "--frames", "5",
            "--output", str(output)]
    assert main(args) == 0
    with Image.open(output) as video:
        assert video.n_frames == 5 and video.size == (32, 32)


def test_models_lists_every_declaration(capsys):
    assert main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    names = {row["architecture"] for row in rows}
    assert {"FLUX.1", "Wan 2.1 / 2.2"} <= names
    assert any("OmniFluxPipeline" in row["pipelines"] for row in rows)


def test_generate_loads_dits_as_mmap_views(tmp_path, monkeypatch):
    from diffusers_omni.cli.common import load_pipeline
    from diffusers_omni.offload import loading
    from diffusers_omni.testing import tiny_flux_pipeline

    model_dir = tmp_path / "flux"
    tiny_flux_pipeline().save_pretrained(model_dir)
    loaded = []
    real = loading.load_transformer_mmap
    monkeypatch.setattr(loading, "load_transformer_mmap", lambda *a, **k: loaded.append(real(*a, **k)) or loaded[-1])
    pipe = load_pipeline(str(model_dir), mmap=True)
    assert len(loaded) == 1 and pipe.transformer is loaded[0]
    output = tmp_path / "mmap.png"
    args = ["generate", "--model", str(model_dir), "--mmap", "--steps", "2", "--height", "32", "--width", "32"]
    assert main([*args, "--output", str(output)]) == 0
    assert output.exists() and len(loaded) == 2


def test_generate_mmap_needs_files(capsys):
    assert main(["generate", "--mmap"]) == 2
    assert "--mmap needs a model directory or hub id" in capsys.readouterr().err


def test_explain_a_saved_model_builds_dits_from_configs_without_weights(tmp_path, capsys):
    from diffusers_omni.cli.explain import dits_from_configs
    from diffusers_omni.testing import tiny_flux_pipeline

    tiny_flux_pipeline().save_pretrained(tmp_path)
    dits = dits_from_configs(str(tmp_path), torch.bfloat16)
    assert list(dits) == ["transformer"]
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in dits["transformer"].parameters())
    args = ["explain", "--model", str(tmp_path), "--platform", "sm_90", "--attention", "CUDNN_ATTN", "--json"]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {row["backend"] for row in rows} == {"CUDNN_ATTN"}
    assert all("bfloat16" in row["call"] for row in rows)


def test_generate_loads_the_transformer_from_a_gguf_file_as_views_and_reads_it_back_under_a_host_budget(tmp_path):
    """``--transformer-gguf``: the transformer comes from a GGUF file through ``load_gguf_mmap`` (quantized weights
    that stay views of the file), the rest from the model folder; with ``--max-host-memory`` its quantized blocks
    are read back from the ``.gguf``; the image is the one the same pipeline gives without offload."""
    import numpy as np
    from PIL import Image

    from diffusers_omni.cli.common import load_pipeline
    from diffusers_omni.offload.disk import FileViews
    from diffusers_omni.offload.tensors import TensorSet
    from diffusers_omni.pipelines.registry import omnify
    from diffusers_omni.testing import tiny_flux_pipeline
    from diffusers_omni.testing.quantized import write_gguf_checkpoint

    model_dir = tmp_path / "flux"
    source = tiny_flux_pipeline()
    source.save_pretrained(model_dir)
    gguf_file = tmp_path / "transformer.gguf"
    write_gguf_checkpoint(source.transformer, gguf_file, prefer="Q8_0")
    pipe = load_pipeline(str(model_dir), transformer_gguf=str(gguf_file))
    views = FileViews()
    leaves = TensorSet(pipe.transformer).leaves
    assert any(type(t).__name__ == "GGUFParameter" for leaf in leaves for t in leaf.targets)
    assert all(views.locate(leaf.data()) is not None for leaf in leaves)  # float32: nothing was converted
    omni = omnify(pipe)
    with pytest.raises(ValueError, match="is too small") as info:
        omni.enable_layerwise_offload(device="cpu", max_host_memory=1)
    least = int(str(info.value).split("at least ")[1].split(" ")[0])
    backend = omni.enable_layerwise_offload(device="cpu", max_host_memory=least)
    reader = backend._state.disk_reader
    dit = [s for s in backend._state.disk.values() if s.component == "transformer"]
    assert dit and {reader.files[p.file].name for s in dit for p in s.pieces} == {"transformer.gguf"}
    omni.disable_omni_offload()

    common = ["generate", "--model", str(model_dir), "--transformer-gguf", str(gguf_file), "--steps", "2",
              "--height", "32", "--width", "32", "--device", "cpu"]
    plain, offloaded = tmp_path / "plain.png", tmp_path / "offloaded.png"
    assert main([*common, "--output", str(plain)]) == 0
    assert main([*common, "--offload", "layerwise", "--max-host-memory", str(least), "--output",
                 str(offloaded)]) == 0
    assert np.array_equal(np.asarray(Image.open(plain)), np.asarray(Image.open(offloaded)))


def test_generate_transformer_gguf_refuses_what_it_cannot_use(tmp_path, capsys):
    assert main(["generate", "--transformer-gguf", str(tmp_path / "missing.gguf")]) == 2
    assert "--transformer-gguf=" in capsys.readouterr().err
    (tmp_path / "t.gguf").write_bytes(b"x")
    assert main(["generate", "--transformer-gguf", str(tmp_path / "t.gguf")]) == 2
    assert "--transformer-gguf needs a model directory or hub id" in capsys.readouterr().err


def test_explain_offload_says_what_auto_reads_and_chooses(capsys, monkeypatch):
    """#40: ``explain --offload layerwise --max-device-memory auto`` reads the machine through ``offload.budget``
    (replaced here by a 12 GiB card under a per-process fraction) and says what auto chose and why."""
    import json as _json

    from diffusers_omni.config.offload import format_bytes
    from diffusers_omni.offload import budget
    from diffusers_omni.offload.budget import MachineReading

    gib = 1 << 30
    monkeypatch.setattr("diffusers_omni.cli.main.device_arg", str)  # this CPU machine has no cuda to check
    monkeypatch.setattr(budget, "read_machine", lambda device: MachineReading(
        str(device), device_free=100 * gib, device_total=140 * gib, device_fraction=12 / 140,
        mem_available=32 * gib, cgroup_limit=24 * gib, cgroup_usage=4 * gib))
    assert main(["explain", "--offload", "layerwise", "--device", "cuda", "--max-device-memory", "auto",
                 "--max-host-memory", "auto"]) == 0
    out = capsys.readouterr().out
    assert "offload: layerwise on cuda" in out
    assert "max_device_memory=auto: 9.60 GiB (free 100.00 GiB + cached by this process 0 B; per-process fraction " in out
    assert "max_host_memory=auto: 18.00 GiB (MemAvailable 32.00 GiB; cgroup limit 24.00 GiB less its usage" in out
    assert "auto read: device cuda, device_free 100.00 GiB" in out and "none are loaded here" in out
    ceiling = 12 * gib - budget.peak_margin(12 * gib)  # the fraction's 12 GiB less the margin
    assert f"the step's peak stays within {format_bytes(ceiling)} (what auto read, less a margin)" in out
    assert main(["explain", "--offload", "layerwise", "--device", "cuda", "--max-device-memory", "8GiB", "--json"]) == 0
    offload = _json.loads(capsys.readouterr().out)["offload"]
    assert offload["budgets"] == {"max_device_memory": {"bytes": 8 * gib, "explain": "max_device_memory=8.00 GiB "
                                                                                      "(as given)"}}
    assert "read" not in offload
    # Not given, on an accelerator: auto (the default there); "none": no budget, nothing read.
    assert main(["explain", "--offload", "layerwise", "--device", "cuda", "--json"]) == 0
    offload = _json.loads(capsys.readouterr().out)["offload"]
    assert offload["budgets"]["max_device_memory"]["explain"].startswith("max_device_memory=auto: 9.60 GiB")
    assert main(["explain", "--offload", "layerwise", "--device", "cuda", "--max-device-memory", "none"]) == 0
    out = capsys.readouterr().out
    assert "max_device_memory: no budget (every DiT block streams through the prefetch window)" in out
    assert "auto read" not in out


def test_explain_offload_says_what_a_compression_cache_dir_holds(tmp_path, capsys):
    folder = tmp_path / "cache"
    assert main(["generate", "--model", "tiny-flux", "--dtype", "bfloat16", "--offload", "layerwise", "--compression",
                 "lossless", "--compression-cache-dir", str(folder), "--output", str(tmp_path / "a.png")]) == 0
    capsys.readouterr()
    written = len(list(folder.glob("*.safetensors")))
    assert written > 0
    assert main(["explain", "--offload", "layerwise", "--device", "cpu", "--compression", "lossless",
                 "--compression-cache-dir", str(folder)]) == 0
    out = capsys.readouterr().out
    assert f"compression: lossless; compression_cache_dir {folder} holds {written} blocks' code (" in out
