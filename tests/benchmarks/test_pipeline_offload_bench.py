"""``benchmarks/pipeline_offload_bench.py``'s pure helpers: the real configs build (on the meta device) at the real
checkpoints' sizes and take only keys the installed classes accept, the strategy list is parsed as documented, and
the lower bound and the report are computed from the children's results (the strategies themselves run on the H200;
``python -m benchmarks run pipeline-offload-flux --smoke`` runs them on tiny configs)."""

import pytest

from benchmarks import pipeline_offload_bench as bench


@pytest.mark.parametrize("name", ["flux", "qwen", "wan"])
def test_real_configs_build_on_meta_at_the_known_sizes(name):
    pipe, build = bench.build_pipeline(name, smoke=False, materialize_weights=False)
    checks = bench.size_check(name, build["components"])
    assert checks and all(row["ok"] for row in checks.values()), checks
    assert not [n for n in build["notes"] if "does not take" in n], build["notes"]
    if name == "qwen":  # the local tokenizer splits the template's system prefix as the real one: 34 tokens
        assert any("system prefix is 34 tokens; the pipeline drops 34" in n for n in build["notes"]), build["notes"]
    if name == "wan":  # from_pretrained keeps Wan's time embedder, norms and scale-shift tables in float32
        assert set(build["components"]["transformer"]["by_dtype"]) == {"bfloat16", "float32"}
    assert all(p.is_meta for m in (pipe.transformer,) for p in m.parameters())


def test_strategies_parse_and_omni_budget_runs_after_omni():
    args = bench.parse_args(["--model", "flux", "--strategies", "resident,omni,mmgp2", "--omni-budget", "8GiB",
                             "--out", "x"])
    assert args.strategies == ["resident", "omni", "omni-budget", "mmgp2"] and args.steps == 28
    args = bench.parse_args(["--model", "wan", "--strategies", "omni,mmgp2,omni-budget", "--omni-budget", "8GiB",
                             "--out", "x"])
    assert args.strategies == ["omni", "mmgp2", "omni-budget"] and args.steps == 40
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "flux", "--strategies", "resident,nope", "--out", "x"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "flux", "--strategies", "omni-budget", "--out", "x"])
    smoke = bench.parse_args(["--model", "qwen", "--steps", "20", "--smoke", "--out", "x"])
    assert (smoke.steps, smoke.warmup_steps) == (3, 1)


def _result(strategy, seconds, sha, steps=4, **extra):
    return {"strategy": strategy, "status": "ok", "steps": steps, "sha256": sha, "end_to_end_s": sum(seconds),
            "phases": dict(zip(("encode_s", "denoise_s", "decode_s"), seconds)), "rss": {"peak": 2**30},
            "pinned": {"pinned_total_bytes": 0}, "enable_s": 1.0, "bandwidth_bytes_per_s": 50e9,
            "bandwidth_bytes": 2**30, **extra}


def test_lower_bound_takes_per_phase_the_larger_of_compute_and_copy():
    resident = _result("resident", (1.0, 10.0, 2.0), "a")
    omni = _result("omni", (3.0, 21.0, 2.5), "a",
                   omni={"streamed_bytes": {"encode": 100e9, "denoise": 1000e9, "decode": 0.5e9}})
    (bound,) = bench.lower_bounds([resident, omni])
    assert bound["phases"]["encode"]["bound_s"] == pytest.approx(2.0)  # 100 GB at 50 GB/s over 1 s of compute
    assert bound["phases"]["denoise"]["bound_s"] == pytest.approx(20.0)
    assert bound["phases"]["decode"]["bound_s"] == pytest.approx(2.0)  # compute-bound
    assert bound["lower_bound_s"] == pytest.approx(24.0) and bound["ratio"] == pytest.approx(26.5 / 24.0)
    skipped = {"strategy": "resident", "status": "skipped", "skip_reason": "would not fit"}
    (none,) = bench.lower_bounds([skipped, omni])
    assert none["lower_bound_s"] is None and "would not fit" in none["reason"]


