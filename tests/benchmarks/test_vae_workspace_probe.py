"""benchmarks/vae_workspace_probe.py's smoke on the CPU: the tiny VAE and FLUX.1 slice run through the probe's
timing, rows and report (no cap, no ballast there: the pressure itself needs CUDA)."""

import json

import pytest

from benchmarks import registry
from benchmarks import vae_workspace_probe as probe


def test_the_smoke_times_each_call_and_writes_one_row_per_call(tmp_path):
    scenario = registry.get("vae-workspace-probe")
    assert scenario.smoke == ("--smoke",)
    assert probe.main(["--smoke", "--out", str(tmp_path / "run")]) == 0
    report = json.loads((tmp_path / "run.json").read_text())
    assert report["smoke"] and report["device"] == "CPU (smoke)"
    assert [(r["what"], r["cudnn_benchmark"]) for r in report["rows"]] == [
        ("VAE decode 64²", False), ("VAE decode 64²", True), ("FLUX.1 transformer slice, 16 tokens", False)]
    assert all(r["free_gib"] is None and r["same"] and r["peak_bytes"] is None and r["seconds"] > 0
               for r in report["rows"])
    decodes = [r["sha256"] for r in report["rows"][:2]]
    assert decodes[0] == decodes[1]  # the same latents, the same bits (cudnn.benchmark changes nothing on the CPU)
    text = (tmp_path / "run.md").read_text()
    assert "| VAE decode 64² | False | all |" in text and "| n/a | yes |" in text and "the smoke" in text


def test_without_cuda_and_without_smoke_it_says_what_it_needs(tmp_path):
    if probe.torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        probe.main(["--out", str(tmp_path / "run")])
