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
    assert code != 0 and not output.exists()
    assert "does not support model-level offload" in capsys.readouterr().err


def test_tiny_nextstep_size_must_be_a_multiple_of_its_token_size(capsys):
    assert main(["generate", "--model", "tiny-nextstep", "--device", "cpu", "--height", "18"]) == 2
    assert "--height=18" in capsys.readouterr().err


def test_explain_lists_the_nextstep_role(capsys):
    assert main(["explain", "--model", "tiny-nextstep", "--json"]) == 0
    assert "nextstep.causal" in capsys.readouterr().out
