"""A negative layer count in a DiT's config (issue 39 item 8). Diffusers builds such a model with no blocks
(``range(-1)`` is empty; Chroma's constructor fails with "upper bound and lower bound inconsistent with step sign")
and ``from_pretrained`` drops the checkpoint's block weights with a warning, so a pipeline generated noise without
an error. Omni attention, omni offload, ``load_transformer_mmap`` and the CLI refuse it, naming the model, the
field, the value and what is allowed."""

from __future__ import annotations

import json

import pytest

from diffusers_omni import omnify
from diffusers_omni.models.base import check_layer_counts
from diffusers_omni.offload.loading import CheckpointError, load_transformer_mmap
from diffusers_omni.testing import tiny_flux_pipeline


def negative_flux(field="num_layers", value=-1):
    pipe = tiny_flux_pipeline()
    config = {**pipe.transformer.config, field: value}
    pipe.transformer = type(pipe.transformer).from_config(config)
    return pipe


@pytest.mark.parametrize("field", ["num_layers", "num_single_layers"])
def test_omnify_refuses_a_negative_layer_count_naming_the_field(field):
    pipe = negative_flux(field, -2)
    with pytest.raises(ValueError) as caught:
        omnify(pipe)
    message = str(caught.value)
    assert f"{field}=-2" in message and "FluxTransformer2DModel" in message and "allowed: 0 or more" in message, \
        message


def test_offload_refuses_a_negative_layer_count():
    pipe = omnify(negative_flux(), enable_attention=False)
    with pytest.raises(ValueError, match=r"FluxTransformer2DModel config: num_layers=-1"):
        pipe.enable_layerwise_offload(device="cpu")
    assert pipe.omni_offload_backend is None


def test_valid_configs_pass_and_non_count_fields_are_not_checked():
    check_layer_counts({"num_layers": 0, "num_single_layers": 3, "layers_per_block": 2, "in_channels": -1}, "m")
    with pytest.raises(ValueError, match=r"m config: layers_per_block=-1"):
        check_layer_counts({"layers_per_block": -1}, "m")
    with pytest.raises(ValueError, match=r"m config: n_refiner_layers=-3"):
        check_layer_counts({"n_refiner_layers": -3}, "m")


def test_load_transformer_mmap_and_the_cli_refuse_a_negative_layer_count(tmp_path, capsys):
    from diffusers_omni.cli.main import main

    pipe = tiny_flux_pipeline()
    pipe.save_pretrained(tmp_path)
    config_path = tmp_path / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config["num_layers"] = -1
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as caught:
        load_transformer_mmap(type(pipe.transformer), tmp_path, "transformer")
    assert str(config_path) in str(caught.value) and "num_layers=-1" in str(caught.value)
    assert main(["generate", "--model", str(tmp_path), "--steps", "1", "--height", "32", "--width", "32",
                 "--output", str(tmp_path / "out.png")]) == 2
    err = capsys.readouterr().err
    assert "num_layers=-1" in err and "allowed: 0 or more" in err, err
    assert not (tmp_path / "out.png").exists()
