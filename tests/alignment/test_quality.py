"""Quality of a lossy configuration against a reference one (issue 15): per-layer relative error and the final
output's PSNR, from the API and from ``diffusers-omni align``."""

import json
import math

import torch

from diffusers_omni.alignment import capture_layers, check_alignment, compare_layer_outputs
from diffusers_omni.alignment.compare import LayerOutputs
from diffusers_omni.cli.main import main

from .helpers import pipeline_and_inputs


def test_rel_err_and_psnr_are_the_textbook_formulas():
    pipe, inputs = pipeline_and_inputs("flux")
    fp = capture_layers(pipe.transformer, inputs, "TORCH_SDPA").fingerprint
    a = torch.linspace(-2.0, 2.0, 1000).reshape(10, 100)
    b = a + 0.01 * torch.sin(torch.arange(1000.0)).reshape(10, 100)
    report = compare_layer_outputs(LayerOutputs({"output": (a,)}, fp), LayerOutputs({"output": (b,)}, fp))
    row = report.output
    want_rel = ((b - a).double().norm() / a.double().norm()).item()
    want_psnr = 10 * math.log10(4.0**2 / (b - a).double().square().mean().item())
    assert math.isclose(row.rel_err, want_rel, rel_tol=1e-9) and math.isclose(row.psnr_db, want_psnr, rel_tol=1e-9)
    same = compare_layer_outputs(LayerOutputs({"output": (a,)}, fp), LayerOutputs({"output": (a.clone(),)}, fp))
    assert same.output.rel_err == 0 and same.output.psnr_db == math.inf
    assert report.to_dict()["output_psnr_db"] == row.psnr_db


def test_lossy_config_quality_per_layer_and_cli(test_backends, tmp_path, capsys):
    pipe, inputs = pipeline_and_inputs("flux")
    report = check_alignment(pipe.transformer, inputs, "TORCH_SDPA", {"default": "PERTURBED_TEST"})
    rows = {row.layer: row for row in report.layers}
    assert all(row.rel_err > 0 for row in report.layers)
    assert 0 < rows["output"].rel_err < 1 and 10 < rows["output"].psnr_db < 200
    assert "final output vs side a: rel err" in report.table() and "psnr_db" in report.table()
    out = tmp_path / "quality.json"
    assert main(["align", "--a", "TORCH_SDPA", "--b", '{"default": "PERTURBED_TEST"}', "--json", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "PSNR" in printed and "rel_err" in printed
    payload = json.loads(out.read_text())
    assert payload["output_rel_err"] > 0 and payload["layers"][-1]["layer"] == "output"
