"""``benchmarks/quant_offload_bench.py --smoke --device cpu``: tiny quantized models through every variant, so the
H200 script's logic (building, quantizing, bitwise checks, targets, reports) runs in CI."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_on_cpu(tmp_path):
    out = tmp_path / "quant"
    command = [sys.executable, "-m", "benchmarks.quant_offload_bench", "--smoke", "--device", "cpu",
               "--models", "flux", "--formats", "torchao-int8,gguf-q4_k", "--per-block", "--cache-probe", "--deeper", "2", "--copy-traffic", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    assert [(e["model"], e["format"]) for e in report["entries"]] == [("flux", "torchao-int8"), ("flux", "gguf-q4_k")]
    for entry in report["entries"]:
        variants = {v["variant"]: v for v in entry["variants"]}
        assert set(variants) == {"resident", "omni layerwise", "omni layerwise from host", "diffusers group_offload",
                                 "omni layerwise prefetch_depth=2", "omni layerwise, empty_cache",
                                 "resident, copy traffic"}
        omni = variants["omni layerwise"]
        assert omni["bitwise_equal_to_resident"] is True and omni["on_demand_loads"] == 0
        assert variants["omni layerwise from host"]["bitwise_equal_to_resident"] is True
        assert omni["in_flight_blocks"] == 2 and 0 < omni["max_in_flight_bytes"] <= 2 * omni["slot_bytes"]
        assert 0 < omni["hook_s_per_step"] < omni["step_s"] and 0 < omni["host_s"] <= omni["step_s"]
        # Packed bytes stream, not a dequantized copy.
        assert entry["packed_bytes"] < 0.6 * entry["bf16_bytes"]
        assert 0 < omni["streamed_bytes"] <= entry["packed_bytes"] + 512 * 1000
        assert omni["target_step_s"] >= 1.05 * variants["resident"]["step_s"] * 0.999
        assert isinstance(omni["meets_step_target"], bool)
        # --per-block: every block (FLUX smoke: 2 double + 3 single) timed, and the 2-block cyclic bound
        # Σ max(compute_i, copy_i+1) is at least each sum (each compute_i and each copy_i appears once in it).
        pb = entry["per_block"]
        assert [b["block"] for b in pb["blocks"]] == [f"transformer_blocks.{i}" for i in range(2)] + [
            f"single_transformer_blocks.{i}" for i in range(3)]
        assert all(b["compute_s"] > 0 and b["copy_s"] >= 0 and b["packed_bytes"] > 0 for b in pb["blocks"])
        assert pb["sum_compute_s"] == sum(b["compute_s"] for b in pb["blocks"])
        assert pb["bound_s"] >= max(pb["sum_compute_s"], pb["sum_copy_s"]) * (1 - 1e-12)
        assert pb["bound_s"] <= pb["sum_compute_s"] + pb["sum_copy_s"] * (1 + 1e-12)
        assert pb["target_step_s"] == omni["target_step_s"]
        # The wrap-around load after the last block (the no-budget rule) can only lengthen the bound's last term.
        compute, copy = [b["compute_s"] for b in pb["blocks"]], [b["copy_s"] for b in pb["blocks"]]
        between = max(variants["resident"]["step_s"] - sum(compute), 0.0)
        assert pb["bound_after_last_s"] == pytest.approx(
            sum(max(compute[i], copy[i + 1]) for i in range(len(compute) - 1)) + compute[-1] + max(between, copy[0]))
        assert pb["bound_over_target"] == pb["bound_after_last_s"] / omni["target_step_s"]
        assert pb["omni_step_over_bound"] == omni["step_s"] / pb["bound_after_last_s"]
        assert len(pb["largest_deficits"]) == 3
        assert [d["deficit_s"] for d in pb["largest_deficits"]] == sorted(
            (d["deficit_s"] for d in pb["largest_deficits"]), reverse=True)
        # --copy-traffic: the resident model again with omni's streamed bytes copied alongside, bitwise equal.
        traffic = variants["resident, copy traffic"]
        assert traffic["bitwise_equal_to_resident"] is True and traffic["traffic_bytes"] == entry["packed_bytes"]
        assert traffic["over_resident"] == traffic["step_s"] / variants["resident"]["step_s"]
        # --deeper: the same model through a 3-block window, bitwise equal too.
        assert variants["omni layerwise prefetch_depth=2"]["bitwise_equal_to_resident"] is True
        # --cache-probe: allocator counters are CUDA-only (a note on the CPU); the probe pass is bitwise equal too.
        probe = variants["omni layerwise, empty_cache"]
        assert probe["bitwise_equal_to_resident"] is True and probe["on_demand_loads"] == 0
        for label in ("omni layerwise", "omni layerwise from host", "omni layerwise, empty_cache"):
            assert variants[label]["alloc_deltas"] is None and "not a CUDA device" in variants[label]["alloc_note"]
        assert "alloc_deltas" not in variants["resident"]
        assert set(probe["reserved_bytes"]) == {"before_apply_offload", "after_second_empty_cache"}
    q4 = next(e for e in report["entries"] if e["format"] == "gguf-q4_k")
    assert "Q4_K" in q4["detail"]
    table = out.with_suffix(".md").read_text()
    assert "| flux | torchao-int8 |" in table and "| flux | gguf-q4_k |" in table
    assert "## Per-block bound" in table and "## Cache probe" in table and "with no dependency" in table
