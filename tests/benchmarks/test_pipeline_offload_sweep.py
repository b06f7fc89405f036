"""``benchmarks/pipeline_offload_bench.py``'s device-budget sweep (#40): ``--omni-budget`` with several budgets and
``auto``, ``--omni-lossless``, what each omni run records of auto's reading and choice and of the lossless store, the
"Budget sweep" table and the plot; the pipeline-offload-flux-auto scenario's arguments run with ``--smoke`` on the
tiny CPU pipeline (in one process: ``--in-process``); and a single budget keeps its name, its table and the docs'
rendering of the committed pipeline-offload-flux result."""

import json

import pytest

from benchmarks import docs_tables, registry, results_io
from benchmarks import pipeline_offload_bench as bench



def test_a_sweep_runs_each_budget_after_omni_in_order_then_its_lossless_runs():
    args = bench.parse_args(["--model", "flux", "--strategies", "resident,omni,mmgp2", "--omni-budget",
                             "4GiB, 8GiB,auto", "--omni-lossless", "auto,none,6GiB", "--out", "x"])
    assert args.strategies == ["resident", "omni", "omni-budget (4GiB)", "omni-budget (8GiB)", "omni-auto",
                               "omni-auto-lossless", "omni-lossless", "omni-budget-lossless (6GiB)", "mmgp2"]
    assert args.omni_runs["omni-auto"] == {"budget": "auto", "compression": None}
    assert args.omni_runs["omni-lossless"] == {"budget": None, "compression": "lossless"}
    assert args.omni_runs["omni-budget-lossless (6GiB)"] == {"budget": "6GiB", "compression": "lossless"}
    # In omni-budget's place when --strategies names it; lossless alone follows omni.
    args = bench.parse_args(["--model", "flux", "--strategies", "omni,mmgp2,omni-budget", "--omni-budget", "8GiB,auto",
                             "--out", "x"])
    assert args.strategies == ["omni", "mmgp2", "omni-budget (8GiB)", "omni-auto"]
    args = bench.parse_args(["--model", "flux", "--strategies", "resident,omni,mmgp2", "--omni-lossless", "auto",
                             "--out", "x"])
    assert args.strategies == ["resident", "omni", "omni-auto-lossless", "mmgp2"]
    # One size keeps today's name (its committed results and docs rows); auto alone is omni-auto.
    assert bench.parse_args(["--model", "flux", "--strategies", "omni", "--omni-budget", "8GiB", "--out", "x"]
                            ).strategies == ["omni", "omni-budget"]
    assert bench.parse_args(["--model", "flux", "--strategies", "omni", "--omni-budget", "AUTO", "--out", "x"]
                            ).strategies == ["omni", "omni-auto"]
    for bad in (["--omni-budget", "8GiB,8GiB"], ["--omni-budget", "8 apples"], ["--omni-budget", "none"],
                ["--omni-lossless", ","], ["--in-process"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--model", "flux", "--strategies", "omni", *bad, "--out", "x"])


def test_plan_summary_reads_autos_choice_and_the_lossless_ratio():
    stats = {"auto": ["max_device_memory=auto: 9.60 GiB (free ...)"], "auto_readings": {"device": "cuda:0"},
             "resident_blocks": 20, "streamed_blocks": 37, "streamed_bytes_per_pass": 15 * 2**30,
             "store_blocks": {"lossless": 37}, "store_bytes": {"lossless": 1000}, "store_host_bytes": {"lossless": 700}}
    notes = ["meta: ...", "auto: max_device_memory=auto: 9.60 GiB (free ...)", "auto read: device cuda:0",
             "lossless: 37 streamed blocks held coded"]
    summary = bench.plan_summary(stats, notes)
    assert summary["compression_ratio"] == pytest.approx(0.7) and summary["lossless_blocks"] == 37
    assert summary["auto"] == stats["auto"] and summary["auto_readings"] == {"device": "cuda:0"}
    assert summary["report_notes"] == notes[1:]
    plain = bench.plan_summary({"streamed_blocks": 57, "resident_blocks": 0}, [])
    assert plain["compression_ratio"] is None and plain["auto"] == [] and plain["auto_readings"] == {}


def test_the_committed_single_budget_result_renders_as_before():
    payload = results_io.read(results_io.find("pipeline-offload-flux"))["payload"]
    text = bench.markdown(payload)
    assert "| omni-budget (8GiB) |" in text and "## Budget sweep" not in text
    assert bench.sweep_runs(payload) == []  # its args predate omni_runs
    docs_tables.result.cache_clear()
    assert 'omni layerwise, `max_device_memory="8GiB"`' in docs_tables.pipeline_offload()


def test_flux_sweep_scenario_runs_the_other_budgets_after_resident():
    scenario = registry.get("pipeline-offload-flux-sweep")
    args = bench.parse_args([*scenario.args, "--out", "unused"])
    assert scenario.args[scenario.args.index("--omni-budget") + 1] == "9GiB,10GiB,11GiB,6GiB,4GiB"
    assert scenario.args[scenario.args.index("--strategies") + 1] == "resident"
    assert args.strategies == ["resident", *(f"omni-budget ({b})" for b in ("9GiB", "10GiB", "11GiB", "6GiB",
                                                                                   "4GiB"))]


def test_flux_auto_scenario_smoke_records_auto_budget_beside_the_sweep_and_plots(tmp_path):
    scenario = registry.get("pipeline-offload-flux-auto")
    assert scenario.docs == ("docs/user_guide/offload.md",) and scenario.smoke == ("--smoke",)
    assert scenario.args[scenario.args.index("--omni-budget") + 1] == "auto,8GiB,9GiB,10GiB,11GiB,6GiB,4GiB"
    out = tmp_path / "run"
    assert bench.main([*scenario.args, *scenario.smoke, "--in-process", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    names = [r["strategy"] for r in report["strategies"]]
    sized = [f"omni-budget ({b})" for b in ("8GiB", "9GiB", "10GiB", "11GiB", "6GiB", "4GiB")]
    assert names == ["resident", "omni-auto", *sized]
    by = {r["strategy"]: r for r in report["strategies"]}
    assert all(r["status"] == "ok" for r in by.values()), {n: r.get("error") for n, r in by.items()}
    assert all(r["sha256"] == by["resident"]["sha256"] for r in by.values())  # every budget: the same image
    rows = {row["strategy"]: row for row in report["budget_sweep"]["rows"]}
    assert list(rows) == names[1:]  # one row per run (no omni without a budget in this scenario)
    assert rows["omni-budget (8GiB)"]["planned_budget_bytes"] > 0
    plan = by["omni-auto"]["omni_plan"]
    assert plan["budget"] == "auto" and plan["max_device_memory"] == "auto" and plan["compression"] is None
    assert plan["planned_budget_bytes"] > 0 and plan["auto"][0].startswith("max_device_memory=auto: ")
    assert plan["auto_readings"]["device"] == "cpu" and "mem_available" in plan["auto_readings"]
    assert any(n.startswith("auto read: ") for n in plan["report_notes"])
    assert rows["omni-auto"]["auto_readings"] == plan["auto_readings"]
    text = out.with_suffix(".md").read_text()
    assert "## Budget sweep" in text and "| omni-auto | auto | auto chose " in text
    assert "omni-auto (chose " in text and "omni-auto: auto read device cpu" in text
    fastest = min(sized, key=lambda name: by[name]["end_to_end_s"])
    ratio = by["omni-auto"]["end_to_end_s"] / by[fastest]["end_to_end_s"]
    assert (f"omni-auto {bench._s(by['omni-auto']['end_to_end_s'])} against the sweep's fastest, {fastest} "
            f"{bench._s(by[fastest]['end_to_end_s'])}: **{ratio:.3f}×** (of 6 sized runs)") in text
    assert report["plot"] == "run.png" and out.with_suffix(".png").stat().st_size > 10_000


def test_flux_lossless_scenario_smoke_runs_lossless_with_no_budget_and_with_auto(tmp_path):
    scenario = registry.get("pipeline-offload-flux-lossless")
    out = tmp_path / "run"
    assert bench.main([*scenario.args, *scenario.smoke, "--in-process", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    by = {r["strategy"]: r for r in report["strategies"]}
    assert list(by) == ["resident", "omni", "omni-lossless", "omni-auto-lossless"]
    assert all(r["status"] == "ok" for r in by.values()), {n: r.get("error") for n, r in by.items()}
    assert all(r["sha256"] == by["resident"]["sha256"] for r in by.values())
    # With no budget every block streams, coded.
    assert by["omni-lossless"]["omni_plan"]["compression"] == "lossless"
    assert 0.5 < by["omni-lossless"]["omni_plan"]["compression_ratio"] < 0.8
    assert by["omni-auto-lossless"]["omni_plan"]["budget"] == "auto"
    assert by["omni-auto-lossless"]["omni_plan"]["compression"] == "lossless"


def test_auto_against_the_sweep_names_the_runs_whose_image_differs_and_the_fastest_exact_one():
    def row(name, budget, seconds, same):
        return {"strategy": name, "status": "ok", "end_to_end_s": seconds, "compression": None, "budget": budget,
                "same_image": same}

    rows = [row("omni", None, 12.0, True), row("omni-auto", "auto", 8.0, False), row("omni-budget (9GiB)", "9GiB", 8.5,
            True), row("omni-budget (11GiB)", "11GiB", 7.5, False)]
    assert bench.auto_against_sweep(rows) == (
        "omni-auto 8.00 s against the sweep's fastest, omni-budget (11GiB) 7.50 s: **1.067×** (of 2 sized runs); "
        "images not the resident one: omni-auto, omni-budget (11GiB); the fastest sized run with the resident image, "
        "omni-budget (9GiB) 8.50 s: auto 0.941× of it.")
    rows = [dict(r, same_image=True) for r in rows]
    assert bench.auto_against_sweep(rows).endswith("**1.067×** (of 2 sized runs).")
    assert bench.auto_against_sweep(rows[:1]) is None  # no auto run
