"""``benchmarks/offload_lifecycle_bench.py --smoke``: the delete-and-rebuild cycles and the denoising comparison on
a tiny FLUX on CPU (the real run, with cudaHostRegister and a FLUX.1-size model, is on the H200)."""

import json

from benchmarks import offload_lifecycle_bench


def _module():
    return offload_lifecycle_bench


def test_smoke_writes_json_and_markdown_with_every_check(tmp_path):
    bench = _module()
    out = tmp_path / "lifecycle"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["all_checks_pass"] is True
    assert [c["strategy"] for c in report["cycles"]] == ["layerwise", "model_level"]
    for entry in report["cycles"]:
        assert entry["checks"]["cycles_run"] == 3 and len(entry["rows"]) == 3
        assert all(row["freed"] and row["registered_after"] == 0 for row in entry["rows"])
    for name in ("layerwise", "model_level"):
        denoise = report["denoise"][name]
        assert denoise["bitwise_equal_steps"] == denoise["steps"] == 4
        assert denoise["checks"] == {"bitwise_equal": True, "device_growth_le_1MiB": True}
    markdown = out.with_suffix(".md").read_text()
    assert "## Delete and rebuild" in markdown and "## Denoising steps" in markdown
    assert "All checks pass: **yes**" in markdown


def test_a_failing_check_fails_the_run(tmp_path, monkeypatch):
    bench = _module()
    original = bench.denoise

    def perturbed(model, inputs, steps, device):
        outputs, allocated = original(model, inputs, steps, device)
        if any(getattr(m, "_diffusers_hook", None) is not None for m in model.modules()):  # offloaded runs only
            outputs[-1] = outputs[-1] + 1
        return outputs, allocated

    monkeypatch.setattr(bench, "denoise", perturbed)
    out = tmp_path / "lifecycle"
    assert bench.main(["--smoke", "--out", str(out)]) == 1
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["denoise"]["layerwise"]["checks"]["bitwise_equal"] is False
    assert "All checks pass: **NO**" in out.with_suffix(".md").read_text()
