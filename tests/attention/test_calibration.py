import json
import math
import types

import pytest
import torch

from diffusers_omni.attention.backends.trtllm.calibration import (
    CalibrationError,
    attach_calibration,
    calibration_for_model,
    load_calibration_file,
    load_pipeline_calibrations,
    parse_calibration,
)

VALID = {
    "config_groups": {
        "self": {
            "formula": "a * exp(b * target_sparsity)",
            "coefficients": {"a": 0.002, "b": 6.0},
            "targets": ["blocks.*.attn1"],
            "ignore": ["blocks.0.*"],
        },
        "cross": {"formula": "a*exp(b*target_sparsity)", "coefficients": [0.01, 2.0], "targets": ["blocks.*.attn2"]},
    },
    "ignore": ["blocks.39.*"],
}


def test_valid_block_computes_lambda_per_group():
    cal = parse_calibration(VALID)
    assert math.isclose(cal.threshold("blocks.5.attn1", 0.65), 0.002 * math.exp(6.0 * 0.65))
    assert math.isclose(cal.threshold("blocks.5.attn2", 0.5), 0.01 * math.exp(1.0))
    assert cal.threshold("blocks.5.ff", 0.5) is None  # covered by no group: dense


def test_ignore_patterns_keep_layers_dense_group_and_global():
    cal = parse_calibration(VALID)
    assert cal.threshold("blocks.0.attn1", 0.65) is None  # group ignore
    assert cal.threshold("blocks.39.attn1", 0.65) is None  # top-level ignore applies to every group
    assert cal.threshold("blocks.39.attn2", 0.65) is None
    assert cal.threshold("blocks.10.attn1", 0.65) is not None


def test_groups_directly_under_the_block():
    cal = parse_calibration({"g": {"formula": "a*exp(b*target_sparsity)", "coefficients": {"a": 1, "b": 0}}})
    assert cal.threshold("anything", 0.9) == 1.0


@pytest.mark.parametrize(
    "block, match",
    [
        ({"g": {"formula": "a*target_sparsity+b", "coefficients": {"a": 1, "b": 2}}}, "formula='a\\*target_sparsity\\+b' is not supported"),
        ({"g": {"coefficients": {"a": 1, "b": 2}}}, "missing 'formula'"),
        ({"g": {"formula": "a*exp(b*target_sparsity)"}}, "missing 'coefficients'"),
        ({"g": {"formula": "a*exp(b*target_sparsity)", "coefficients": {"a": 1}}}, "coefficients is missing 'b'"),
        ({"g": {"formula": "a*exp(b*target_sparsity)", "coefficients": [1]}}, "has 1 values; required: \\[a, b\\]"),
        ({"g": {"formula": "a*exp(b*target_sparsity)", "coefficients": {"a": "x", "b": 1}}}, "coefficients.a='x' must be a finite number"),
        ({"g": {"formula": "a*exp(b*target_sparsity)", "coefficients": {"a": -1, "b": 1}}}, "must be >= 0"),
        ({"g": {"formula": "a*exp(b*target_sparsity)", "coefficients": {"a": 1, "b": 1}, "ignore": [3]}}, "fnmatch patterns"),
        ({}, "no calibration groups"),
        ([], "must be a mapping"),
    ],
)
def test_errors(block, match):
    with pytest.raises(CalibrationError, match=match):
        parse_calibration(block)


def _write(folder, component, block):
    (folder / component).mkdir(parents=True)
    config = {"_class_name": "WanTransformer3DModel"}
    if block is not None:
        config["sparse_attention_config"] = block
    (folder / component / "config.json").write_text(json.dumps(config))


def test_second_expert_reads_transformer_2(tmp_path):
    second = {"g": {"formula": "a*exp(b*target_sparsity)", "coefficients": {"a": 0.5, "b": 1.0}}}
    _write(tmp_path, "transformer", VALID)
    _write(tmp_path, "transformer_2", second)
    cals = load_pipeline_calibrations(tmp_path)
    assert set(cals) == {"transformer", "transformer_2"}
    assert math.isclose(cals["transformer_2"].threshold("blocks.0.attn1", 1.0), 0.5 * math.e)
    assert cals["transformer_2"].source.endswith("transformer_2/config.json")
    # A loaded expert finds its own file through config._name_or_path.
    model = torch.nn.Linear(1, 1)
    model.config = {"_name_or_path": str(tmp_path / "transformer_2")}
    assert math.isclose(calibration_for_model(model).threshold("x", 0.0), 0.5)


def test_config_without_block_and_bad_json(tmp_path):
    _write(tmp_path, "transformer", None)
    assert load_calibration_file(tmp_path / "transformer" / "config.json") is None
    assert load_pipeline_calibrations(tmp_path) == {}
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(CalibrationError, match="not valid JSON"):
        load_calibration_file(bad)


def test_attached_and_in_config():
    model = torch.nn.Linear(1, 1)
    assert calibration_for_model(model) is None
    model.config = types.SimpleNamespace(sparse_attention_config=VALID, _name_or_path=None)
    assert calibration_for_model(model).threshold("blocks.3.attn2", 0.0) == 0.01
    attach_calibration(model, {"g": {"formula": "a*exp(b*target_sparsity)", "coefficients": [2, 0]}})
    assert calibration_for_model(model).threshold("blocks.3.attn2", 0.0) == 2.0