def test_markdown_reports_every_strategy_and_whether_the_image_matches():
    resident = _result("resident", (1.0, 10.0, 2.0), "a")
    omni = _result("omni", (3.0, 21.0, 2.5), "a", omni={"streamed_bytes": {"encode": 0, "denoise": 0, "decode": 0}})
    mmgp = _result("mmgp4", (2.0, 30.0, 2.0), "b", notes=["quantizes the text encoder"])
    sequential = _result("diffusers-sequential", (2.0, 30.0, 2.0), "c", steps=2)
    failed = {"strategy": "diffusers-model", "status": "error", "enable_s": 0.5,
              "error": {"stage": "warmup", "type": "OutOfMemoryError", "message": "CUDA out of memory."}}
    skipped = {"strategy": "mmgp2", "status": "skipped", "skip_reason": "time budget: 460 s of 450 s spent"}
    args = vars(bench.parse_args(["--model", "wan", "--steps", "4", "--out", "x"]))
    results = [resident, omni, mmgp, sequential, failed, skipped]
    report = {"environment": {"device_name": "H200"}, "args": args, "steps": 4, "strategies": results,
              "lower_bounds": bench.lower_bounds(results), "omni_budget": None, "notes": [],
              "components": {"transformer": {"params": 14, "param_bytes": 28_600_000_000,
                                             "by_dtype": {"bfloat16": 28_600_000_000}}},
              "size_check": {"transformer": {"known_gb": 28.6, "ok": True, "param_gb": 28.6}}}
    text = bench.markdown(report)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert rows["resident"].endswith("| reference |") and rows["omni"].endswith("| yes |")
    assert rows["mmgp4"].endswith("| NO |") and rows["diffusers-sequential (2 steps)"].endswith("| n/a (2 steps) |")
    assert "OutOfMemoryError (warmup)" in rows["diffusers-model"] and "skipped: time budget" in rows["mmgp2"]
    assert "lower bound for omni" in rows and "| 28.60 GB (bfloat16 28.60 GB) | 28.6 GB | ok |" in text
    assert "- mmgp4: quantizes the text encoder" in text


def test_omni_host_needs_its_budget_and_runs_after_omni(tmp_path):
    args = bench.parse_args(["--model", "wan", "--strategies", "omni", "--omni-host-budget", "32GiB",
                             "--out", str(tmp_path / "run")])
    assert args.strategies == ["omni", "omni-host"] and args.checkpoint_dir.endswith("omni-pipeline-checkpoint-wan")
    assert args.drop_page_cache
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "wan", "--strategies", "omni,omni-host", "--out", str(tmp_path / "run")])


def test_host_budget_summary_compares_the_median_forward_with_omni():
    from argparse import Namespace

    omni = _result("omni", (1.0, 3.3, 1.0), "a", forward_s={"transformer": [1.0, 1.1, 1.2]},
                   omni={"streamed_bytes": {"encode": 0, "denoise": 0, "decode": 0}})
    host = {**_result("omni-host", (1.0, 8.0, 1.0), "a", steps=8), "forward_s": {"transformer": [1.3, 1.2, 1.5]},
            "max_host_memory": 32 * 2**30, "pinned": {"pinned_total_bytes": 30 * 2**30}, "rss": {"peak": 38 * 2**30},
            "page_cache_drops": 4,
            "omni": {"stats": {"disk_blocks": 40, "disk_bytes_per_pass": 2**34, "disk_read_bytes": 2**35,
                               "disk_read_seconds": 8.0, "disk_waits": 3}}}
    summary = bench.host_budget_summary([omni, host], Namespace(omni_host_budget="32GiB"))
    assert summary["forward_ratio"] == pytest.approx(1.3 / 1.1)
    assert summary["disk_bandwidth"] == 2**35 / 8.0 and summary["page_cache_dropped"]
    args = vars(bench.parse_args(["--model", "wan", "--steps", "4", "--out", "x"]))
    report = {"environment": {"device_name": "H200"}, "args": args, "steps": 4, "strategies": [omni, host],
              "lower_bounds": [], "omni_budget": None, "notes": [], "components": {}, "size_check": {},
              "host_budget": summary}
    text = bench.markdown(report)
    assert "## Host budget (omni-host against omni)" in text
    assert summary["denoise_ratio"] == pytest.approx(1.0 / 0.825)  # per step: 8 s over 8 steps, 3.3 s over 4
    # One stretch of the transformer: its first forward, then the median of the others.
    assert summary["switch_forward_s"] == 1.3 and summary["other_forward_s"] == pytest.approx(1.35)
    assert ("| 34.36 GB | 30.00 GiB | 38.00 GiB | 1.30 s / 1.10 s (1.18×) | 1.00 s / 0.82 s (1.21×) | 1.30 s / 1.35 s "
            "| 0, 0.00 GiB | 40 |") in text


