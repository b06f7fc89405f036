"""tune_bench on the CPU (--smoke: tiny configs of the three transformers): tune runs and writes a table, every
candidate configuration is timed with its samples, and the report carries provenance and the 3% verdict."""

import json
import sys

from benchmarks import tune_bench


def test_smoke_run_tunes_and_times_every_candidate(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_COMMIT", "abc1234")
    out = tmp_path / "tune"
    monkeypatch.setattr(sys, "argv", ["tune_bench", "--smoke", "--models", "flux,qwen", "--rounds", "2",
                                      "--tune-warmup", "1", "--tune-repeats", "1", "--out", str(out)])
    tune_bench.main()
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["commit"] == "abc1234" and report["random_weights"] is True and report["tolerance"] == 0.03
    for name in ("flux", "qwen"):
        model = report["models"][name]
        assert "error" not in model, model.get("error")
        assert model["tune"]["seconds"] > 0 and model["tune"]["measured"]
        steps = model["whole_step"]
        assert {"Diffusers native", "omni auto (tuned table)", "omni auto (shipped table)",
                "omni TORCH_SDPA (every role)"} <= set(steps["seconds"])
        assert all(len(samples) == 2 for samples in steps["samples"].values())
        assert steps["fastest"] in steps["seconds"] and isinstance(steps["within_tolerance"], bool)
        # The tuned configuration ran through the tuned table: its backends were recorded per role.
        assert steps["backends"]["omni auto (tuned table)"]
