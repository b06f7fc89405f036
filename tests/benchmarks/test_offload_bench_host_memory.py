"""The offload benchmark records host memory per variant: RSS peak during enable, RSS while steps run, page-locked
bytes (pinned or registered) — what the README's "What it costs" needs, for omni and Diffusers' group offload."""

import json

import torch

from benchmarks import offload_bench


def test_smoke_run_records_host_memory_for_every_variant(tmp_path):
    out = tmp_path / "smoke"
    assert offload_bench.main(["--smoke", "--models", "flux", "--variants", "layerwise,diffusers",
                               "--skip-model-level", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    variants = {v["variant"]: v for v in report["models"][0]["variants"]}
    assert {"omni layerwise", "diffusers group_offload record_stream=False", "resident"} <= set(variants)
    for name, v in variants.items():
        assert v["host_rss_steady"] > 0 and v["host_rss_before"] > 0, name
        assert v["host_rss_peak_run"] is None or v["host_rss_peak_run"] >= v["host_rss_steady"], name
        assert v["pinned_host_bytes"] >= 0 and v["registered_host_bytes"] >= 0, name
    # On CPU nothing can be page-locked; on a GPU both offloaders pin or register their host copies.
    if not torch.cuda.is_available():
        assert all(v["pinned_host_bytes"] == 0 for v in variants.values())
    table = out.with_suffix(".md").read_text()
    assert "| Host RSS while stepping | Pinned / registered host |" in table


def test_pinned_bytes_count_each_storage_once():
    model = torch.nn.Linear(4, 4)
    model.register_buffer("alias", model.weight.data)  # the same storage twice: counted once if pinned
    counted = offload_bench.pinned_host_bytes(model)
    assert set(counted) == {"pinned_host_bytes", "registered_host_bytes"}
    if torch.cuda.is_available():
        model.weight.data = model.weight.data.pin_memory()
        model.alias = model.weight.data
        assert offload_bench.pinned_host_bytes(model)["pinned_host_bytes"] == 4 * 4 * 4
    else:
        assert counted["pinned_host_bytes"] == 0
