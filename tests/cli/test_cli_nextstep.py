"""``diffusers-omni generate --model tiny-nextstep``: an image file, byte-identical under layerwise offload."""

from __future__ import annotations

from PIL import Image

from diffusers_omni.cli.main import main


def test_tiny_nextstep_writes_a_png_byte_identical_with_layerwise_offload(tmp_path, capsys):
    resident, layerwise = tmp_path / "resident.png", tmp_path / "layerwise.png"
    assert main(["generate", "--model", "tiny-nextstep", "--device", "cpu", "--output", str(resident)]) == 0
    assert main(["generate", "--model", "tiny-nextstep", "--device", "cpu", "--offload", "layerwise",
                 "--output", str(layerwise)]) == 0
    assert resident.read_bytes() == layerwise.read_bytes()
    with Image.open(resident) as image:
        assert image.size == (16, 16)
    assert "nextstep.causal" in capsys.readouterr().out


def test_tiny_nextstep_refuses_model_level_offload(tmp_path, capsys):
    output = tmp_path / "out.png"
    code = main(["generate", "--model", "tiny-nextstep", "--device", "cpu", "--offload", "model-level",
                 "--output", str(output)])
    assert code == 2 and not output.exists()
    assert "does not support model-level offload" in capsys.readouterr().err


def test_tiny_nextstep_size_must_be_a_multiple_of_its_token_size(capsys):
    assert main(["generate", "--model", "tiny-nextstep", "--device", "cpu", "--height", "18"]) == 2
    assert "--height=18" in capsys.readouterr().err


def test_explain_lists_the_nextstep_role(capsys):
    assert main(["explain", "--model", "tiny-nextstep", "--json"]) == 0
    assert "nextstep.causal" in capsys.readouterr().out


def test_generate_reads_the_published_layout_and_checks_before_loading(tmp_path, capsys):
    from diffusers_omni.testing.tiny_nextstep import tiny_nextstep_pipeline

    folder = tmp_path / "NextStep-1.1"
    tiny_nextstep_pipeline(0).save_published(folder)
    args = ["generate", "--model", str(folder), "--device", "cpu", "--height", "16", "--width", "16", "--steps", "2"]
    built, loaded = tmp_path / "built.png", tmp_path / "loaded.png"
    assert main(["generate", "--model", "tiny-nextstep", "--device", "cpu", "--output", str(built)]) == 0
    assert main([*args, "--output", str(loaded)]) == 0
    assert built.read_bytes() == loaded.read_bytes()
    capsys.readouterr()
    # Refused from the configs, before any weight is read.
    assert main([*args, "--offload", "model-level"]) == 2
    assert "--offload model-level: OmniNextStep11Pipeline does not support model-level offload" in capsys.readouterr().err
    assert main([*args[:-4], "--height", "18", "--width", "16"]) == 2
    assert "--height=18" in capsys.readouterr().err
    assert main(["explain", "--model", str(folder), "--json"]) == 0
    assert "nextstep.causal" in capsys.readouterr().out
