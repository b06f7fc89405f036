"""The alignment checker: recording, identical configs, planted differences, saved outputs, the CLI."""

import json

import pytest
import torch

from diffusers_omni.alignment import (
    AlignmentSide,
    LayerOutputs,
    RecordedInputs,
    capture_layers,
    check_alignment,
    compare_layer_outputs,
)
from diffusers_omni.installer import attention_report, is_attention_applied
from diffusers_omni.cli.main import main

from .helpers import pipeline_and_inputs


def test_recording_captures_the_first_denoising_step_and_round_trips(tmp_path):
    _, inputs = pipeline_and_inputs("flux")
    assert inputs.model_class == "FluxTransformer2DModel" and inputs.meta["call_index"] == 0
    assert inputs.kwargs["hidden_states"].shape == (1, 64, 16)
    loaded = RecordedInputs.load(inputs.save(tmp_path / "inputs.pt"))
    for key, value in inputs.kwargs.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded.kwargs[key], value), key
        else:
            assert loaded.kwargs[key] == value


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_identical_configs_and_omni_vs_stock_report_no_difference(name):
    pipe, inputs = pipeline_and_inputs(name)
    same = check_alignment(pipe.transformer, inputs, "TORCH_SDPA", "TORCH_SDPA")
    assert same.bitwise_equal and same.first_divergence is None and same.fingerprints.matches
    assert all(row.max_abs == 0 and row.max_rel == 0 for row in same.layers)
    stock = check_alignment(pipe.transformer, inputs, "TORCH_SDPA", "stock")
    assert stock.bitwise_equal
    assert [row.layer for row in stock.layers][-1] == "output"
    assert not is_attention_applied(pipe.transformer)  # left as found (stock)


def test_planted_backend_difference_is_found_at_the_right_layers(test_backends):
    pipe, inputs = pipeline_and_inputs("flux")
    rollout = {"default": "TORCH_SDPA", "per_role": {"flux.single": "PERTURBED_TEST"}}
    report = check_alignment(pipe.transformer, inputs, "TORCH_SDPA", rollout)
    by_layer = {row.layer: row for row in report.layers}
    assert by_layer["transformer_blocks.0"].bitwise_equal
    assert not by_layer["single_transformer_blocks.0"].bitwise_equal
    assert by_layer["single_transformer_blocks.0"].max_abs > 0 and not by_layer["output"].bitwise_equal
    assert report.first_divergence == "single_transformer_blocks.0" and not report.aligned
    roles = {row.role: row for row in report.fingerprints.roles}
    assert roles["flux.joint"].status == "match"
    assert roles["flux.single"].status == "mismatch"
    assert roles["flux.single"].differences["backend"] == ("TORCH_SDPA", "PERTURBED_TEST")
    payload = report.to_dict()
    assert payload["first_divergence"] == "single_transformer_blocks.0"
    assert json.loads(json.dumps(payload, default=str))["layers"][1]["bitwise_equal"] is False


def test_planted_wan_cross_difference_and_tolerance(test_backends):
    pipe, inputs = pipeline_and_inputs("wan")
    report = check_alignment(
        pipe.transformer, inputs, "TORCH_SDPA", {"default": "TORCH_SDPA", "per_role": {"cross": "PERTURBED_TEST"}}, atol=1.0
    )
    assert report.first_divergence == "blocks.0" and report.aligned  # within atol, not bitwise
    assert {r.role for r in report.fingerprints.roles if r.status == "mismatch"} == {"wan.cross"}


def test_planted_dtype_difference_is_reported_with_dtypes():
    pipe, inputs = pipeline_and_inputs("flux")
    report = check_alignment(pipe.transformer, inputs, "TORCH_SDPA", AlignmentSide("TORCH_SDPA", dtype=torch.bfloat16))
    assert report.first_divergence == "transformer_blocks.0"
    assert report.layers[0].dtype_b == "bfloat16" and 0 < report.layers[0].max_rel < 0.1
    assert next(p for p in pipe.transformer.parameters()).dtype == torch.float32  # the model was not cast


def test_attention_state_is_restored_after_capture(test_backends):
    pipe, inputs = pipeline_and_inputs("flux")
    from diffusers_omni import apply_attention, remove_attention

    apply_attention(pipe.transformer, {"default": "TORCH_SDPA", "per_role": {"flux.single": "PERTURBED_TEST"}})
    before = attention_report(pipe.transformer)
    capture_layers(pipe.transformer, inputs, "stock")
    assert attention_report(pipe.transformer) == before
    remove_attention(pipe.transformer)


def test_saved_outputs_from_two_machines_compare(tmp_path, test_backends):
    pipe, inputs = pipeline_and_inputs("flux")
    a = capture_layers(pipe.transformer, inputs, "TORCH_SDPA").save(tmp_path / "a.pt")
    b = capture_layers(pipe.transformer, inputs, {"per_role": {"flux.single": "PERTURBED_TEST"}, "default": "TORCH_SDPA"})
    b.save(tmp_path / "b.pt")
    report = compare_layer_outputs(LayerOutputs.load(a), LayerOutputs.load(tmp_path / "b.pt"))
    assert report.first_divergence == "single_transformer_blocks.0"
    assert report.fingerprints.mismatched_roles == ["flux.single"]


def test_cli_align_one_machine_and_two_files(tmp_path, capsys):
    record = tmp_path / "inputs.pt"
    out = tmp_path / "report.json"
    assert main(["align", "--a", '{"default": "TORCH_SDPA"}', "--b", "stock", "--record", str(record), "--json", str(out)]) == 0
    assert "result: bitwise equal" in capsys.readouterr().out
    assert json.loads(out.read_text())["bitwise_equal"] is True
    args = ["align", "--inputs", str(record), "--a", "TORCH_SDPA"]
    assert main([*args, "--save-a", str(tmp_path / "x.pt"), "--fingerprint", str(tmp_path / "x.json")]) == 0
    assert main([*args, "--dtype-a", "bfloat16", "--save-a", str(tmp_path / "y.pt"), "--fingerprint", str(tmp_path / "y.json")]) == 0
    capsys.readouterr()
    assert main(["align", "--compare", str(tmp_path / "x.pt"), str(tmp_path / "y.pt")]) == 1
    assert "first divergence at transformer_blocks.0" in capsys.readouterr().out
    assert main(["align", "--compare", str(tmp_path / "x.json"), str(tmp_path / "x.json")]) == 0
    assert main(["align", "--compare", str(tmp_path / "x.json"), str(tmp_path / "y.json")]) == 1
    assert "kernels differ: flux.joint, flux.single" in capsys.readouterr().out