def test_wan_host_lossless_scenario_smoke_reads_coded_blocks_from_the_cache(tmp_path):
    import json

    from benchmarks import registry

    scenario = registry.get("pipeline-offload-wan-host-lossless")
    out = tmp_path / "run"
    argv = [*scenario.args, *scenario.smoke, "--in-process", "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--out", str(out)]
    assert bench.main(argv) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    by = {r["strategy"]: r for r in report["strategies"]}
    assert list(by) == ["omni-host", "omni-host-lossless"]
    assert all(r["status"] == "ok" for r in by.values()), {n: r.get("error") for n, r in by.items()}
    assert by["omni-host"]["sha256"] == by["omni-host-lossless"]["sha256"]  # the same video, bit for bit
    coded, plain = report["host_budget_lossless"], report["host_budget"]
    # (the cache is written by the smoke's probe for the least host budget, a refused enable just before this one)
    stats = by["omni-host-lossless"]["omni"]["stats"]
    assert stats["store_blocks"].get("disk (lossless)", 0) > 0 and coded["disk_read_bytes"] > 0  # read coded
    assert plain is not None and "disk (lossless)" not in by["omni-host"]["omni"]["stats"]["store_blocks"]
    text = out.with_suffix(".md").read_text()
    assert "(omni-host-lossless against omni)" in text and "omni-host-lossless: enable" in text
    # --host-lossless-from-memory: no checkpoint for the coded run (the disk holds the cache alone), said in the notes
    assert by["omni-host-lossless"]["checkpoint"]["from_memory"] and not by["omni-host"]["checkpoint"].get("from_memory")
    assert not list((tmp_path / "ckpt").glob("*/*.safetensors")) and "--host-lossless-from-memory" in text


def test_memory_events_name_what_ran_out_of_memory_and_reach_the_notes():
    assert bench.memory_events({}) == []
    events = bench.memory_events({"residents_left": 2, "residents_left_bytes": 2**31, "residents_shrunk": 3,
                                  "residents_shrunk_bytes": 2**30, "window_shrunk": 1, "tiled_vaes": ["vae", "vae"]})
    assert events == ["resident blocks left the device 2× to make room for the VAE (2.00 GiB)",
                      "3 resident blocks stream since a step ran out of memory (1.00 GiB)",
                      "the streaming window holds one block since a step ran out of memory with nothing resident",
                      "vae switched to tiling after running out of memory (its image may differ)"]
    omni = {**_result("omni", (1.0, 3.0, 1.0), "a"), "omni": {"stats": {"residents_left": 1,
                                                                          "residents_left_bytes": 2**30}}}
    args = vars(bench.parse_args(["--model", "flux", "--steps", "4", "--out", "x"]))
    report = {"environment": {"device_name": "H200"}, "args": args, "steps": 4, "strategies": [omni],
              "lower_bounds": [], "omni_budget": None, "notes": [], "components": {}, "size_check": {}}
    assert "- omni: resident blocks left the device 1× to make room for the VAE (1.00 GiB)" in bench.markdown(report)


def test_headroom_notes_say_what_auto_measured_and_moved():
    assert bench.headroom_notes({}) == []
    stats = {"headroom": {"transformer 1×4096×64": 2**31}, "headroom_kept": 3, "headroom_kept_bytes": 2**30,
             "headroom_streamed": 0, "headroom_streamed_bytes": 0}
    assert bench.headroom_notes(stats) == [
        "auto measured beside the resident weights: transformer 1×4096×64 2.00 GiB",
        "auto kept 3 streamed blocks on the device (1.00 GiB) and streamed 0 resident ones first (0.00 GiB)"]
    omni = {**_result("omni", (1.0, 3.0, 1.0), "a"), "omni": {"stats": stats}}
    args = vars(bench.parse_args(["--model", "flux", "--steps", "4", "--out", "x"]))
    report = {"environment": {"device_name": "H200"}, "args": args, "steps": 4, "strategies": [omni],
              "lower_bounds": [], "omni_budget": None, "notes": [], "components": {}, "size_check": {}}
    assert "- omni: auto measured beside the resident weights: transformer 1×4096×64 2.00 GiB; auto kept 3" in \
        bench.markdown(report)
