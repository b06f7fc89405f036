"""The offload-flux-lossless scenario's variant runs (smoke, CPU): layerwise with compression="lossless" beside plain
layerwise and resident, recorded in the JSON and the table (its H200 run is for a session with a device)."""

import json

from benchmarks import offload_bench, registry


def test_lossless_variant_smoke_run_is_recorded(tmp_path):
    scenario = next(s for s in registry.SCENARIOS if s.name == "offload-flux-lossless")
    assert "lossless" in scenario.args[scenario.args.index("--variants") + 1]
    out = tmp_path / "smoke"
    assert offload_bench.main(["--smoke", "--models", "flux", "--variants", "layerwise,lossless",
                               "--skip-model-level", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    variants = {v["variant"]: v for v in report["models"][0]["variants"]}
    assert {"omni layerwise", "omni layerwise lossless", "resident"} <= set(variants)
    assert variants["omni layerwise"]["same_output_as_resident"] is True
    lossless = variants["omni layerwise lossless"]
    assert lossless["same_output_as_resident"] is True
    assert 0.5 < lossless["coded_ratio"] < 0.8 and lossless["decode_kernel"] == "tensor operations"
    assert lossless["moved_bytes"] < lossless["streamed_bytes"]
    table = out.with_suffix(".md").read_text()
    assert "omni layerwise lossless" in table and "× the bf16 floor" in table


def test_lossless_cache_variants_write_then_read_the_same_code(tmp_path):
    out = tmp_path / "smoke"
    assert offload_bench.main(["--smoke", "--models", "flux", "--variants", "lossless-cache", "--skip-model-level",
                               "--cache-parent", str(tmp_path), "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    variants = {v["variant"]: v for v in report["models"][0]["variants"]}
    writes, reads = variants["omni layerwise lossless, cache writes"], variants["omni layerwise lossless, cache reads"]
    assert writes["same_output_as_resident"] is True and reads["same_output_as_resident"] is True
    blocks = writes["coded_blocks"]
    assert writes["cache_counters"]["cache blocks written"] == blocks and writes["cache_counters"]["cache blocks read"] == 0
    assert reads["cache_counters"]["cache blocks read"] == blocks and reads["cache_counters"]["cache blocks written"] == 0
    assert "compression_cache_dir: read" in out.with_suffix(".md").read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("omni-lossless-cache-")]  # removed after
