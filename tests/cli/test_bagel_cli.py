"""``diffusers-omni generate --model tiny-bagel``: a .png, byte-identical under layerwise offload; model-level
offload refused as a usage error; ``explain`` lists BAGEL's roles."""

import json

from PIL import Image

from diffusers_omni.cli.main import main

ARGS = ["generate", "--model", "tiny-bagel", "--steps", "3", "--height", "32", "--width", "16"]


def test_generate_tiny_bagel_png_byte_identical_with_layerwise_offload(tmp_path, capsys):
    resident, streamed = tmp_path / "resident.png", tmp_path / "layerwise.png"
    assert main([*ARGS, "--output", str(resident)]) == 0
    out = capsys.readouterr().out
    assert "bagel.understanding" in out and "bagel.generation" in out and f"wrote {resident}" in out
    assert "OmniBagelPipeline" in out
    assert main([*ARGS, "--offload", "layerwise", "--output", str(streamed)]) == 0
    assert resident.read_bytes() == streamed.read_bytes()
    with Image.open(resident) as image:
        assert image.size == (16, 32)


def test_generate_tiny_bagel_refuses_model_level_offload(tmp_path, capsys):
    output = tmp_path / "out.png"
    assert main([*ARGS, "--offload", "model-level", "--output", str(output)]) == 2
    err = capsys.readouterr().err
    assert "OmniBagelPipeline does not support model-level offload" in err and "--offload layerwise" in err
    assert not output.exists()


def test_explain_tiny_bagel_lists_both_roles(capsys):
    assert main(["explain", "--model", "tiny-bagel", "--attention", "TORCH_SDPA", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {row["role"] for row in rows} == {"bagel.understanding", "bagel.generation"}


def test_generate_from_a_saved_bagel_directory(tmp_path, capsys):
    from diffusers_omni.cli.common import own_pipeline_class
    from diffusers_omni.testing.tiny_bagel import tiny_bagel_pipeline

    model = tmp_path / "bagel"
    tiny_bagel_pipeline().save_pretrained(model)
    assert own_pipeline_class(str(model)).__name__ == "BagelPipeline"
    saved, tiny = tmp_path / "saved.png", tmp_path / "tiny.png"
    assert main([*ARGS[:2], str(model), *ARGS[3:], "--output", str(saved)]) == 0
    assert main([*ARGS, "--output", str(tiny)]) == 0
    assert saved.read_bytes() == tiny.read_bytes()


def test_published_bagel_layout_is_recognised(tmp_path):
    from diffusers_omni.cli.common import check_model, own_pipeline_class

    (tmp_path / "llm_config.json").write_text("{}")
    (tmp_path / "ema.safetensors").write_bytes(b"")
    check_model(str(tmp_path))  # no model_index.json, but BAGEL's published files
    assert own_pipeline_class(str(tmp_path)).__name__ == "BagelPipeline"


def test_explain_reads_a_bagel_directory_without_loading_weights(tmp_path, capsys):
    from diffusers_omni.testing.tiny_bagel import tiny_bagel_pipeline

    tiny_bagel_pipeline().save_pretrained(tmp_path)
    for weights in tmp_path.rglob("*.safetensors"):
        weights.unlink()  # explain needs the configs only
    assert main(["explain", "--model", str(tmp_path), "--attention", "TORCH_SDPA", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {row["role"] for row in rows} == {"bagel.understanding", "bagel.generation"}
    assert {row["module"] for row in rows} == {f"bagel.language_model.model.layers.{i}.self_attn" for i in (0, 1)}
