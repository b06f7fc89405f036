"""``benchmarks/offload_concurrency_check.py --smoke``: concurrent callers of one offloaded tiny FLUX on CPU (the
real run, FLUX.1-size on CUDA streams, is on the H200)."""

import json

from benchmarks import offload_concurrency_check


def test_smoke_writes_json_and_markdown_and_every_output_is_bitwise(tmp_path):
    out = tmp_path / "concurrency"
    assert offload_concurrency_check.main(["--smoke", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["all_checks_pass"] is True
    assert [e["name"].split(",")[0] for e in report["results"]] == ["layerwise"] * 3 + ["model_level"]
    for entry in report["results"]:
        assert len(entry["rows"]) == 2
        assert all(r["bitwise_equal"] == r["outputs"] == 12 and r["error_count"] == 0 for r in entry["rows"])
    assert "All checks pass: **yes**" in out.with_suffix(".md").read_text()


def test_a_wrong_output_fails_the_run(tmp_path, monkeypatch):
    original = offload_concurrency_check.run_concurrently

    def perturbed(model, inputs, calls):
        outputs, errors = original(model, inputs, calls)
        key = next(iter(outputs))
        outputs[key] = outputs[key] + 1
        return outputs, errors

    monkeypatch.setattr(offload_concurrency_check, "run_concurrently", perturbed)
    out = tmp_path / "concurrency"
    assert offload_concurrency_check.main(["--smoke", "--out", str(out)]) == 1
    assert "All checks pass: **no**" in out.with_suffix(".md").read_text()
